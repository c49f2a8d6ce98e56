"""`torch` training backend: one process, plain PyTorch, micro-batching with gradient accumulation.

The loss function is passed in (compose, don't inherit): `loss_fn(logits, micro_batch, normalizer) ->
(loss, metrics)`, where `loss` is the micro-batch's contribution to the global loss (see
`rollflow.algorithms.aggregation`), so the accumulated gradient does not depend on the micro-batch size.
With `value_head=True` the model is a `ValueModel` (the critic) and the loss function receives [b, T]
values instead of [b, T, V] logits. With `lora=...` the causal LM is wrapped with PEFT LoRA adapters (see
`rollflow.backends.lora`): only the adapters train, the base model with adapters disabled is the reference
policy, and weights leave the trainer merged, under the plain model's names.

Micro-batches are cut from the batch's rows ordered by length and trimmed to their own columns (see
`TrainingBackendBase._micro_batches`); results come back in the batch's row order, at its full width.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import torch

from rollflow.backends.backend_base import TrainingBackendBase
from rollflow.backends.base import LossFn, TrainerSettings
from rollflow.backends.training_state import (
    build_model,
    load_scheduler_state,
    save_training_state,
    synced_weights,
)
from rollflow.data.sample import Batch
from rollflow.models import load_causal_lm


class TorchBackend(TrainingBackendBase):
    """Holds the model, optimizer and LR schedule of one training worker, in one process.

    Args:
        settings: model, optimizer and batching settings (`TrainerSettings`); `settings.device` is "cpu",
            "cuda" (the current CUDA device), or None for CUDA when available. Inputs move to it per
            micro-batch; results come back on CPU.
        trim_micro_batches: cut micro-batches from the rows ordered by length, each only as wide as its own
            rows (the default); False: contiguous micro-batches at the batch's full width (same results up
            to float rounding, slower on batches of uneven lengths).
    """

    def __init__(self, settings: TrainerSettings, *, trim_micro_batches: bool = True):
        device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model = build_model(settings).to(device)
        super().__init__(settings, model, device, trim_micro_batches)

    def _passes(self, batch: Batch) -> Iterator[tuple[Batch, torch.Tensor | None]]:
        """The batch's micro-batches on the device with their rows (`_micro_batches`); every one is real."""
        yield from self._micro_batches(batch)

    def _join_rows(self, local: torch.Tensor, batch: Batch) -> torch.Tensor:
        return local.cpu()  # [B, T]: one process holds every row

    def train_step(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on `batch` (all micro-batches accumulated).

        Returns:
            The loss function's metrics averaged over the batch weighted by trained tokens, `loss` (summed
            over micro-batches: the batch's loss), `grad_norm` (before clipping), `lr` and `skipped_steps`
            (1 when a non-finite loss or gradient norm dropped the step, see `_optimizer_step`).
        """
        self.require_resident("train_step")
        loss, metric_sums = self._accumulate_gradients(batch, self._passes(batch), loss_fn)
        step = self._optimizer_step(loss)
        return {**metric_sums, "loss": loss, **step}

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Parameters by name, detached on CPU (tied weights appear once), for weight sync.

        With LoRA: the merged weights under the plain HF model's parameter names and shapes. A frozen vision
        tower's weights are left out (`synced_weights`).
        """
        if self.settings.lora is not None:
            from rollflow.backends.lora import merged_named_parameters

            weights = merged_named_parameters(self.model)
        else:
            weights = {name: p.detach() for name, p in self.model.named_parameters()}
        return {name: tensor.to("cpu").contiguous() for name, tensor in synced_weights(weights, self.settings).items()}

    def save(self, path: str | Path) -> None:
        """Model + tokenizer in HF format under `path` (a value model: `value_model.safetensors`), optimizer /
        scheduler / RNG in `trainer_state.pt`. With LoRA, `path` holds the adapters in PEFT format and
        `path/merged` the merged model in HF format."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self.settings.lora is not None:
            from rollflow.backends.lora import save_lora

            save_lora(self.model, path, self.tokenizer)
        elif self.settings.value_head:
            self.model.save(path)
        else:
            self.model.save_pretrained(path, safe_serialization=True)
        self.save_processing(path)
        state = {
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "torch_rng": torch.get_rng_state(),
            # dropout (LoRA's) on a GPU draws from the CUDA generator: a resumed step must draw the same
            "cuda_rng": torch.cuda.get_rng_state() if self.device.type == "cuda" else None,
            "python_rng": random.getstate(),
        }
        save_training_state(state, path / "trainer_state.pt")
        (path / "rollflow_checkpoint.json").write_text(json.dumps(
            {"format": 1, "lora": self.settings.lora is not None}))

    def load(self, path: str | Path) -> None:
        """Restore what `save` wrote (weights or LoRA adapters, optimizer, scheduler, RNG)."""
        path = Path(path)
        if self.settings.lora is not None:
            from rollflow.backends.lora import load_lora

            load_lora(self.model, path)
        elif self.settings.value_head:
            self.model.load(path)
        else:
            dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
            self.model.load_state_dict(load_causal_lm(str(path), dtype=dtype).state_dict())
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        if self.optimizer and state["optimizer"]:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler and state["scheduler"]:
            load_scheduler_state(self.scheduler, state["scheduler"])  # stretched to a raised train.steps
        torch.set_rng_state(state["torch_rng"])
        if self.device.type == "cuda" and state.get("cuda_rng") is not None:  # older checkpoints have none
            torch.cuda.set_rng_state(state["cuda_rng"])
        random.setstate(state["python_rng"])
