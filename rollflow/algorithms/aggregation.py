"""Loss aggregation: from a per-token loss [B, T] to the scalar that is back-propagated.

The four modes, with `l_it` the per-token loss, `m_it` the mask, `n_i = sum_t m_it` the trained tokens of
sequence i, and N (tokens), S (sequences with n_i >= 1) and L (max response length) from a
`LossNormalizer`:

| mode                      | value on the whole batch                 | used by                      |
|---------------------------|------------------------------------------|------------------------------|
| `token_mean`              | `sum_it m l / N`                         | DAPO, LitePPO (token-level)  |
| `seq_mean_token_mean`     | `sum_i (sum_t m l / n_i) / S`            | GRPO paper, GSPO             |
| `seq_mean_token_sum`      | `sum_i (sum_t m l) / S`                  | ROLL docs                    |
| `seq_mean_token_sum_norm` | `sum_i (sum_t m l / L) / S`              | Dr. GRPO (L a constant)      |

How the normalizer makes the result independent of how the batch is split
--------------------------------------------------------------------------
A training step sees one global batch, split across data-parallel ranks and, on each rank, into
micro-batches for gradient accumulation. Every aggregation is a SUM over tokens or sequences divided by a
GLOBAL count, so it is linear in the micro-batches:

1. Before the step, the backend computes the counts of the global batch: `loss_normalizer(mask)` on the
   full mask, or on each rank's mask followed by an all-reduce (SUM) of `num_tokens` and `num_sequences`
   (`max_response_length` is a configured constant, identical everywhere).
2. Each micro-batch's loss is `LOSS_AGGREGATIONS[mode](loss_mb, mask_mb, normalizer)`: its own sums divided
   by the global counts, i.e. its contribution to the global loss. A sequence never spans micro-batches,
   so the per-sequence `n_i` is always local.
3. The backend calls `backward()` on each contribution WITHOUT dividing by the number of micro-batches
   (gradients accumulate as a sum) and SUMs gradients across ranks. A backend whose collective averages
   (DDP, FSDP) multiplies each contribution by the data-parallel world size to turn the average into a sum.

Then the summed gradient equals the gradient of the loss on the whole batch, whatever the split; the tests
check this for every mode. Averaging per-micro-batch means instead would weight tokens of short
micro-batches more, which is the bug this design avoids. Zero counts are treated as 1 (the loss is then 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from rollflow.algorithms.registries import LOSS_AGGREGATIONS


@dataclass(frozen=True)
class LossNormalizer:
    """Global counts that turn a micro-batch's loss sum into its share of the global loss.

    Attributes:
        num_tokens: trained tokens in the global batch (all micro-batches, all data-parallel ranks).
        num_sequences: sequences with at least one trained token in the global batch.
        max_response_length: the Dr. GRPO constant L of `seq_mean_token_sum_norm`.
    """

    num_tokens: float
    num_sequences: float
    max_response_length: float


def loss_normalizer(mask: Tensor, max_response_length: float | None = None) -> LossNormalizer:
    """Counts of one (global) mask.

    Args:
        mask: [B, T] float, the mask of the whole batch (or of one rank, to be all-reduced with SUM).
        max_response_length: L for `seq_mean_token_sum_norm`; defaults to T = mask.shape[1].

    Returns:
        The LossNormalizer.
    """
    num_tokens = float(mask.sum())
    num_sequences = float((mask.sum(dim=1) > 0).sum())
    length = float(mask.shape[1]) if max_response_length is None else float(max_response_length)
    return LossNormalizer(num_tokens=num_tokens, num_sequences=num_sequences, max_response_length=length)


@LOSS_AGGREGATIONS.register("token_mean")
def token_mean(per_token_loss: Tensor, mask: Tensor, normalizer: LossNormalizer) -> Tensor:
    """Every trained token weighs the same: `sum(loss * mask) / num_tokens`.

    Args:
        per_token_loss: [B, T].
        mask: [B, T] float.
        normalizer: global counts.

    Returns:
        Scalar: this micro-batch's contribution to the global loss.
    """
    return (per_token_loss * mask).sum() / max(normalizer.num_tokens, 1.0)


@LOSS_AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(per_token_loss: Tensor, mask: Tensor, normalizer: LossNormalizer) -> Tensor:
    """Mean over tokens within a sequence, then over sequences: `sum_i mean_t(loss_i) / num_sequences`.

    Args:
        per_token_loss: [B, T].
        mask: [B, T] float.
        normalizer: global counts.

    Returns:
        Scalar: this micro-batch's contribution to the global loss.
    """
    lengths = mask.sum(dim=1).clamp(min=1.0)  # [B]; a row with no tokens contributes 0
    per_sequence = (per_token_loss * mask).sum(dim=1) / lengths  # [B]
    return per_sequence.sum() / max(normalizer.num_sequences, 1.0)


@LOSS_AGGREGATIONS.register("seq_mean_token_sum")
def seq_mean_token_sum(per_token_loss: Tensor, mask: Tensor, normalizer: LossNormalizer) -> Tensor:
    """Sum over tokens within a sequence, mean over sequences: `sum_it(loss * mask) / num_sequences`.

    Args:
        per_token_loss: [B, T].
        mask: [B, T] float.
        normalizer: global counts.

    Returns:
        Scalar: this micro-batch's contribution to the global loss.
    """
    return (per_token_loss * mask).sum() / max(normalizer.num_sequences, 1.0)


@LOSS_AGGREGATIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(per_token_loss: Tensor, mask: Tensor, normalizer: LossNormalizer) -> Tensor:
    """Dr. GRPO: token sum divided by the constant L, mean over sequences.

    `sum_it(loss * mask) / max_response_length / num_sequences`.

    Args:
        per_token_loss: [B, T].
        mask: [B, T] float.
        normalizer: global counts.

    Returns:
        Scalar: this micro-batch's contribution to the global loss.
    """
    denominator = max(normalizer.max_response_length, 1.0) * max(normalizer.num_sequences, 1.0)
    return (per_token_loss * mask).sum() / denominator


def aggregate_loss(
    per_token_loss: Tensor, mask: Tensor, mode: str, normalizer: LossNormalizer | None = None
) -> Tensor:
    """Reduce a per-token loss with a named aggregation mode.

    Args:
        per_token_loss: [B, T].
        mask: [B, T] float.
        mode: a `LOSS_AGGREGATIONS` name.
        normalizer: global counts; None computes them from `mask` (the batch is the whole batch).

    Returns:
        Scalar loss (this batch's contribution to the global loss when a global normalizer is given).
    """
    aggregation = LOSS_AGGREGATIONS.get(mode)
    if normalizer is None:
        normalizer = loss_normalizer(mask)
    return aggregation(per_token_loss, mask, normalizer)
