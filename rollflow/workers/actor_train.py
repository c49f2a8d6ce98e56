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
            trust_remote_code=config.model.trust_remote_code,
            max_response_length=config.rollout.max_new_tokens, **role.backend_kwargs,
        )
        self.loss = ActorLoss(config.algorithm, config.rollout.temperature)
        self.temperature = config.rollout.temperature
        self.mini_batches = train.optimizer_steps_per_step
        self.version = 0

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """[B, T] logprobs of the response tokens under the current weights."""
        return self.backend.forward_logprobs(batch, self.temperature)

    def train(self, batch: Batch) -> dict[str, float]:
        """One RL step: `optimizer_steps_per_step` optimizer steps over shuffled mini-batches.

        Uses `batch.extras["old_logprobs"]` when the driver already computed them (KL in the reward, opd);
        otherwise computes them first when later mini-batches need them.
        """
        started = time.perf_counter()
        metrics: dict[str, float] = {}
        if self.mini_batches > 1 and "old_logprobs" not in batch.extras:
            # later mini-batches see moved weights: ratios need the old policy
            batch.extras["old_logprobs"] = self.backend.forward_logprobs(batch, self.temperature)  # [B, T]
        if "old_logprobs" in batch.extras:
            gap = (batch.extras["old_logprobs"] - batch.rollout_logprobs).abs()  # [B, T]
            gap = gap * batch.response_mask
            metrics["check/train_infer_logprob_max_gap"] = float(gap.max())
        metrics.update(train_mini_batches(self.backend, batch, self.loss, self.mini_batches))
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

    def compute_reference_logprobs(self, batch: Batch) -> torch.Tensor:
        """[B, T] reference logprobs: the base model with the LoRA adapters disabled (LoRA runs need no
        reference worker)."""
        return self.backend.forward_reference_logprobs(batch, self.temperature)


def train_mini_batches(backend, batch: Batch, loss_fn, mini_batches: int) -> dict[str, float]:
    """Shuffle `batch`, split it into `mini_batches` near-equal parts, take one optimizer step on each.

    Returns the metrics averaged over the optimizer steps. Parts are empty only when the batch has fewer
    rows than `mini_batches` (after the difficulty mask dropped groups); those are skipped.
    """
    order = torch.randperm(batch.size)
    parts = [part for part in order.tensor_split(mini_batches) if part.numel()]
    metrics: dict[str, float] = {}
    for part in parts:
        for key, value in backend.train_step(batch.select(part), loss_fn).items():
            metrics[key] = metrics.get(key, 0.0) + value / len(parts)
    return metrics
