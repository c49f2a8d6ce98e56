"""`sim` training backend: a simulated trainer behind the backend protocol. No model runs; it sleeps what the
hardware profile says a step costs (`rollflow.sim.profiles`), on the simulated GPUs of its worker.

* `train_step`: `train_gpu_s_per_token * tokens / gpus + optimizer_step_s`, tokens counted in simulated tokens
  (every real token of the batch times `token_scale`); the loss function is not called (there is nothing to
  differentiate). Metrics: `loss` and `grad_norm` 0, the schedule's `lr`, `skipped_steps` 0.
* `forward_logprobs` (and the reference's): `forward_gpu_s_per_token * tokens / gpus`; returns the rollout's
  own logprobs, so the trainer and the `sim` engine agree exactly (the parity check, ratios of 1).
* `named_weights`: a small real payload (`payload_bytes`, changed by every step), so the weight-sync protocol
  moves, checksums and verifies real bytes; the sync's simulated cost is the engine's to sleep.
* `offload` / `onload`: the profile's seconds; `save` / `load`: the step count and the LR schedule's position,
  so a simulated run checkpoints and resumes like a real one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from rollflow.backends.base import LossFn, TrainerSettings, lr_multiplier
from rollflow.data.sample import Batch
from rollflow.sim.profiles import SimSettings

STATE_FILE = "sim_backend.json"


class SimBackend:
    """A simulated trainer (see the module docstring).

    Args:
        settings: the shared settings (`lr`, the schedule, `trainable`); the model is not loaded.
        simulation: `SimSettings` fields (`cluster.sim` and the worker's `gpus`), passed by the worker.
        payload_bytes: the size of the weights `named_weights` hands the sync.
    """

    def __init__(self, settings: TrainerSettings, *, simulation: dict[str, Any] | None = None,
                 payload_bytes: int = 1 << 16):
        self.settings = settings
        self.sim = SimSettings(**(simulation or {}))
        self.hardware = self.sim.hardware()
        self.payload_numel = max(1, payload_bytes // 4)
        self.resident = True
        self.optimizer_steps = 0
        self.stats = {"train_steps": 0, "forwards": 0, "simulated_seconds": 0.0}

    # ---- costs ----------------------------------------------------------------------------------------
    def simulated_tokens(self, batch: Batch) -> int:
        """Tokens of the batch as the simulated GPUs see them (prompt and response, padding excluded)."""
        return int(batch.attention_mask.sum()) * self.sim.token_scale

    def _spend(self, simulated_seconds: float) -> None:
        self.stats["simulated_seconds"] += simulated_seconds
        time.sleep(self.sim.wall(simulated_seconds))

    def _forward(self, batch: Batch) -> None:
        self.require_resident("forward")
        self.stats["forwards"] += 1
        self._spend(self.hardware.forward_gpu_s_per_token * self.simulated_tokens(batch) / self.sim.gpus)

    # ---- protocol --------------------------------------------------------------------------------------
    def require_resident(self, operation: str) -> None:
        if not self.resident:
            raise RuntimeError(f"SimBackend.{operation} called while offloaded; call onload() first")

    def forward_logprobs(self, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        """[B, T]: the engine's own logprobs (0 where padded), after the forward's simulated time."""
        self._forward(batch)
        return batch.rollout_logprobs.clone()

    def forward_reference_logprobs(self, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        return self.forward_logprobs(batch, temperature)

    def forward_values(self, batch: Batch) -> torch.Tensor:
        """[B, T] zeros, after the forward's simulated time."""
        self._forward(batch)
        return torch.zeros_like(batch.rollout_logprobs)

    def train_step(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """The simulated time of one optimizer step on `batch`; the schedule's LR."""
        self.require_resident("train_step")
        if not self.settings.trainable:
            raise AssertionError("train_step on a frozen backend (trainable=False)")
        tokens = self.simulated_tokens(batch)
        self._spend(self.hardware.train_gpu_s_per_token * tokens / self.sim.gpus + self.hardware.optimizer_step_s)
        settings = self.settings
        lr = settings.lr * lr_multiplier(self.optimizer_steps, settings.warmup_steps, settings.total_steps,
                                         settings.lr_schedule)
        self.optimizer_steps += 1
        self.stats["train_steps"] += 1
        return {"loss": 0.0, "grad_norm": 0.0, "lr": lr, "skipped_steps": 0.0,
                "sim/train_tokens": float(tokens)}

    def named_weights(self) -> dict[str, torch.Tensor]:
        """`payload_bytes` of float32 that every optimizer step changes."""
        return {"sim.weights": torch.full((self.payload_numel,), float(self.optimizer_steps))}

    def offload(self) -> None:
        if self.resident:
            self._spend(self.hardware.offload_s)
        self.resident = False

    def onload(self) -> None:
        if not self.resident:
            self._spend(self.hardware.onload_s)
        self.resident = True

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / STATE_FILE).write_text(json.dumps({"optimizer_steps": self.optimizer_steps}))

    def load(self, path: str | Path) -> None:
        self.optimizer_steps = json.loads((Path(path) / STATE_FILE).read_text())["optimizer_steps"]

    def close(self) -> None:
        """Nothing to release."""
