"""Advantage estimators, registered in `ADVANTAGE_ESTIMATORS`.

Every estimator has the signature

    fn(inputs: AdvantageInputs, *, **options) -> (advantages [B, T], returns [B, T], metrics: dict[str, float])

and returns tensors that are zero where `mask == 0`.

Token rewards. `inputs.token_rewards` [B, T] holds per-token rewards such as `-beta * KL_t`. Estimators
built on returns (`gae`, `reinforce`, `reinforce_pp`) add the scalar reward at each row's last trained
token and discount the sum. The group estimators (`grpo`, `dr_grpo`, `rloo`, `lite_ppo`) compute one
score per sample from the scalar rewards and add to it the undiscounted reward-to-go of the token rewards,
`A_t = score + sum_{k >= t} token_rewards_k`, which is what ROLL computes for GRPO with token-level KL.
`opd` uses neither.

Masked positions inside a row (tool or environment tokens of a multi-turn trajectory) are skipped by the
recursions: they neither receive reward nor count as a discounting step, so `gamma` acts per trained
token, as in verl's multi-turn GAE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rollflow.algorithms.reductions import (
    batch_std,
    group_count,
    group_mean,
    group_std,
    group_sum,
    masked_float_metric,
)
from rollflow.algorithms.registries import ADVANTAGE_ESTIMATORS
from rollflow.algorithms.reward_shaping import whiten


@dataclass
class AdvantageInputs:
    """What an advantage estimator may read. Unused fields may be None.

    Attributes:
        rewards: [B] scalar reward per sample, after reward shaping.
        mask: [B, T] float, 1.0 on trained response tokens.
        group_ids: [B] long, shared by the samples of one prompt.
        token_rewards: [B, T] per-token rewards (e.g. -beta * KL), or None.
        values: [B, T] critic values (gae), or None.
        logprobs: [B, T] policy log-probs (opd), or None.
        teacher_logprobs: [B, T] teacher log-probs (opd), or None.
    """

    rewards: Tensor
    mask: Tensor
    group_ids: Tensor
    token_rewards: Tensor | None = None
    values: Tensor | None = None
    logprobs: Tensor | None = None
    teacher_logprobs: Tensor | None = None


def last_token_index(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Index of each row's last trained token.

    Args:
        mask: [B, T] float.

    Returns:
        (index [B] long, has_tokens [B] bool); index is 0 for rows without trained tokens.
    """
    num_positions = mask.shape[1]
    positions = torch.arange(num_positions, device=mask.device).expand_as(mask)  # [B, T]
    index = torch.where(mask > 0, positions, -1).max(dim=1).values  # [B]
    has_tokens = index >= 0  # [B]
    return index.clamp(min=0), has_tokens


def terminal_token_rewards(rewards: Tensor, mask: Tensor, token_rewards: Tensor | None = None) -> Tensor:
    """Per-token rewards with the scalar reward added at each row's last trained token.

    Args:
        rewards: [B] scalar rewards.
        mask: [B, T] float.
        token_rewards: [B, T] per-token rewards, or None for zeros.

    Returns:
        [B, T] rewards, zero where mask == 0.
    """
    if token_rewards is None:
        dense = torch.zeros_like(mask, dtype=rewards.dtype)  # [B, T]
    else:  # `where`, not `* mask`: padding may hold NaN
        dense = torch.where(mask > 0, token_rewards, torch.zeros_like(token_rewards))  # [B, T]
    index, has_tokens = last_token_index(mask)  # [B], [B]
    terminal = torch.where(has_tokens, rewards, torch.zeros_like(rewards))  # [B]
    return dense.scatter_add(1, index.unsqueeze(1), terminal.unsqueeze(1).to(dense.dtype))  # [B, T]


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Reward-to-go `G_t = r_t + gamma * G_next`, where `next` is the next trained token.

    Args:
        token_rewards: [B, T] rewards (already zero where mask == 0).
        mask: [B, T] float.
        gamma: discount per trained token.

    Returns:
        [B, T] returns, zero where mask == 0.
    """
    if gamma == 1.0:  # undiscounted: a reverse cumulative sum, no python loop over T
        return (token_rewards * mask).flip(1).cumsum(1).flip(1) * mask  # [B, T]
    returns = torch.zeros_like(token_rewards)  # [B, T]
    running = torch.zeros_like(token_rewards[:, 0])  # [B]
    for t in reversed(range(token_rewards.shape[1])):
        m = mask[:, t]  # [B]
        running = m * (token_rewards[:, t] + gamma * running) + (1.0 - m) * running  # skip untrained tokens
        returns[:, t] = running * m
    return returns


def _require(value: Tensor | None, field: str, estimator: str) -> Tensor:
    if value is None:
        raise ValueError(f"advantage estimator {estimator!r} needs AdvantageInputs.{field}")
    return value


def _metrics(advantages: Tensor, returns: Tensor, mask: Tensor) -> dict[str, float]:
    return {
        "advantages_mean": masked_float_metric(advantages, mask, "mean"),
        "advantages_max": masked_float_metric(advantages, mask, "max"),
        "advantages_min": masked_float_metric(advantages, mask, "min"),
        "returns_mean": masked_float_metric(returns, mask, "mean"),
    }


def _broadcast_score(score: Tensor, inputs: AdvantageInputs) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Per-sample score [B] -> advantages = returns = score + reward-to-go of token rewards, masked."""
    mask = inputs.mask
    advantages = score.unsqueeze(1).to(mask.dtype) * mask  # [B, T]
    if inputs.token_rewards is not None:
        token_rewards = torch.where(mask > 0, inputs.token_rewards, torch.zeros_like(inputs.token_rewards))
        advantages = advantages + discounted_returns(token_rewards, mask, 1.0)  # [B, T]
    return advantages, advantages, _metrics(advantages, advantages, mask)


@ADVANTAGE_ESTIMATORS.register("gae")
def gae(inputs: AdvantageInputs, *, gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, Tensor, dict]:
    """Generalized advantage estimation (Schulman et al., 2016) with a critic.

    `r_t` = token rewards plus the scalar reward at the last trained token;
    `delta_t = r_t + gamma * V_next - V_t` (V_next = 0 after the last trained token);
    `A_t = delta_t + gamma * lam * A_next`; `returns_t = A_t + V_t`.

    Args:
        inputs: needs rewards, mask, values; token_rewards optional.
        gamma: discount per trained token.
        lam: GAE lambda (1 = Monte-Carlo return minus V, 0 = one-step TD error).

    Returns:
        (advantages [B, T], returns [B, T], metrics).
    """
    mask = inputs.mask
    values = _require(inputs.values, "values", "gae").detach()  # [B, T]
    values = torch.where(mask > 0, values, torch.zeros_like(values))  # padding may hold NaN
    rewards = terminal_token_rewards(inputs.rewards, mask, inputs.token_rewards)  # [B, T]
    advantages = torch.zeros_like(rewards)  # [B, T]
    next_value = torch.zeros_like(rewards[:, 0])  # [B]
    next_advantage = torch.zeros_like(rewards[:, 0])  # [B]
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]  # [B]
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # [B]
        advantage_t = delta + gamma * lam * next_advantage  # [B]
        # Untrained tokens pass the next trained token's value and advantage through unchanged.
        next_advantage = m * advantage_t + (1.0 - m) * next_advantage
        next_value = m * values[:, t] + (1.0 - m) * next_value
        advantages[:, t] = advantage_t * m
    returns = (advantages + values) * mask  # [B, T]
    return advantages, returns, _metrics(advantages, returns, mask)


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(
    inputs: AdvantageInputs,
    *,
    scale_by_std: bool = True,
    epsilon: float = 1e-6,
    unbiased_std: bool = True,
) -> tuple[Tensor, Tensor, dict]:
    """GRPO (Shao et al., 2024, DeepSeekMath): `A_i = (r_i - mean_g) / (std_g + epsilon)` per group.

    The standard deviation is unbiased (n - 1) by default, as `torch.std` in ROLL, verl and TRL; a group of
    one sample has std 0 and advantage 0.

    Args:
        inputs: needs rewards, mask, group_ids; token_rewards optional (reward-to-go added).
        scale_by_std: divide by the group std; False gives Dr. GRPO.
        epsilon: added to the std.
        unbiased_std: Bessel's correction for the group std.

    Returns:
        (advantages [B, T], returns [B, T] (= advantages), metrics incl. `zero_std_group_frac`).
    """
    rewards = inputs.rewards.to(inputs.mask.dtype)  # [B]
    centered = rewards - group_mean(rewards, inputs.group_ids)  # [B]
    std = group_std(rewards, inputs.group_ids, unbiased=unbiased_std)  # [B]
    score = centered / (std + epsilon) if scale_by_std else centered  # [B]
    advantages, returns, metrics = _broadcast_score(score, inputs)
    # Fraction of groups whose rewards are all equal (no learning signal): count members, weight 1/size.
    zero_std = (std < 1e-6).float() / group_count(inputs.group_ids)  # [B], tolerant of rounding
    num_groups = (1.0 / group_count(inputs.group_ids)).sum()
    metrics["zero_std_group_frac"] = float(zero_std.sum() / num_groups)
    return advantages, returns, metrics


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor, dict]:
    """Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training"): `A_i = r_i - mean_g`.

    No std scaling; pair it with the `seq_mean_token_sum_norm` aggregation to remove the length bias too.

    Args:
        inputs: needs rewards, mask, group_ids; token_rewards optional (reward-to-go added).

    Returns:
        (advantages [B, T], returns [B, T] (= advantages), metrics).
    """
    return grpo(inputs, scale_by_std=False)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor, dict]:
    """REINFORCE leave-one-out (Kool et al., 2019; Ahmadian et al., 2024).

    `A_i = r_i - (sum_g - r_i) / (n_g - 1)`; a group of one sample gets advantage 0.

    Args:
        inputs: needs rewards, mask, group_ids; token_rewards optional (reward-to-go added).

    Returns:
        (advantages [B, T], returns [B, T] (= advantages), metrics).
    """
    rewards = inputs.rewards.to(inputs.mask.dtype)  # [B]
    counts = group_count(inputs.group_ids)  # [B]
    others_mean = (group_sum(rewards, inputs.group_ids) - rewards) / (counts - 1.0).clamp(min=1.0)  # [B]
    score = torch.where(counts > 1, rewards - others_mean, torch.zeros_like(rewards))  # [B]
    return _broadcast_score(score, inputs)


@ADVANTAGE_ESTIMATORS.register("lite_ppo")
def lite_ppo(
    inputs: AdvantageInputs, *, epsilon: float = 1e-6, unbiased_std: bool = True
) -> tuple[Tensor, Tensor, dict]:
    """LitePPO (Liu et al., 2025, "Tricks or Traps?"): `A_i = (r_i - mean_g) / (std_batch + epsilon)`.

    Group-mean baseline, batch-level std of the rewards. Pair with `token_mean` aggregation.

    Args:
        inputs: needs rewards, mask, group_ids; token_rewards optional (reward-to-go added).
        epsilon: added to the std.
        unbiased_std: Bessel's correction for the batch std.

    Returns:
        (advantages [B, T], returns [B, T] (= advantages), metrics).
    """
    rewards = inputs.rewards.to(inputs.mask.dtype)  # [B]
    centered = rewards - group_mean(rewards, inputs.group_ids)  # [B]
    score = centered / (batch_std(rewards, unbiased=unbiased_std) + epsilon)  # [B]
    return _broadcast_score(score, inputs)


@ADVANTAGE_ESTIMATORS.register("reinforce")
def reinforce(inputs: AdvantageInputs, *, gamma: float = 1.0) -> tuple[Tensor, Tensor, dict]:
    """REINFORCE (Williams, 1992) with the discounted return as advantage, no baseline.

    `A_t = returns_t = sum_{k >= t} gamma^(k - t) r_k` over trained tokens, with `r` the token rewards plus
    the scalar reward at the last trained token.

    Args:
        inputs: needs rewards, mask; token_rewards optional.
        gamma: discount per trained token.

    Returns:
        (advantages [B, T], returns [B, T] (= advantages), metrics).
    """
    rewards = terminal_token_rewards(inputs.rewards, inputs.mask, inputs.token_rewards)  # [B, T]
    returns = discounted_returns(rewards, inputs.mask, gamma)  # [B, T]
    return returns, returns, _metrics(returns, returns, inputs.mask)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def reinforce_pp(
    inputs: AdvantageInputs,
    *,
    gamma: float = 1.0,
    group_baseline: bool = False,
    epsilon: float = 1e-8,
) -> tuple[Tensor, Tensor, dict]:
    """REINFORCE++ (Hu, 2025): discounted return, whitened over all trained tokens of the batch.

    With `group_baseline`, the group mean of the scalar rewards is subtracted first
    (REINFORCE++-baseline). Advantages = `(G_t - mean) / (std + epsilon)` with mean and std over the
    batch's trained tokens; returns are the un-whitened `G_t`.

    Args:
        inputs: needs rewards, mask; group_ids when group_baseline; token_rewards optional.
        gamma: discount per trained token.
        group_baseline: subtract the group-mean reward before computing returns.
        epsilon: added to the std when whitening.

    Returns:
        (advantages [B, T], returns [B, T], metrics).
    """
    rewards = inputs.rewards.to(inputs.mask.dtype)  # [B]
    if group_baseline:
        rewards = rewards - group_mean(rewards, inputs.group_ids)  # [B]
    token_rewards = terminal_token_rewards(rewards, inputs.mask, inputs.token_rewards)  # [B, T]
    returns = discounted_returns(token_rewards, inputs.mask, gamma)  # [B, T]
    advantages = whiten(returns, inputs.mask, epsilon=epsilon)  # [B, T]
    return advantages, returns, _metrics(advantages, returns, inputs.mask)


@ADVANTAGE_ESTIMATORS.register("opd")
def opd(inputs: AdvantageInputs) -> tuple[Tensor, Tensor, dict]:
    """On-policy distillation (Agarwal et al., 2024, GKD; Thinking Machines, 2025).

    `A_t = -(logprobs_t - teacher_logprobs_t)`: minus the per-token reverse KL (k1 estimate) from the
    student to the teacher, so tokens the teacher finds likelier are reinforced. Rewards are not used.

    Args:
        inputs: needs mask, logprobs, teacher_logprobs.

    Returns:
        (advantages [B, T], returns [B, T] (= advantages), metrics incl. `reverse_kl_mean`).
    """
    mask = inputs.mask
    logprobs = _require(inputs.logprobs, "logprobs", "opd").detach()  # [B, T]
    teacher = _require(inputs.teacher_logprobs, "teacher_logprobs", "opd").detach()  # [B, T]
    advantages = torch.where(mask > 0, teacher - logprobs, torch.zeros_like(logprobs))  # [B, T]
    metrics = _metrics(advantages, advantages, mask)
    metrics["reverse_kl_mean"] = -metrics["advantages_mean"]
    return advantages, advantages, metrics
