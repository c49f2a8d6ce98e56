"""Policy losses: hand-computed losses and gradients, stop-gradient importance weights, metrics."""

import math

import pytest
import torch
from torch.testing import assert_close

from rollflow.algorithms import POLICY_LOSSES, PolicyLossInputs, aggregate_loss, entropy_from_logits

LN = math.log


def _inputs(ratios, advantages, mask=None, rewards=None, rollout_logprobs=None):
    """Old log-probs 0, current log-probs log(ratio): the ratio is exactly `ratios` and d ratio/d logp = ratio."""
    logprobs = torch.tensor(ratios).log().requires_grad_()
    mask = torch.ones_like(logprobs) if mask is None else torch.tensor(mask)
    return PolicyLossInputs(
        logprobs=logprobs,
        old_logprobs=torch.zeros_like(logprobs),
        advantages=torch.tensor(advantages),
        mask=mask,
        rollout_logprobs=rollout_logprobs,
        rewards=None if rewards is None else torch.tensor(rewards),
    )


def _loss_and_grad(name, inputs, **options):
    loss, metrics = POLICY_LOSSES.get(name)(inputs, **options)
    loss.sum().backward()
    return loss.detach(), inputs.logprobs.grad, metrics


# PPO case, clip 0.2/0.2 (range [0.8, 1.2]):
#   tok0 r=1.5 A=+1: unclipped -1.5, clipped -1.2 -> max -1.2 (clipped, grad 0)
#   tok1 r=0.5 A=+1: unclipped -0.5, clipped -0.8 -> max -0.5 (grad -A r = -0.5)
#   tok2 r=1.1 A=-1: both 1.1                    -> 1.1      (grad -A r = 1.1)
#   tok3 r=3.5 A=-1: unclipped 3.5, clipped 1.2  -> 3.5      (grad 3.5); dual clip c=3: min(3.5, 3) = 3 (grad 0)
PPO_RATIOS = [[1.5, 0.5, 1.1, 3.5]]
PPO_ADVANTAGES = [[1.0, 1.0, -1.0, -1.0]]


def test_ppo_clip():
    loss, grad, metrics = _loss_and_grad("ppo", _inputs(PPO_RATIOS, PPO_ADVANTAGES))
    assert_close(loss, torch.tensor([[-1.2, -0.5, 1.1, 3.5]]))
    assert_close(grad, torch.tensor([[0.0, -0.5, 1.1, 3.5]]))
    assert metrics["clip_frac"] == pytest.approx(0.25)  # tok0
    assert metrics["clip_frac_high"] == pytest.approx(0.5)  # tok0, tok3 above 1.2
    assert metrics["clip_frac_low"] == pytest.approx(0.25)  # tok1 below 0.8
    assert metrics["ratio_max"] == pytest.approx(3.5) and metrics["ratio_min"] == pytest.approx(0.5)
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 3.5) / 4)
    # approx_kl = mean 0.5 * ln(r)^2; policy_kl = mean -ln(r)
    assert metrics["approx_kl"] == pytest.approx(sum(0.5 * LN(r) ** 2 for r in PPO_RATIOS[0]) / 4, rel=1e-5)
    assert metrics["policy_kl"] == pytest.approx(-sum(LN(r) for r in PPO_RATIOS[0]) / 4, rel=1e-5)


def test_ppo_dual_clip():
    loss, grad, metrics = _loss_and_grad("ppo", _inputs(PPO_RATIOS, PPO_ADVANTAGES), dual_clip=3.0)
    assert_close(loss, torch.tensor([[-1.2, -0.5, 1.1, 3.0]]))
    assert_close(grad, torch.tensor([[0.0, -0.5, 1.1, 0.0]]))
    assert metrics["dual_clip_frac"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        POLICY_LOSSES.get("ppo")(_inputs(PPO_RATIOS, PPO_ADVANTAGES), dual_clip=0.5)


def test_ppo_clip_higher():
    # clip_high 0.6: range [0.8, 1.6]; tok0 r=1.5 is no longer clipped -> loss -1.5, grad -1.5.
    loss, grad, _ = _loss_and_grad("ppo", _inputs(PPO_RATIOS, PPO_ADVANTAGES), clip_high=0.6)
    assert_close(loss, torch.tensor([[-1.5, -0.5, 1.1, 3.5]]))
    assert_close(grad, torch.tensor([[-1.5, -0.5, 1.1, 3.5]]))


def test_ppo_decoupled_behaviour_weight():
    # rollout logprob ln(0.5) against old 0: behaviour weight exp(0 - ln 0.5) = 2, capped at 1.5.
    rollout = torch.full((1, 4), LN(0.5))
    loss, grad, metrics = _loss_and_grad(
        "ppo",
        _inputs(PPO_RATIOS, PPO_ADVANTAGES, rollout_logprobs=rollout),
        decoupled=True,
        behaviour_weight_cap=1.5,
    )
    assert_close(loss, 1.5 * torch.tensor([[-1.2, -0.5, 1.1, 3.5]]))
    assert_close(grad, 1.5 * torch.tensor([[0.0, -0.5, 1.1, 3.5]]))
    assert metrics["behaviour_weight_clip_frac"] == pytest.approx(1.0)
    assert metrics["behaviour_weight_mean"] == pytest.approx(1.5)
    loss, _, _ = _loss_and_grad(
        "ppo",
        _inputs(PPO_RATIOS, PPO_ADVANTAGES, rollout_logprobs=rollout),
        decoupled=True,
        behaviour_weight_cap=None,
    )
    assert_close(loss, 2.0 * torch.tensor([[-1.2, -0.5, 1.1, 3.5]]))
    with pytest.raises(ValueError, match="rollout_logprobs"):
        POLICY_LOSSES.get("ppo")(_inputs(PPO_RATIOS, PPO_ADVANTAGES), decoupled=True)


def test_ppo_masked_tokens_carry_no_loss_and_nan_pads_are_harmless():
    logprobs = torch.tensor([[0.1, float("nan")]], requires_grad=True)
    inputs = PolicyLossInputs(
        logprobs=logprobs,
        old_logprobs=torch.tensor([[0.0, float("nan")]]),
        advantages=torch.tensor([[1.0, 0.0]]),
        mask=torch.tensor([[1.0, 0.0]]),
    )
    loss, metrics = POLICY_LOSSES.get("ppo")(inputs)
    assert loss[0, 1] == 0 and torch.isfinite(loss).all()
    loss.sum().backward()
    assert torch.isfinite(logprobs.grad).all() and logprobs.grad[0, 1] == 0
    assert math.isfinite(metrics["ratio_mean"])


def test_vanilla_pg():
    # loss = -A logp = (-2 * -1, -(-1) * -2) = (2, -2); grad = -A = (-2, 1).
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    inputs = PolicyLossInputs(logprobs, torch.zeros(1, 2), torch.tensor([[2.0, -1.0]]), torch.ones(1, 2))
    loss, grad, _ = _loss_and_grad("vanilla_pg", inputs)
    assert_close(loss, torch.tensor([[2.0, -2.0]]))
    assert_close(grad, torch.tensor([[-2.0, 1.0]]))


def test_cispo_stop_gradient_weights():
    # Default clip_low 1.0, clip_high 0.2: weights clamp(r, 0, 1.2) = (1.2, 0.5, 1.1).
    # loss = -w A ln r: -1.2*1*ln1.5 = -0.486558; -0.5*(-1)*ln0.5 = -0.346574; -1.1*2*ln1.1 = -0.209682.
    # grad = -w A (the weight is a constant): (-1.2, 0.5, -2.2).
    loss, grad, metrics = _loss_and_grad("cispo", _inputs([[1.5, 0.5, 1.1]], [[1.0, -1.0, 2.0]]))
    assert_close(loss, torch.tensor([[-0.486558, -0.346574, -0.209682]]), atol=1e-5, rtol=0)
    assert_close(grad, torch.tensor([[-1.2, 0.5, -2.2]]))
    assert metrics["clip_frac"] == pytest.approx(1 / 3)


def test_cispo_unified_mask():
    # clip_low 0.2: tok0 (A>0, r 1.5 > 1.2) and tok1 (A<0, r 0.5 < 0.8) are dropped; tok2 stays -0.209682.
    loss, grad, metrics = _loss_and_grad(
        "cispo", _inputs([[1.5, 0.5, 1.1]], [[1.0, -1.0, 2.0]]), clip_low=0.2, unified_mask=True
    )
    assert_close(loss, torch.tensor([[0.0, 0.0, -0.209682]]), atol=1e-5, rtol=0)
    assert_close(grad, torch.tensor([[0.0, 0.0, -2.2]]))
    assert metrics["masked_frac"] == pytest.approx(2 / 3)


def test_tis_stop_gradient_weights():
    # bounds [0, 1]: w = (1, 0.5); loss = -w A ln r = (-ln1.5, -0.5 ln0.5) = (-0.405465, 0.346574); grad = -w A.
    loss, grad, metrics = _loss_and_grad("tis", _inputs([[1.5, 0.5]], [[1.0, 1.0]]))
    assert_close(loss, torch.tensor([[-0.405465, 0.346574]]), atol=1e-5, rtol=0)
    assert_close(grad, torch.tensor([[-1.0, -0.5]]))
    assert metrics["clip_frac_high"] == pytest.approx(0.5)


TOPR_RATIOS = [[2.0, 0.5], [2.0, 0.5]]
TOPR_ADVANTAGES = [[1.0, 1.0], [-1.0, -1.0]]


def test_topr():
    # Row 0 (reward 1 > 0): loss = -A ln r = (-ln2, -ln0.5) = (-0.693147, 0.693147), grad -A = (-1, -1).
    # Row 1 (reward 0): w = clamp(r, 0, 1) = (1, 0.5); loss = -w A ln r = (ln2, 0.5 ln0.5) = (0.693147, -0.346574);
    #                   grad = -w A = (1, 0.5).
    loss, grad, metrics = _loss_and_grad("topr", _inputs(TOPR_RATIOS, TOPR_ADVANTAGES, rewards=[1.0, 0.0]))
    assert_close(loss, torch.tensor([[-0.693147, 0.693147], [0.693147, -0.346574]]), atol=1e-5, rtol=0)
    assert_close(grad, torch.tensor([[-1.0, -1.0], [1.0, 0.5]]))
    assert metrics["positive_frac"] == 0.5
    assert metrics["negative_clip_frac"] == 0.5  # row 1: r = 2 is truncated, r = 0.5 is not


def test_topr_weights():
    inputs = _inputs(TOPR_RATIOS, TOPR_ADVANTAGES, rewards=[1.0, 0.0])
    loss, grad, _ = _loss_and_grad("topr", inputs, positive_weight=2.0, negative_weight=0.5)
    assert_close(loss, torch.tensor([[-1.386294, 1.386294], [0.346574, -0.173287]]), atol=1e-5, rtol=0)
    assert_close(grad, torch.tensor([[-2.0, -2.0], [0.5, 0.25]]))
    with pytest.raises(ValueError, match="rewards"):
        POLICY_LOSSES.get("topr")(_inputs(TOPR_RATIOS, TOPR_ADVANTAGES))


def test_raft_pp():
    # Row 0 (reward 1) kept with advantage 1: loss = -min(r, clip(r, 0.8, 1.2)) = (-1.2, -0.5); grad (0, -0.5).
    # Row 1 (reward 0) dropped. The given advantages (here 7) are not used.
    inputs = _inputs([[1.5, 0.5], [1.5, 0.5]], [[7.0, 7.0], [7.0, 7.0]], rewards=[1.0, 0.0])
    loss, grad, metrics = _loss_and_grad("raft_pp", inputs)
    assert_close(loss, torch.tensor([[-1.2, -0.5], [0.0, 0.0]]))
    assert_close(grad, torch.tensor([[0.0, -0.5], [0.0, 0.0]]))
    assert metrics["kept_frac"] == 0.5
    assert metrics["clip_frac"] == 0.5


def test_kimi15():
    # log ratio = (-1 + 1.5, -2 + 2) = (0.5, 0); penalty = 0.1/2 * (0.25, 0) = (0.0125, 0).
    # loss = -A logp + penalty = (1 + 0.0125, -2) ; grad = -A + tau (logp - old) = (-1 + 0.05, 1).
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    inputs = PolicyLossInputs(
        logprobs, torch.tensor([[-1.5, -2.0]]), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    )
    loss, grad, metrics = _loss_and_grad("kimi15", inputs, tau=0.1)
    assert_close(loss, torch.tensor([[1.0125, -2.0]]))
    assert_close(grad, torch.tensor([[-0.95, 1.0]]))
    assert metrics["penalty_mean"] == pytest.approx(0.00625)


def test_gspo_sequence_ratio_and_token_gradient():
    # Row 0: log ratios (0.2, -0.4) -> mean -0.1 -> s = exp(-0.1) = 0.904837 on both tokens, A = 1 (inside [0.8, 1.2]).
    # Row 1: one token, log ratio 0.5 -> s = 1.648721, A = 1 -> clipped to 1.2: loss -1.2, no gradient.
    logprobs = torch.tensor([[0.2, -0.4], [0.5, 9.0]], requires_grad=True)
    inputs = PolicyLossInputs(
        logprobs=logprobs,
        old_logprobs=torch.zeros(2, 2),
        advantages=torch.ones(2, 2),
        mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
    )
    loss, metrics = POLICY_LOSSES.get("gspo")(inputs, clip_low=0.2, clip_high=0.2)
    assert_close(loss.detach(), torch.tensor([[-0.904837, -0.904837], [-1.2, 0.0]]), atol=1e-5, rtol=0)
    assert metrics["clip_frac"] == 0.5  # one of two sequences
    assert metrics["seq_ratio_mean"] == pytest.approx((0.904837 + 1.648721) / 2, rel=1e-5)
    # GSPO gradient (paper, eq. 10): d/d logp_t of -(1/B) sum_i s_i A_i = -(1/B) s_i A_i / |y_i| for unclipped i.
    # seq_mean_token_mean over B = 2: tokens of row 0 get -0.904837 / 2 / 2 = -0.226209; row 1 is clipped: 0.
    aggregate_loss(loss, inputs.mask, "seq_mean_token_mean").backward()
    assert_close(logprobs.grad, torch.tensor([[-0.226209, -0.226209], [0.0, 0.0]]), atol=1e-6, rtol=0)


def test_gspo_matches_sequence_level_objective():
    # With per-sequence advantages and no clipping, GSPO-token under seq_mean_token_mean has the same gradient
    # as the sequence objective -mean_i(s_i A_i) with s_i = exp(mean_t log ratio) NOT detached.
    generator = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    old = -torch.rand(3, 4, generator=generator)
    base = old + 0.01 * torch.randn(3, 4, generator=generator)
    advantages = torch.tensor([0.5, -1.0, 2.0])
    logprobs = base.clone().requires_grad_()
    inputs = PolicyLossInputs(logprobs, old, advantages.unsqueeze(1) * mask, mask)
    loss, _ = POLICY_LOSSES.get("gspo")(inputs, clip_low=0.5, clip_high=0.5)
    aggregate_loss(loss, mask, "seq_mean_token_mean").backward()
    reference = base.clone().requires_grad_()
    seq_ratio = (((reference - old) * mask).sum(1) / mask.sum(1)).exp()
    (-(seq_ratio * advantages).mean()).backward()
    assert_close(logprobs.grad, reference.grad * mask, atol=1e-6, rtol=1e-5)


def test_entropy_from_logits():
    # Uniform over 2: ln 2 = 0.693147. Probs (1/4, 3/4): -(0.25 ln0.25 + 0.75 ln0.75) = 0.346574 + 0.215762 = 0.562335.
    logits = torch.tensor([[[0.0, 0.0], [0.0, LN(3.0)]]])
    assert_close(entropy_from_logits(logits), torch.tensor([[0.693147, 0.562335]]), atol=1e-6, rtol=0)
    assert entropy_from_logits(logits.bfloat16()).dtype == torch.float32
