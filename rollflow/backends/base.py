"""The interface of a training backend: the `TrainingBackend` protocol the workers program against,
`TrainerSettings` (the constructor fields every backend takes), and the pure functions over what crosses it:
the LR schedule the settings name (`lr_multiplier`), which rows each micro-batch holds (`micro_batch_rows`)
and how `forward_top_k`'s output splits (`unpack_top_k`).

What the backends build from and share lives beside it: `training_state` (the model, the optimizer and their
state on disk) and `backend_base` (`TrainingBackendBase`, the one base class of the backends).

`TrainerSettings` and `SETTINGS_FIELDS` are defined in `settings` (which the config reads without torch) and are
part of this interface (`__all__`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from rollflow.backends.settings import SETTINGS_FIELDS, TrainerSettings

__all__ = ["SETTINGS_FIELDS", "LossFn", "TrainerSettings", "TrainingBackend", "lr_multiplier", "micro_batch_rows",
           "unpack_top_k"]

if TYPE_CHECKING:
    from rollflow.algorithms import LossNormalizer
    from rollflow.data.sample import Batch

# `loss_fn(outputs, micro_batch, normalizer) -> (loss, metrics)`: outputs are [b, t, V] logits (a causal LM)
# or [b, t] values (a value model), over the micro-batch's own t <= T response columns (micro-batches are
# trimmed: `Batch.trimmed`); `loss` is the micro-batch's contribution to the loss of the whole batch (see
# `rollflow.algorithms.aggregation`), so the accumulated gradient does not depend on how it was split. The
# rows of a micro-batch are any of the batch's rows, in any order: a loss must be a sum over rows.
LossFn = Callable[[torch.Tensor, "Batch", "LossNormalizer"], tuple[torch.Tensor, dict[str, float]]]



@runtime_checkable
class TrainingBackend(Protocol):
    """What a worker may call on a training backend (`TorchBackend`, `FSDP2Backend`).

    Batches are full `Batch`es (B rows, T response columns); results come back on CPU. Under a data-parallel
    backend every call is a collective: all ranks make it, with the same full batch.

    Attributes:
        resident: False between `offload()` and `onload()`; forward and training calls raise then.
    """

    resident: bool

    def forward_logprobs(self, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        """Returns [B, T] logprobs of the response tokens (0 where padded)."""
        ...

    def forward_values(self, batch: Batch) -> torch.Tensor:
        """Returns [B, T] values of the response tokens (value head only; 0 where padded)."""
        ...

    def forward_reference_logprobs(self, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        """Returns [B, T] logprobs under the base model with the LoRA adapters off (LoRA only)."""
        ...

    def train_step(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on the whole batch. Returns metrics: the loss function's, `loss`,
        `grad_norm`, `lr`, `skipped_steps` (1 when a non-finite loss or gradient norm dropped the step).

        Raises NonFiniteError for a non-finite loss or gradient norm with `on_nonfinite="stop"`, and for
        weights a step made non-finite."""
        ...

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Full weights by HF parameter name, on CPU, for weight sync."""
        ...

    def offload(self) -> None: ...

    def onload(self) -> None: ...

    def save(self, path: str | Path) -> None: ...

    def load(self, path: str | Path) -> None: ...

    def close(self) -> None: ...


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """LR factor at optimizer step `step` (0-based): linear warm-up, then constant or cosine to 0."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def micro_batch_rows(lengths: torch.Tensor, micro_batch_size: int, by_length: bool) -> list[torch.Tensor]:
    """Which rows each micro-batch holds.

    Ordering by length (longest first, ties in row order) puts long rows together, so the micro-batches of
    short rows stay narrow once trimmed; the longest pass comes first, so running out of memory shows at
    once. The number of micro-batches is `ceil(n / micro_batch_size)` either way.

    Args:
        lengths: [n] real tokens (prompt + response) of each row.
        micro_batch_size: rows per micro-batch.
        by_length: order the rows by length; False keeps them in order (contiguous micro-batches).

    Returns:
        [b] long row indices of each micro-batch, every row once; [] for n = 0.
    """
    order = (torch.argsort(lengths, descending=True, stable=True) if by_length
             else torch.arange(len(lengths)))  # [n]
    return [rows for rows in order.split(micro_batch_size) if len(rows)]


def unpack_top_k(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`TrainingBackendBase.forward_top_k`'s [B, T, 2k] as (ids [B, T, k] long, logprobs [B, T, k])."""
    k = packed.shape[-1] // 2
    return packed[..., k:].long(), packed[..., :k].contiguous()
