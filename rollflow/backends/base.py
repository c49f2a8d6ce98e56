"""The interface of a training backend: the `TrainingBackend` protocol the workers program against,
`TrainerSettings` (the constructor fields every backend takes), and the pure functions over what crosses it:
the LR schedule the settings name (`lr_multiplier`), which rows each micro-batch holds (`micro_batch_rows`)
and how `forward_top_k`'s output splits (`unpack_top_k`).

What the backends build from and share lives beside it: `training_state` (the model, the optimizer and their
state on disk) and `backend_base` (`TrainingBackendBase`, the one base class of the backends).

The config module imports this one (for `SETTINGS_FIELDS`), so at module level it imports only the standard
library and torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from rollflow.algorithms import LossNormalizer
    from rollflow.data.sample import Batch

# `loss_fn(outputs, micro_batch, normalizer) -> (loss, metrics)`: outputs are [b, t, V] logits (a causal LM)
# or [b, t] values (a value model), over the micro-batch's own t <= T response columns (micro-batches are
# trimmed: `Batch.trimmed`); `loss` is the micro-batch's contribution to the loss of the whole batch (see
# `rollflow.algorithms.aggregation`), so the accumulated gradient does not depend on how it was split. The
# rows of a micro-batch are any of the batch's rows, in any order: a loss must be a sum over rows.
LossFn = Callable[[torch.Tensor, "Batch", "LossNormalizer"], tuple[torch.Tensor, dict[str, float]]]

LR_SCHEDULES = ("constant", "cosine")
ON_NONFINITE = ("stop", "skip_step")


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


@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    """The settings every training backend takes; backend-specific knobs are keyword arguments of the
    backend class (`backend_kwargs` in the config).

    Args:
        model_path: bundled name, local HF directory or hub id.
        dtype: parameter dtype ("float32" on CPU).
        lr, betas, weight_decay: AdamW settings.
        warmup_steps: linear LR warm-up over this many optimizer steps.
        max_grad_norm: gradient clipping (global norm).
        micro_batch_size: rows per forward/backward pass (per rank under a data-parallel backend).
        trainable: False for a frozen model (a reference): every weight frozen, no optimizer.
        lr_schedule: after warm-up, "constant" or "cosine" (to 0 at `total_steps`).
        total_steps: optimizer steps in the run (for the cosine schedule).
        trust_remote_code: passed to the HF loaders.
        value_head: hold a `ValueModel` (backbone + scalar head) instead of the causal LM, for a critic.
        max_response_length: the constant L of `seq_mean_token_sum_norm` (the generation limit); None uses
            each batch's padded response width.
        lora: `rollflow.config.LoraConfig` fields (rank, alpha, dropout, target_modules) to train LoRA
            adapters instead of all weights (validated when the model is built); None trains every weight.
        device: "cpu", "cuda", or None for CUDA when available. Inputs move to it per micro-batch.
        on_nonfinite: a non-finite loss or gradient norm: "stop" raises NonFiniteError, "skip_step" drops
            the step (gradient cleared, weights and LR schedule unchanged) and goes on.
        freeze_vision_tower: a vision-language model's vision tower stays frozen and out of weight syncs;
            False: it trains (in full, beside LoRA adapters when `lora`).
    """

    model_path: str
    dtype: str = "float32"
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    micro_batch_size: int = 32
    trainable: bool = True
    lr_schedule: str = "constant"
    total_steps: int = 0
    trust_remote_code: bool = False
    value_head: bool = False
    max_response_length: int | None = None
    lora: dict[str, Any] | None = None
    device: str | None = None
    on_nonfinite: str = "stop"
    freeze_vision_tower: bool = False

    def __post_init__(self):
        if self.lora is not None and (self.value_head or not self.trainable):
            raise ValueError("lora needs a trainable causal LM (not value_head=True or trainable=False)")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"unknown lr_schedule {self.lr_schedule!r}; valid: {', '.join(LR_SCHEDULES)}")
        if self.on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"unknown on_nonfinite {self.on_nonfinite!r}; valid: {', '.join(ON_NONFINITE)}")


# The config rejects `backend_kwargs` that repeat one of these: they come from typed config keys.
SETTINGS_FIELDS = frozenset(field.name for field in dataclasses.fields(TrainerSettings))


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
