"""Masked and per-group reductions shared by the estimators, losses and reward shaping.

Groups: `group_ids` [B] holds one id per sample; samples of one prompt share an id. Ids may be any
integers, groups may differ in size and need not be contiguous in the batch.

Standard deviations: `unbiased=True` uses Bessel's correction (divide by n - 1), the `torch.std` default
that ROLL, verl and TRL use for GRPO. A group or batch with a single element has no spread: its standard
deviation is defined here as 0 (torch would return NaN).
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    """Sum of `values` where `mask` is 1.

    Args:
        values: [B, T] (any shape broadcastable with mask).
        mask: [B, T] float, 1.0 on counted entries.

    Returns:
        Scalar tensor.
    """
    return (values * mask).sum()


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` over entries where `mask` is 1; 0 when the mask is empty.

    Args:
        values: [B, T].
        mask: [B, T] float.

    Returns:
        Scalar tensor.
    """
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of `values` over entries where `mask` is 1; 0 with fewer than 2 entries.

    Args:
        values: [B, T].
        mask: [B, T] float.
        unbiased: divide by n - 1 (Bessel) instead of n.

    Returns:
        Scalar tensor.
    """
    count = mask.sum()
    mean = masked_mean(values, mask)
    sum_sq = (((values - mean) * mask) ** 2).sum()
    denominator = count - 1.0 if unbiased else count
    return sum_sq / denominator.clamp(min=1.0)


def masked_float_metric(values: Tensor, mask: Tensor, reduce: str = "mean") -> float:
    """A python float summary of `values` over masked entries (for metrics); 0.0 when the mask is empty.

    Args:
        values: [B, T].
        mask: [B, T] float.
        reduce: "mean", "max" or "min".

    Returns:
        The reduction as a python float.
    """
    values = values.detach()
    selected = values[mask > 0]
    if selected.numel() == 0:
        return 0.0
    if reduce == "mean":
        return float(selected.float().mean())
    if reduce == "max":
        return float(selected.max())
    if reduce == "min":
        return float(selected.min())
    raise ValueError(f"unknown reduce {reduce!r}; valid: mean, max, min")


def group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary group ids to dense indices.

    Args:
        group_ids: [B] long.

    Returns:
        (index [B] long in [0, G), G the number of distinct groups).
    """
    unique, index = torch.unique(group_ids, return_inverse=True)  # index: [B]
    return index, int(unique.numel())


def group_count(group_ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Size of each sample's group.

    Args:
        group_ids: [B] long.
        dtype: dtype of the result.

    Returns:
        [B] the number of samples sharing each sample's id.
    """
    index, num_groups = group_index(group_ids)
    counts = torch.zeros(num_groups, dtype=dtype, device=group_ids.device)
    counts.index_add_(0, index, torch.ones_like(index, dtype=dtype))  # [G]
    return counts[index]  # [B]


def group_sum(values: Tensor, group_ids: Tensor) -> Tensor:
    """Sum of `values` over each sample's group.

    Args:
        values: [B] float.
        group_ids: [B] long.

    Returns:
        [B] the group total, broadcast back to each member.
    """
    index, num_groups = group_index(group_ids)
    sums = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    sums.index_add_(0, index, values)  # [G]
    return sums[index]  # [B]


def group_mean(values: Tensor, group_ids: Tensor) -> Tensor:
    """Mean of `values` over each sample's group.

    Args:
        values: [B] float.
        group_ids: [B] long.

    Returns:
        [B] the group mean, broadcast back to each member.
    """
    return group_sum(values, group_ids) / group_count(group_ids, values.dtype)


def group_std(values: Tensor, group_ids: Tensor, unbiased: bool = True) -> Tensor:
    """Standard deviation of `values` over each sample's group (0 for a group of one).

    Args:
        values: [B] float.
        group_ids: [B] long.
        unbiased: divide the squared deviations by n - 1 (Bessel) instead of n.

    Returns:
        [B] the group standard deviation, broadcast back to each member.
    """
    counts = group_count(group_ids, values.dtype)  # [B]
    deviations = values - group_mean(values, group_ids)  # [B]
    sum_sq = group_sum(deviations**2, group_ids)  # [B]
    denominator = (counts - 1.0) if unbiased else counts
    return (sum_sq / denominator.clamp(min=1.0)).sqrt()  # singleton: sum_sq = 0, so std = 0


def batch_std(values: Tensor, unbiased: bool = True) -> Tensor:
    """Standard deviation of a [B] tensor (0 for a single element).

    Args:
        values: [B] float.
        unbiased: Bessel's correction.

    Returns:
        Scalar tensor.
    """
    return masked_var(values, torch.ones_like(values), unbiased=unbiased).sqrt()
