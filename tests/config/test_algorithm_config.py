"""Load-time validation of the advantage-stage, correction and critic options."""

import pytest

from rollflow.config import load_config
from rollflow.errors import ConfigError


def test_every_new_option_is_off_by_default():
    algorithm = load_config(None).algorithm
    assert (algorithm.reward_norm_mean, algorithm.reward_norm_std) == ("none", "none")
    assert algorithm.reward_clip is None and algorithm.advantage_clip is None and not algorithm.whiten_advantages
    assert algorithm.overlong_buffer is None and not algorithm.overlong_filter and algorithm.difficulty_mask is None
    assert algorithm.kl_reward_coef == 0 and algorithm.train_infer_correction is None
    assert not algorithm.reward_norm_by_domain
    assert not algorithm.needs_reference and not algorithm.needs_critic


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.reward_norm_std=grup"], r"algorithm\.reward_norm_std: Input should be 'none', 'batch'"),
    (["algorithm.difficulty_mask=[1.0, 0.0]"], "needs low < high"),
    (["algorithm.kl_reward_coef=0.1", "algorithm.kl_reward_controller=adaptive"], "needs kl_reward_target"),
    (["algorithm.kl_reward_estimator=k4"], "unknown KL estimator 'k4'"),
    (["algorithm.overlong_buffer=9", "rollout.max_new_tokens=8"], "overlong_buffer .* longer than rollout.max_new"),
    (["train.critic_warmup_steps=2"], "uses no critic"),
    (["algorithm.advantage=gae", "train.critic_warmup_steps=5", "train.steps=5"], "the actor would never train"),
    (["algorithm.train_infer_correction={weight_level: null}"], "set weight_level .* or mask_level"),
    (["algorithm.train_infer_correction.uper_bound=3"], "did you mean 'algorithm.train_infer_correction.upper_bound'"),
])
def test_inconsistent_options_fail_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_roles_follow_the_algorithm():
    assert load_config(None, ["algorithm.advantage=gae"]).algorithm.needs_critic
    for overrides in (["algorithm.kl_loss_coef=0.1"], ["algorithm.kl_reward_coef=0.1"], ["algorithm.advantage=opd"]):
        assert load_config(None, overrides).algorithm.needs_reference
    correction = load_config(None, ["algorithm.train_infer_correction.mask_level=geometric"])
    assert correction.algorithm.train_infer_correction.weight_level == "token"  # the other keys keep defaults
