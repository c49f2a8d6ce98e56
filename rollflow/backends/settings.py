"""`TrainerSettings`: the constructor fields every training backend takes (`rollflow.backends.base` is the
interface they are part of). Imports no torch: the config checks `backend_kwargs` against `SETTINGS_FIELDS`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

LR_SCHEDULES = ("constant", "cosine")
ON_NONFINITE = ("stop", "skip_step")


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
