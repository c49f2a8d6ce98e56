"""Registry names, unknown-name errors, option checking, and the contract every registered function keeps."""

import inspect
import math
import re

import pytest
import torch

from rollflow.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AGENTIC_ADVANTAGES,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    AdvantageInputs,
    PolicyLossInputs,
    aggregate_loss,
    check_hyperparams,
    kl_penalty,
)
from rollflow.registry import UnknownNameError


def test_registered_names():
    """Importing `rollflow.algorithms` registers the built-ins (a name registered later breaks nothing)."""
    assert {"dr_grpo", "gae", "grpo", "lite_ppo", "opd", "reinforce", "reinforce_pp", "rloo"} <= \
        set(ADVANTAGE_ESTIMATORS.names())
    assert {"cispo", "gspo", "ipa_chunk", "kimi15", "ppo", "raft_pp", "tis", "topr", "vanilla_pg"} <= \
        set(POLICY_LOSSES.names())
    assert {"abs", "k1", "k2", "k3", "mse"} <= set(KL_ESTIMATORS.names())
    assert {"seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "token_mean"} <= \
        set(LOSS_AGGREGATIONS.names())
    assert {"gigpo", "starpo", "step_reinforce"} <= set(AGENTIC_ADVANTAGES.names())


ALL_REGISTRIES = [ADVANTAGE_ESTIMATORS, POLICY_LOSSES, KL_ESTIMATORS, LOSS_AGGREGATIONS, AGENTIC_ADVANTAGES]


@pytest.mark.parametrize("registry", ALL_REGISTRIES)
def test_unknown_name_lists_valid_names(registry):
    with pytest.raises(UnknownNameError) as error:
        registry.get("no_such_thing")
    for name in registry.names():
        assert name in str(error.value)


def test_unknown_name_through_helpers():
    mask = torch.ones(1, 2)
    with pytest.raises(UnknownNameError, match="token_mean"):
        aggregate_loss(torch.zeros(1, 2), mask, "token-mean")
    with pytest.raises(UnknownNameError, match=re.escape("Valid: " + ", ".join(KL_ESTIMATORS.names()))):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), "k4")


def test_check_hyperparams_suggests_the_nearest_option():
    ppo = POLICY_LOSSES.get("ppo")
    check_hyperparams(ppo, {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0})
    with pytest.raises(ValueError) as error:
        check_hyperparams(ppo, {"clip_hi": 0.28})
    assert str(error.value) == (
        "unknown option 'clip_hi' for policy loss 'ppo'; did you mean 'clip_high'? "
        "valid: behaviour_weight_cap, clip_high, clip_low, decoupled, dual_clip"
    )


def test_check_hyperparams_for_functions_without_options():
    with pytest.raises(
        ValueError, match="unknown option 'epsilon' for advantage estimator 'dr_grpo'; valid: \\(none\\)"
    ):
        check_hyperparams(ADVANTAGE_ESTIMATORS.get("dr_grpo"), {"epsilon": 1e-6})
    check_hyperparams(ADVANTAGE_ESTIMATORS.get("gae"), {"gamma": 0.99, "lam": 0.95})


def test_check_hyperparams_unregistered_function_and_required_option():
    def my_loss(inputs, *, scale, bias=0.0):
        return inputs

    with pytest.raises(ValueError, match="missing required option 'scale' for function 'my_loss'"):
        check_hyperparams(my_loss, {"bias": 1.0})
    check_hyperparams(my_loss, {"scale": 1.0})


ALL_FUNCTIONS = [(registry, name) for registry in ALL_REGISTRIES for name in registry.names()]


@pytest.mark.parametrize(("registry", "name"), ALL_FUNCTIONS, ids=[f"{r.kind}:{n}" for r, n in ALL_FUNCTIONS])
def test_documented_and_options_are_keyword_only_with_defaults(registry, name):
    fn = registry.get(name)
    doc = inspect.getdoc(fn)
    assert doc and "Args:" in doc and "Returns:" in doc
    params = list(inspect.signature(fn).parameters.values())
    for param in params:
        if param.kind is inspect.Parameter.KEYWORD_ONLY:
            assert param.default is not param.empty, f"{name}: option {param.name} needs a default"
        else:
            assert param.default is param.empty, f"{name}: {param.name} should be keyword-only"


def _random_batch(seed=0, length=5):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 3, 1, 0, 4, 2])
    mask = (torch.arange(length) < lengths.unsqueeze(1)).float()  # [B, T], one empty row
    mask[0, 2] = 0.0  # a hole, as an env token in a multi-turn trajectory
    return generator, mask


def _nan_padded(values, mask):
    """Padding is not guaranteed to be clean: NaN there must not leak into results or gradients."""
    return torch.where(mask > 0, values, torch.full_like(values, float("nan")))


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_advantage_contract(name):
    generator, mask = _random_batch()
    inputs = AdvantageInputs(
        rewards=torch.rand(6, generator=generator),
        mask=mask,
        group_ids=torch.tensor([3, 1, 3, 1, 3, 8]),
        token_rewards=_nan_padded(torch.randn(6, 5, generator=generator) * 0.1, mask),
        values=_nan_padded(torch.randn(6, 5, generator=generator), mask),
        logprobs=_nan_padded(-torch.rand(6, 5, generator=generator), mask),
        teacher_logprobs=_nan_padded(-torch.rand(6, 5, generator=generator), mask),
    )
    advantages, returns, metrics = ADVANTAGE_ESTIMATORS.get(name)(inputs)
    assert advantages.shape == returns.shape == mask.shape
    assert torch.all(advantages[mask == 0] == 0) and torch.all(returns[mask == 0] == 0)
    assert torch.isfinite(advantages).all() and torch.isfinite(returns).all()
    assert all(isinstance(value, float) and math.isfinite(value) for value in metrics.values())


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_policy_loss_contract(name):
    generator, mask = _random_batch()
    logprobs = _nan_padded(-torch.rand(6, 5, generator=generator), mask).requires_grad_()
    old = logprobs.detach() + 0.1 * torch.randn(6, 5, generator=generator)
    inputs = PolicyLossInputs(
        logprobs=logprobs,
        old_logprobs=old,
        advantages=torch.randn(6, 5, generator=generator) * mask,
        mask=mask,
        rollout_logprobs=old + 0.1 * torch.randn(6, 5, generator=generator),
        rewards=torch.tensor([1.0, 0.0, 1.0, 0.0, -1.0, 1.0]),
        segment_ids=torch.where(mask > 0, torch.arange(5) // 2, -1),  # [B, T] turns of 2 tokens (ipa_chunk)
    )
    loss, metrics = POLICY_LOSSES.get(name)(inputs)
    assert loss.shape == mask.shape
    assert torch.all(loss[mask == 0] == 0) and torch.isfinite(loss).all()
    loss.sum().backward()
    assert torch.isfinite(logprobs.grad).all()
    assert torch.all(logprobs.grad[mask == 0] == 0)
    assert all(isinstance(value, float) and math.isfinite(value) for value in metrics.values())
