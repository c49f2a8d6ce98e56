"""`reference` role: a frozen copy of the initial policy (KL terms), or the teacher of on-policy
distillation (`roles.reference.model_path`)."""

from __future__ import annotations

import torch

from rollflow.cluster.placement import WorkerPlacement
from rollflow.data.sample import Batch
from rollflow.workers.base import PlacedWorker, build_backend
from rollflow.workers.specs import TrainerSpec


class ReferenceWorker(PlacedWorker):
    """A reference worker: with the torch backend an independent replica (the driver splits a batch's rows
    over the replicas), with fsdp2 a rank of one sharded model (every rank gets the whole batch).

    Args:
        placement: where this worker runs.
        spec: the reference's spec (`rollflow.workers.specs.trainer_spec`): a frozen model, the policy's or
            the teacher's (`roles.reference.model_path`).
    """

    def __init__(self, placement: WorkerPlacement, spec: TrainerSpec):
        super().__init__(placement, spec.device)
        self.spec = spec
        self.temperature = spec.temperature
        self.preload(spec.backend, spec.settings.model_path, spec.settings.trust_remote_code)

    def init_backend(self, master_addr: str, master_port: int, world_size: int) -> None:
        """Build the frozen model (a collective for fsdp2 ranks)."""
        self.join_ranks(master_addr, master_port, world_size)
        self.backend = build_backend(self.spec, self.placement)

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """[B, T] reference logprobs of the response tokens."""
        self.require_resident("compute_logprobs")
        return self.backend.forward_logprobs(batch, self.temperature)

    def compute_top_k(self, batch: Batch, k: int, temperature: float = 1.0) -> torch.Tensor:
        """A distillation teacher's [B, T, 2k]: its top-k log-probs at each response position, then their token
        ids (`TrainingBackendBase.forward_top_k`; `rollflow.backends.base.unpack_top_k` splits them)."""
        self.require_resident("compute_top_k")
        return self.backend.forward_top_k(batch, k, temperature)
