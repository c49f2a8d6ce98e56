"""`reference` role: a frozen copy of the initial policy, for KL regularization."""

from __future__ import annotations

import torch

from rollflow.backends import create_backend
from rollflow.cluster.runtime import pin_threads
from rollflow.config import RunConfig
from rollflow.data.sample import Batch


class ReferenceWorker:
    def __init__(self, config: RunConfig, num_cpus: float):
        self.threads = pin_threads(num_cpus)
        self.backend = create_backend(
            config.roles.actor_train.backend, model_path=config.model.path, dtype=config.model.dtype,
            micro_batch_size=config.train.train_micro_batch_size, trainable=False,
            trust_remote_code=config.model.trust_remote_code,
        )
        self.temperature = config.rollout.temperature

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """[B, T] reference logprobs of the response tokens."""
        return self.backend.forward_logprobs(batch, self.temperature)
