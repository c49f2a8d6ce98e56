"""Reward shaping, masks and clipping applied before and after the advantage estimator.

Order used by the pipelines (ROLL's, minus its bugs):

    keep = difficulty_mask(...) ; mask = overlong_filter_mask(mask, truncated)        # which samples train
    rewards += overlong_reward_penalty(lengths, ...)                                  # DAPO soft punishment
    rewards = clip_rewards(normalize_rewards(rewards, group_ids, ...), clip)          # or ..._by_domain
    token_rewards = -beta * kl_penalty(logprobs, ref_logprobs, "k1") * mask           # beta from a KL controller
    advantages, returns, _ = ADVANTAGE_ESTIMATORS[name](AdvantageInputs(...))
    advantages = clip_advantages(whiten(advantages, mask) if whiten_advantages else advantages, clip)

All functions are pure except `RunningMoments.update`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from rollflow.algorithms.reductions import batch_std, group_mean, group_std, masked_mean, masked_var

NORMALIZATION_MODES = ("none", "batch", "group", "running")


class RunningMoments:
    """Running mean and standard deviation of a stream of rewards (Chan et al. parallel update).

    Plain python floats; one instance per reward domain if domains are normalized separately.
    Until two values have been seen the std is 1.0, so early normalization does not divide by zero.
    """

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self._sum_sq = 0.0  # sum of squared deviations from the mean

    def update(self, values: Tensor) -> None:
        """Fold a batch of values into the statistics.

        Args:
            values: [N] float (any shape; flattened).
        """
        values = values.detach().double().flatten()
        n = values.numel()
        if n == 0:
            return
        batch_mean = float(values.mean())
        batch_sum_sq = float(((values - batch_mean) ** 2).sum())
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self._sum_sq += batch_sum_sq + delta**2 * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        """Unbiased standard deviation of everything seen (1.0 before two values)."""
        if self.count < 2:
            return 1.0
        return math.sqrt(self._sum_sq / (self.count - 1))


def normalize_rewards(
    rewards: Tensor,
    group_ids: Tensor,
    mean_mode: str = "none",
    std_mode: str = "none",
    running_stats: RunningMoments | None = None,
    epsilon: float = 1e-6,
    unbiased_std: bool = True,
) -> Tensor:
    """Normalize scalar rewards: `(r - mean) / (std + epsilon)`, each statistic from a chosen scope.

    Modes: "none" (mean 0 / std not applied), "batch" (all samples), "group" (samples sharing a group id),
    "running" (`running_stats`, updated with this batch first). GRPO is mean_mode=std_mode="group";
    REINFORCE++ is "batch"/"batch"; LitePPO is "group"/"batch". A group of one has std 0.

    Args:
        rewards: [B] float.
        group_ids: [B] long.
        mean_mode: scope of the subtracted mean.
        std_mode: scope of the dividing std.
        running_stats: required when either mode is "running"; updated in place once.
        epsilon: added to the std.
        unbiased_std: Bessel's correction for batch and group std.

    Returns:
        [B] normalized rewards.
    """
    for mode in (mean_mode, std_mode):
        if mode not in NORMALIZATION_MODES:
            raise ValueError(f"unknown normalization mode {mode!r}; valid: {', '.join(NORMALIZATION_MODES)}")
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    if "running" in (mean_mode, std_mode):
        if running_stats is None:
            raise ValueError("normalization mode 'running' needs running_stats=RunningMoments()")
        running_stats.update(rewards)
    raw = rewards
    if mean_mode == "batch":
        rewards = rewards - raw.mean()  # [B]
    elif mean_mode == "group":
        rewards = rewards - group_mean(raw, group_ids)  # [B]
    elif mean_mode == "running":
        rewards = rewards - running_stats.mean  # [B]
    # The std is always that of the raw rewards in its scope (for LitePPO the batch std of the rewards,
    # not of the group-centred rewards).
    if std_mode == "batch":
        rewards = rewards / (batch_std(raw, unbiased=unbiased_std) + epsilon)
    elif std_mode == "group":
        rewards = rewards / (group_std(raw, group_ids, unbiased=unbiased_std) + epsilon)
    elif std_mode == "running":
        rewards = rewards / (running_stats.std + epsilon)
    return rewards


def normalize_rewards_by_domain(
    rewards: Tensor,
    group_ids: Tensor,
    domain_ids: Tensor,
    mean_mode: str = "none",
    std_mode: str = "none",
    running_stats: Sequence[RunningMoments] | None = None,
    epsilon: float = 1e-6,
    unbiased_std: bool = True,
) -> Tensor:
    """`normalize_rewards` within each domain: a sample's "batch" statistics are those of its domain's samples
    in the batch, its "running" statistics its domain's own `running_stats[d]`. "group" is unchanged (a
    group is one prompt, so one domain). With one domain this is `normalize_rewards`.

    Args:
        rewards: [B] float.
        group_ids: [B] long.
        domain_ids: [B] long, each sample's domain, an index into `running_stats`.
        mean_mode, std_mode, epsilon, unbiased_std: as `normalize_rewards`.
        running_stats: one `RunningMoments` per domain id, required when either mode is "running"; each is
            updated in place with its domain's rewards (a domain with no sample in the batch is left alone).

    Returns:
        [B] normalized rewards.
    """
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    normalized = torch.empty_like(rewards)  # [B]
    for domain in domain_ids.unique().tolist():
        rows = domain_ids == domain  # [B] bool
        stats = running_stats[domain] if running_stats is not None else None
        normalized[rows] = normalize_rewards(rewards[rows], group_ids[rows], mean_mode, std_mode, stats,
                                             epsilon, unbiased_std)  # [B_d]
    return normalized


def clip_rewards(rewards: Tensor, clip: float | None) -> Tensor:
    """Clamp rewards to [-clip, clip]; None leaves them unchanged.

    Args:
        rewards: [B] or [B, T].
        clip: positive bound, or None.

    Returns:
        Same shape as `rewards`.
    """
    return rewards if clip is None else rewards.clamp(-clip, clip)


def clip_advantages(advantages: Tensor, clip: float | None) -> Tensor:
    """Clamp advantages to [-clip, clip]; None leaves them unchanged. Zeros stay zero.

    Args:
        advantages: [B, T].
        clip: positive bound, or None.

    Returns:
        [B, T].
    """
    return advantages if clip is None else advantages.clamp(-clip, clip)


def whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, epsilon: float = 1e-8) -> Tensor:
    """Normalize to zero mean and unit (unbiased) std over the trained tokens of the batch.

    With at most one trained token there is no spread; values are returned unchanged (times mask).

    Args:
        values: [B, T].
        mask: [B, T] float.
        shift_mean: subtract the mean; False only rescales (keeps the mean).
        epsilon: added to the std.

    Returns:
        [B, T], zero where mask == 0.
    """
    if mask.sum() <= 1:
        return values * mask
    mean = masked_mean(values, mask)
    std = masked_var(values, mask, unbiased=True).sqrt()
    whitened = (values - mean) / (std + epsilon)  # [B, T]
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def overlong_reward_penalty(
    response_lengths: Tensor,
    max_response_length: int,
    overlong_buffer: int,
    penalty_factor: float = 1.0,
) -> Tensor:
    """DAPO soft overlong punishment (Yu et al., 2025), to be ADDED to the scalar reward.

    With `L = max_response_length` and `C = overlong_buffer`:
    0 if `len <= L - C`; `(L - C - len) / C * factor` if `L - C < len <= L`; `-factor` if `len > L`.

    Args:
        response_lengths: [B] number of response tokens.
        max_response_length: L, the generation limit.
        overlong_buffer: C, the length of the linear penalty ramp (> 0).
        penalty_factor: penalty at and beyond L.

    Returns:
        [B] penalties in [-penalty_factor, 0].
    """
    if overlong_buffer <= 0:
        raise ValueError(f"overlong_buffer must be > 0, got {overlong_buffer}")
    excess = (max_response_length - overlong_buffer) - response_lengths.float()  # [B], negative when long
    return (excess / overlong_buffer).clamp(-1.0, 0.0) * penalty_factor  # [B]


def overlong_filter_mask(mask: Tensor, truncated: Tensor) -> Tensor:
    """DAPO overlong filtering: zero the loss mask of samples cut off at the length limit.

    Args:
        mask: [B, T] float.
        truncated: [B] bool, True where generation hit the limit.

    Returns:
        [B, T] float mask.
    """
    return mask * (~truncated.bool()).unsqueeze(1).to(mask.dtype)  # [B, T]


def difficulty_mask(rewards: Tensor, group_ids: Tensor, low: float = 0.0, high: float = 1.0) -> Tensor:
    """Keep the samples of groups whose mean reward lies strictly inside (low, high).

    With rewards in {0, 1} and the defaults this drops groups solved by none or all samples, which carry
    no signal for group-normalized advantages.

    Args:
        rewards: [B] float.
        group_ids: [B] long.
        low: exclusive lower bound on the group mean reward.
        high: exclusive upper bound.

    Returns:
        [B] bool keep mask.
    """
    mean = group_mean(rewards if rewards.is_floating_point() else rewards.float(), group_ids)  # [B]
    return (mean > low) & (mean < high)
