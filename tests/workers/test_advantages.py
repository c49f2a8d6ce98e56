import json

import pytest
import torch
from torch.testing import assert_close

from rollflow.config import AlgorithmConfig
from rollflow.data.sample import collate
from rollflow.workers.advantages import AdvantageStage
from tests.conftest import step_samples


def _batch():
    return collate(step_samples()[:3], pad_token_id=0)  # masks [1,1,0], [1,0,0], [1,1,1]; rewards (1, 0, 0.5)


def _advantages(batch, max_response_length=3, **options):
    stage = AdvantageStage(AlgorithmConfig(**options), max_response_length)
    metrics = stage(batch)
    return batch.extras["advantages"], metrics, stage


def test_advantage_stage_uses_the_configured_estimator():
    advantages, metrics, _ = _advantages(_batch(), advantage="grpo")
    # group 0 has rewards (1, 0): mean 0.5, unbiased std 0.7071 -> +-0.7071 on every response token
    assert advantages[0, :2].tolist() == pytest.approx([0.70710, 0.70710], abs=1e-4)
    assert advantages[1, 0].item() == pytest.approx(-0.70710, abs=1e-4)
    assert torch.all(advantages[1, 1:] == 0)  # padding
    assert torch.all(advantages[2] == 0)  # a group of one has no baseline signal
    assert "advantage/zero_std_group_frac" in metrics
    assert not any(key.startswith(("reward_shaping/", "kl_reward/")) for key in metrics)  # all off by default


def test_overlong_penalty_counts_back_from_the_generation_limit():
    # L = 3, C = 2: penalty clamp((L - C - len) / C, -1, 0) for lengths (2, 1, 3) = (-0.5, 0, -1);
    # rewards (1, 0, 0.5) -> (0.5, 0, -0.5); reinforce (gamma 1) puts each on every trained token.
    advantages, metrics, _ = _advantages(_batch(), advantage="reinforce", overlong_buffer=2)
    assert_close(advantages, torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0], [-0.5, -0.5, -0.5]]))
    assert metrics["reward_shaping/overlong_penalty_mean"] == pytest.approx((-0.5 + 0.0 - 1.0) / 3)


def test_overlong_filter_zeroes_the_loss_of_truncated_samples_only():
    batch = _batch()
    advantages, metrics, _ = _advantages(batch, advantage="grpo", overlong_filter=True)
    assert batch.response_mask[1].tolist() == [0.0, 0.0, 0.0]  # sample 1 was truncated
    assert batch.response_mask[0].tolist() == [1.0, 1.0, 0.0]
    # its reward still enters the group statistics: sample 0 keeps (1 - 0.5) / 0.7071
    assert advantages[0, 0].item() == pytest.approx(0.70710, abs=1e-4)
    assert torch.all(advantages[1] == 0)
    assert metrics["reward_shaping/overlong_filtered_frac"] == pytest.approx(1 / 3)


def test_reward_normalization_then_clipping():
    # batch mean 0.5, deviations (0.5, -0.5, 0), unbiased std sqrt(0.5 / 2) = 0.5 -> (1, -1, 0); clip 0.8.
    advantages, _, _ = _advantages(_batch(), advantage="reinforce", reward_norm_mean="batch",
                                   reward_norm_std="batch", reward_clip=0.8)
    expected = torch.tensor([[0.8, 0.8, 0.0], [-0.8, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert_close(advantages, expected, atol=1e-5, rtol=0)


def test_running_normalization_keeps_its_moments_across_steps_and_checkpoints():
    stage = AdvantageStage(AlgorithmConfig(advantage="reinforce", reward_norm_mean="running",
                                           reward_norm_std="running"), 3)
    stage(_batch())
    stage(_batch())
    # six rewards (1, 0, 0.5) x 2: mean 0.5, squared deviations 4 x 0.25 = 1, unbiased std sqrt(1 / 5) = 0.4472
    assert stage.reward_moments.mean == pytest.approx(0.5)
    assert stage.reward_moments.std == pytest.approx(0.44721, abs=1e-5)
    restored = AdvantageStage(stage.algorithm, 3)
    restored.load_state(stage.state())
    assert vars(restored.reward_moments) == vars(stage.reward_moments)


def test_kl_penalty_in_the_reward_with_an_adaptive_coefficient():
    batch = _batch()
    batch.extras["old_logprobs"] = batch.rollout_logprobs.clone()  # (-0.5, -0.25), (-1), (-0.1, -0.2, -0.3)
    batch.extras["ref_logprobs"] = torch.zeros_like(batch.rollout_logprobs)
    advantages, metrics, stage = _advantages(
        batch, advantage="reinforce", kl_reward_coef=0.1, kl_reward_controller="adaptive", kl_reward_target=0.1,
        kl_reward_horizon=30)
    # k1 KL = old - ref = old; token rewards -0.1 * KL: (0.05, 0.025), (0.1), (0.01, 0.02, 0.03); scalar rewards
    # (1, 0, 0.5) at the last token; reward-to-go: (1.075, 1.025), (0.1), (0.56, 0.55, 0.53).
    assert_close(advantages, torch.tensor([[1.075, 1.025, 0.0], [0.1, 0.0, 0.0], [0.56, 0.55, 0.53]]))
    # KL per sample (token mean): -0.375, -1, -0.2 -> mean -0.525; beta *= 1 + clip(-0.525 / 0.1 - 1, +-0.2) * 3 / 30
    assert metrics["kl_reward/kl"] == pytest.approx(-0.525)
    assert metrics["kl_reward/coef"] == pytest.approx(0.1)  # the coefficient used this step
    assert stage.kl_controller.value == pytest.approx(0.1 * (1 - 0.2 * 3 / 30))


def test_whitening_then_advantage_clipping():
    # grpo: a = 0.7071 on tokens (a, a, -a, 0, 0, 0); mean a/6, unbiased std a * sqrt(102/180) = 0.75277a, so
    # whitened (5/6, 5/6, -7/6, -1/6, -1/6, -1/6) / 0.75277 = (1.10702, 1.10702, -1.54983, -0.22140, ...).
    advantages, metrics, _ = _advantages(_batch(), advantage="grpo", whiten_advantages=True, advantage_clip=1.5)
    expected = torch.tensor([[1.10702, 1.10702, 0.0], [-1.5, 0.0, 0.0], [-0.22140, -0.22140, -0.22140]])
    assert_close(advantages, expected, atol=1e-4, rtol=0)
    assert metrics["advantage/clip_frac"] == pytest.approx(1 / 6)


def test_opd_distills_towards_the_reference_worker():
    batch = _batch()
    batch.extras["old_logprobs"] = batch.rollout_logprobs.clone()
    batch.extras["ref_logprobs"] = torch.full_like(batch.rollout_logprobs, -0.5)  # the teacher
    advantages, metrics, stage = _advantages(batch, advantage="opd")
    assert stage.needs_policy_logprobs
    # teacher - student: (-0.5 + 0.5, -0.5 + 0.25), (-0.5 + 1), (-0.5 + 0.1, -0.5 + 0.2, -0.5 + 0.3)
    assert_close(advantages, torch.tensor([[0.0, -0.25, 0.0], [0.5, 0.0, 0.0], [-0.4, -0.3, -0.2]]))
    assert metrics["advantage/reverse_kl_mean"] == pytest.approx(-(0.0 - 0.25 + 0.5 - 0.4 - 0.3 - 0.2) / 6)


def _domain_batch():
    """Two domains: `b` = samples (0, 1) with rewards (1, 3), `a` = samples (2, 3) with rewards (0, 10)."""
    from rollflow.data.sample import Sample

    samples = [Sample([1], [2], group_id=group, reward=reward, domain=domain) for group, reward, domain in
               [(0, 1.0, "b"), (0, 3.0, "b"), (1, 0.0, "a"), (1, 10.0, "a")]]
    return collate(samples, pad_token_id=0)


def test_reward_normalization_by_domain_keeps_running_moments_per_domain_in_checkpoints():
    options = {"advantage": "reinforce", "reward_norm_mean": "running", "reward_norm_std": "running",
               "reward_norm_by_domain": True}
    batch = _domain_batch()
    assert batch.domain_names == ("a", "b") and batch.domain_ids.tolist() == [1, 1, 0, 0]
    advantages, _, stage = _advantages(batch, max_response_length=1, **options)
    # b: mean 2, unbiased std sqrt(2) -> (-0.707107, 0.707107); a: mean 5, std sqrt(50) = 7.071068 -> (-0.707107,
    # 0.707107). Over the whole batch (mean 3.5, std 4.509250) they would be (-0.554, -0.111, -0.776, 1.441).
    assert_close(advantages[:, 0], torch.tensor([-0.707107, 0.707107, -0.707107, 0.707107]), atol=1e-5, rtol=0)
    assert stage.domain_reward_moments["a"].mean == 5.0 and stage.domain_reward_moments["b"].mean == 2.0
    assert stage.reward_moments.count == 0  # the overall moments are not used
    restored = AdvantageStage(stage.algorithm, 1)
    restored.load_state(json.loads(json.dumps(stage.state())))  # what a checkpoint keeps
    assert {name: vars(m) for name, m in restored.domain_reward_moments.items()} == {
        name: vars(m) for name, m in stage.domain_reward_moments.items()}
    # without the option the batch is normalized as a whole: mean 3.5
    whole, _, _ = _advantages(_domain_batch(), max_response_length=1, advantage="reinforce",
                              reward_norm_mean="batch")
    assert_close(whole[:, 0], torch.tensor([-2.5, -0.5, -3.5, 6.5]))
