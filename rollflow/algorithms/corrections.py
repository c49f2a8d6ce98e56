"""Train-inference mismatch corrections: truncated (TIS) and masked (MIS) importance sampling.

The inference engine samples from `pi_rollout` and reports its log-probs; the trainer recomputes
`old_logprobs` for the same tokens. Kernels, precision and (in async training) staleness make the two
differ, so the policy gradient is off-policy by `ratio = exp(old_logprobs - rollout_logprobs)`.

Levels at which the ratio is measured (each broadcast to every token of the sequence):

* `token`: the per-token ratio.
* `sequence`: `exp(sum_t log ratio_t)`, the exact sequence importance ratio (high variance).
* `geometric`: `exp(mean_t log ratio_t)`, the per-token geometric mean (length-independent).

Two corrections, combinable with `train_infer_correction`:

* Truncated IS (Yao et al., 2025, "Your efficient RL framework secretly brings you off-policy RL
  training"; Ionides, 2008): multiply the per-token loss by the stop-gradient weight
  `min(ratio, upper_bound)`.
* Masked IS (Liu et al., 2025, "When speed kills stability"): drop tokens (token level) or whole sequences
  (sequence and geometric levels) whose ratio leaves [low, high].

Ratios are compared and truncated in log space, so long sequences cannot overflow. All outputs are
detached.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rollflow.algorithms.reductions import masked_float_metric

LEVELS = ("token", "sequence", "geometric")


def train_infer_log_ratio(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, level: str = "token"
) -> Tensor:
    """Log of the train/inference importance ratio at a level, broadcast to tokens.

    Args:
        old_logprobs: [B, T] trainer log-probs of the sampled tokens.
        rollout_logprobs: [B, T] inference-engine log-probs of the same tokens.
        mask: [B, T] float.
        level: "token", "sequence" or "geometric".

    Returns:
        [B, T] detached log ratio, zero where mask == 0.
    """
    if level not in LEVELS:
        raise ValueError(f"unknown correction level {level!r}; valid: {', '.join(LEVELS)}")
    diff = old_logprobs.detach() - rollout_logprobs.detach()  # [B, T]
    token = torch.where(mask > 0, diff, torch.zeros_like(diff))  # [B, T]
    if level == "token":
        return token
    total = token.sum(dim=1, keepdim=True)  # [B, 1]
    if level == "geometric":
        total = total / mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # [B, 1]
    return total.expand_as(token) * mask  # [B, T]


def truncated_is_weights(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    upper_bound: float = 2.0,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Truncated importance-sampling weights `min(ratio, upper_bound)` (stop-gradient).

    Args:
        old_logprobs: [B, T].
        rollout_logprobs: [B, T].
        mask: [B, T] float.
        level: "token", "sequence" or "geometric".
        upper_bound: truncation (> 0).

    Returns:
        (weights [B, T] (0 where mask == 0), mask [B, T] unchanged, metrics: is_weight_mean,
        is_weight_clip_frac).
    """
    if upper_bound <= 0:
        raise ValueError(f"upper_bound must be > 0, got {upper_bound}")
    log_ratio = train_infer_log_ratio(old_logprobs, rollout_logprobs, mask, level)  # [B, T]
    weights = log_ratio.clamp(max=math.log(upper_bound)).exp() * mask  # [B, T]
    metrics = {
        "is_weight_mean": masked_float_metric(weights, mask),
        "is_weight_clip_frac": masked_float_metric((log_ratio > math.log(upper_bound)).float(), mask),
    }
    return weights, mask, metrics


def masked_is(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Masked importance sampling: drop tokens or sequences whose ratio leaves [low, high].

    At the "sequence" and "geometric" levels the ratio is per sequence, so whole sequences are dropped.
    Geometric bounds are usually tight (e.g. [0.999, 1.001]); token bounds loose (e.g. [0.5, 2]).

    Args:
        old_logprobs: [B, T].
        rollout_logprobs: [B, T].
        mask: [B, T] float.
        level: "token", "sequence" or "geometric".
        low: smallest kept ratio (> 0).
        high: largest kept ratio.

    Returns:
        (weights [B, T] = new mask, new_mask [B, T], metrics: mis_kept_frac (of trained tokens)).
    """
    if not 0 < low <= high:
        raise ValueError(f"need 0 < low <= high, got {low}, {high}")
    log_ratio = train_infer_log_ratio(old_logprobs, rollout_logprobs, mask, level)  # [B, T]
    inside = (log_ratio >= math.log(low)) & (log_ratio <= math.log(high))  # [B, T]
    new_mask = mask * inside.to(mask.dtype)  # [B, T]
    metrics = {"mis_kept_frac": masked_float_metric(inside.float(), mask)}
    return new_mask.clone(), new_mask, metrics


def train_infer_correction(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    *,
    weight_level: str | None = "token",
    upper_bound: float = 2.0,
    mask_level: str | None = None,
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Masked IS (optional) followed by truncated IS (optional); multiply the per-token loss by the weights
    and aggregate it with the new mask.

    Args:
        old_logprobs: [B, T].
        rollout_logprobs: [B, T].
        mask: [B, T] float.
        weight_level: level of the truncated IS weights, or None for weights of 1.
        upper_bound: TIS truncation.
        mask_level: level of the MIS mask, or None for no masking.
        low: MIS lower bound.
        high: MIS upper bound.

    Returns:
        (weights [B, T], new_mask [B, T], metrics incl. train_infer_ratio_mean (token level) and
        train_infer_log_ratio_abs_mean).
    """
    token_log_ratio = train_infer_log_ratio(old_logprobs, rollout_logprobs, mask, "token")  # [B, T]
    metrics = {
        "train_infer_ratio_mean": masked_float_metric(token_log_ratio.exp(), mask),
        "train_infer_log_ratio_abs_mean": masked_float_metric(token_log_ratio.abs(), mask),
    }
    if mask_level is not None:
        _, mask, mask_metrics = masked_is(
            old_logprobs, rollout_logprobs, mask, level=mask_level, low=low, high=high
        )
        metrics.update(mask_metrics)
    if weight_level is None:
        return mask.clone(), mask, metrics
    weights, mask, weight_metrics = truncated_is_weights(
        old_logprobs, rollout_logprobs, mask, level=weight_level, upper_bound=upper_bound
    )
    metrics.update(weight_metrics)
    return weights, mask, metrics
