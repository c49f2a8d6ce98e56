"""Critic (value) loss for PPO with GAE."""

from __future__ import annotations

import torch
from torch import Tensor


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None = None
) -> Tensor:
    """PPO value loss with optional value clipping (Schulman et al., 2017; OpenAI baselines).

    `loss_t = 0.5 * max((V_t - R_t)^2, (clip(V_t, V_old_t - clip, V_old_t + clip) - R_t)^2)`; with
    `clip=None` only the first term. Aggregate with a `LOSS_AGGREGATIONS` mode (ROLL uses
    `seq_mean_token_mean`).

    Args:
        values: [B, T] current critic values (requires grad).
        old_values: [B, T] values at rollout time (detached).
        returns: [B, T] targets from the advantage estimator (detached).
        mask: [B, T] float.
        clip: the value clip range, or None.

    Returns:
        [B, T] per-token loss, zero where mask == 0.
    """
    returns = returns.detach()
    unclipped = (values - returns) ** 2  # [B, T]
    if clip is None:
        return 0.5 * unclipped * mask
    old_values = old_values.detach()
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)  # [B, T]
    clipped = (clipped_values - returns) ** 2  # [B, T]
    return 0.5 * torch.maximum(unclipped, clipped) * mask
