"""`critic` role: a value model (the policy's backbone + a scalar head) for PPO with GAE.

The driver calls `compute_values` before the advantage stage (values go to `batch.extras["values"]`) and
`train` after it (regressing on `batch.extras["returns"]` with the clipped value loss,
`rollflow.workers.objectives.CriticLoss`).
"""

from __future__ import annotations

import time

import torch

from rollflow.cluster.placement import WorkerPlacement
from rollflow.data.sample import Batch
from rollflow.data.seeds import derive_seed
from rollflow.errors import NonFiniteError
from rollflow.workers.base import PlacedWorker, build_backend, nonfinite_in_role
from rollflow.workers.objectives import train_mini_batches
from rollflow.workers.specs import TrainerSpec


class CriticWorker(PlacedWorker):
    """One critic worker (a data-parallel rank with `roles.critic.backend: fsdp2`). Started by
    `rollflow.workers.roles.start_roles` when the advantage is `gae`; `init_backend` builds the value model.

    Args:
        placement: where this worker runs.
        spec: the critic's spec (`rollflow.workers.specs.trainer_spec`): a value model and its `CriticLoss`.
    """

    def __init__(self, placement: WorkerPlacement, spec: TrainerSpec):
        super().__init__(placement, spec.device)
        self.spec = spec
        self.loss = spec.loss
        self.mini_batches = spec.mini_batches
        self.updates = 0  # critic updates so far: seeds each update's mini-batch split
        self.preload(spec.backend, spec.settings.model_path, spec.settings.trust_remote_code)

    def init_backend(self, master_addr: str, master_port: int, world_size: int) -> None:
        """Build the value model's backend; every rank calls this at the same time (a collective for fsdp2)."""
        self.join_ranks(master_addr, master_port, world_size)
        self.backend = build_backend(self.spec, self.placement)

    def compute_values(self, batch: Batch) -> torch.Tensor:
        """[B, T] values of the response tokens, aligned like logprobs (0 on padding)."""
        self.require_resident("compute_values")
        return self.backend.forward_values(batch)

    def train(self, batch: Batch) -> dict[str, float]:
        """`optimizer_steps_per_step` optimizer steps on the clipped value loss (needs extras values and
        returns). Backend metrics (loss, grad_norm, lr) get the `critic/` prefix."""
        self.require_resident("train")
        started = time.perf_counter()
        # every rank must draw the same mini-batch split (see ActorTrainWorker.train)
        shuffle = torch.Generator().manual_seed(derive_seed(self.spec.seed, "critic_minibatches", self.updates))
        try:
            metrics = train_mini_batches(self.backend, batch, self.loss, self.mini_batches, shuffle)
        except NonFiniteError as err:
            raise nonfinite_in_role(err, "critic", "train.critic_lr") from None
        self.updates += 1
        metrics = {key if key.startswith("critic/") else f"critic/{key}": value
                   for key, value in metrics.items()}
        metrics["time/critic_train"] = time.perf_counter() - started
        return metrics

    def save(self, path: str) -> None:
        self.backend.save(path)

    def load(self, path: str, updates: int) -> None:
        """Restore a checkpoint written after `updates` critic updates (one per RL step)."""
        self.backend.load(path)
        self.updates = updates
