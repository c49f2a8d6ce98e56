"""`reference` role: a frozen copy of the initial policy, for KL regularization."""

from __future__ import annotations

import torch

from rollflow.backends import create_backend
from rollflow.cluster.groups import reference_config
from rollflow.cluster.placement import WorkerPlacement
from rollflow.config import RunConfig
from rollflow.data.sample import Batch
from rollflow.workers.base import PlacedWorker, torch_device


class ReferenceWorker(PlacedWorker):
    def __init__(self, config: RunConfig, placement: WorkerPlacement):
        super().__init__(placement, config.cluster.device)
        config = reference_config(config)
        self.backend = create_backend(
            "torch", model_path=config.model.path, dtype=config.model.dtype,
            micro_batch_size=config.train.train_micro_batch_size, trainable=False,
            trust_remote_code=config.model.trust_remote_code, device=torch_device(config),
        )
        self.temperature = config.rollout.temperature

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """[B, T] reference logprobs of the response tokens."""
        return self.backend.forward_logprobs(batch, self.temperature)
