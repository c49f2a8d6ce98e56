"""`reference` role: a frozen copy of the initial policy (KL terms), or the teacher of on-policy
distillation (`roles.reference.model_path`)."""

from __future__ import annotations

import torch

from rollflow.backends import create_backend
from rollflow.cluster.placement import WorkerPlacement
from rollflow.config import RunConfigBase
from rollflow.data.sample import Batch
from rollflow.workers.base import PlacedWorker, sampling_temperature, simulation_kwargs, trainer_settings


class ReferenceWorker(PlacedWorker):
    """A reference worker: with the torch backend an independent replica (the driver splits a batch's rows
    over the replicas), with fsdp2 a rank of one sharded model (every rank gets the whole batch).

    Args:
        placement: where this worker runs.
        config: the run config.
    """

    def __init__(self, placement: WorkerPlacement, config: RunConfigBase):
        super().__init__(placement, config.cluster.device)
        self.config = config
        self.temperature = sampling_temperature(config)
        role = config.roles.reference
        self.preload(role.backend, role.model_path or config.model.path, config.model.trust_remote_code)

    def init_backend(self, master_addr: str, master_port: int, world_size: int) -> None:
        """Build the frozen model (a collective for fsdp2 ranks)."""
        self.join_ranks(master_addr, master_port, world_size)
        role = self.config.roles.reference
        settings = trainer_settings(self.config, model_path=role.model_path or self.config.model.path,
                                    trainable=False)
        self.backend = create_backend(role.backend, settings, **role.backend_kwargs,
                                      **simulation_kwargs(self.config, self.placement, "reference", role.backend))

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """[B, T] reference logprobs of the response tokens."""
        self.require_resident("compute_logprobs")
        return self.backend.forward_logprobs(batch, self.temperature)

    def compute_top_k(self, batch: Batch, k: int, temperature: float = 1.0) -> torch.Tensor:
        """A distillation teacher's [B, T, 2k]: its top-k log-probs at each response position, then their token
        ids (`TrainingBackendBase.forward_top_k`; `rollflow.backends.base.unpack_top_k` splits them)."""
        self.require_resident("compute_top_k")
        return self.backend.forward_top_k(batch, k, temperature)
