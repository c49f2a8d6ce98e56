"""`actor_train` role: holds a training backend; computes logprobs, trains, exports weights."""

from __future__ import annotations

import time

import torch

from rollflow.backends import create_backend
from rollflow.cluster.runtime import pin_threads
from rollflow.cluster.weight_sync import weights_checksum, weights_nbytes
from rollflow.config import RunConfig
from rollflow.data.sample import Batch
from rollflow.workers.actor_loss import ActorLoss


class ActorTrainWorker:
    """One training worker. Created as a Ray actor by `rollflow.cluster.groups`."""

    def __init__(self, config: RunConfig, num_cpus: float):
        self.threads = pin_threads(num_cpus)
        torch.manual_seed(config.seed)
        role, train = config.roles.actor_train, config.train
        self.backend = create_backend(
            role.backend, model_path=config.model.path, dtype=config.model.dtype, lr=train.lr,
            betas=train.betas, weight_decay=train.weight_decay, warmup_steps=train.warmup_steps,
            max_grad_norm=train.max_grad_norm, micro_batch_size=train.train_micro_batch_size,
            lr_schedule=train.lr_schedule, total_steps=train.steps * train.optimizer_steps_per_step,
            trust_remote_code=config.model.trust_remote_code, **role.backend_kwargs,
        )
        self.loss = ActorLoss(config.algorithm, config.rollout.temperature)
        self.temperature = config.rollout.temperature
        self.mini_batches = train.optimizer_steps_per_step
        self.version = 0

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """[B, T] logprobs of the response tokens under the current weights."""
        return self.backend.forward_logprobs(batch, self.temperature)

    def train(self, batch: Batch) -> dict[str, float]:
        """One RL step: `optimizer_steps_per_step` optimizer steps over shuffled mini-batches."""
        started = time.perf_counter()
        metrics: dict[str, float] = {}
        if self.mini_batches > 1:  # later mini-batches see moved weights: ratios need the old policy
            old = self.backend.forward_logprobs(batch, self.temperature)  # [B, T]
            batch.extras["old_logprobs"] = old
            gap = (old - batch.rollout_logprobs).abs() * batch.response_mask  # [B, T]
            metrics["check/train_infer_logprob_max_gap"] = float(gap.max())
        order = torch.randperm(batch.size)
        size = batch.size // self.mini_batches
        for index in range(self.mini_batches):
            step_metrics = self.backend.train_step(batch.select(order[index * size:(index + 1) * size]),
                                                   self.loss)
            for key, value in step_metrics.items():  # averaged over the optimizer steps
                metrics[key] = metrics.get(key, 0.0) + value / self.mini_batches
        self.version += 1
        metrics["time/train"] = time.perf_counter() - started
        return metrics

    def weights_for_sync(self) -> tuple[dict[str, torch.Tensor], int, str, int]:
        """(named tensors, policy version, checksum, bytes) for the inference engines."""
        weights = self.backend.named_weights()
        return weights, self.version, weights_checksum(weights), weights_nbytes(weights)

    def save(self, path: str) -> None:
        self.backend.save(path)

    def load(self, path: str, version: int) -> None:
        self.backend.load(path)
        self.version = version
