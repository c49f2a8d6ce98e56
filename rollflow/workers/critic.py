"""`critic` role: a value model (the policy's backbone + a scalar head) for PPO with GAE.

The driver calls `compute_values` before the advantage stage (values go to `batch.extras["values"]`) and
`train` after it (regressing on `batch.extras["returns"]` with the clipped value loss).
"""

from __future__ import annotations

import time

import torch

from rollflow.algorithms import LOSS_AGGREGATIONS, LossNormalizer, clipped_value_loss
from rollflow.backends import create_backend
from rollflow.cluster.placement import WorkerPlacement
from rollflow.config import RunConfig
from rollflow.data.sample import Batch
from rollflow.workers.actor_train import train_mini_batches
from rollflow.workers.base import PlacedWorker, torch_device


class CriticLoss:
    """`loss_fn(values, micro_batch, normalizer) -> (loss, metrics)` for `TorchBackend.train_step`.

    `algorithms.clipped_value_loss` against `extras["returns"]`, clipped around the rollout-time values
    `extras["values"]`, reduced with the actor's `loss_aggregation` (as verl does).

    Args:
        aggregation: a `LOSS_AGGREGATIONS` name.
        value_clip: the value clip range, or None.
    """

    def __init__(self, aggregation: str, value_clip: float | None):
        self.aggregation = LOSS_AGGREGATIONS.get(aggregation)
        self.value_clip = value_clip

    def __call__(self, values: torch.Tensor, batch: Batch, normalizer: LossNormalizer):
        mask = batch.response_mask  # [b, T]
        old_values, returns = batch.extras["values"], batch.extras["returns"]  # [b, T], [b, T]
        per_token = clipped_value_loss(values, old_values, returns, mask, self.value_clip)  # [b, T]
        loss = self.aggregation(per_token, mask, normalizer)
        tokens = mask.sum().clamp(min=1.0)
        metrics = {
            "critic/value_loss": float((per_token.detach()).sum() / tokens),
            "critic/values_mean": float((values.detach() * mask).sum() / tokens),
            "critic/returns_mean": float((returns * mask).sum() / tokens),
        }
        if self.value_clip is not None:
            outside = (values.detach() - old_values).abs() > self.value_clip  # [b, T]
            metrics["critic/value_clip_frac"] = float((outside.float() * mask).sum() / tokens)
        return loss, metrics


class CriticWorker(PlacedWorker):
    """One critic worker. Created as a Ray actor by `rollflow.cluster.groups` when advantage is `gae`."""

    def __init__(self, config: RunConfig, placement: WorkerPlacement):
        super().__init__(placement, config.cluster.device)
        torch.manual_seed(config.seed)
        train = config.train
        self.backend = create_backend(
            "torch", model_path=config.model.path, dtype=config.model.dtype,
            lr=train.critic_lr, betas=train.betas, weight_decay=train.weight_decay,
            warmup_steps=train.warmup_steps, max_grad_norm=train.max_grad_norm,
            micro_batch_size=train.train_micro_batch_size, lr_schedule=train.lr_schedule,
            total_steps=train.steps * train.optimizer_steps_per_step,
            trust_remote_code=config.model.trust_remote_code,
            max_response_length=config.rollout.max_new_tokens, value_head=True, device=torch_device(config),
        )
        self.loss = CriticLoss(config.algorithm.loss_aggregation, config.algorithm.value_clip)
        self.mini_batches = train.optimizer_steps_per_step

    def compute_values(self, batch: Batch) -> torch.Tensor:
        """[B, T] values of the response tokens, aligned like logprobs (0 on padding)."""
        return self.backend.forward_values(batch)

    def train(self, batch: Batch) -> dict[str, float]:
        """`optimizer_steps_per_step` optimizer steps on the clipped value loss (needs extras values and
        returns). Backend metrics (loss, grad_norm, lr) get the `critic/` prefix."""
        started = time.perf_counter()
        metrics = train_mini_batches(self.backend, batch, self.loss, self.mini_batches)
        metrics = {key if key.startswith("critic/") else f"critic/{key}": value
                   for key, value in metrics.items()}
        metrics["time/critic_train"] = time.perf_counter() - started
        return metrics

    def save(self, path: str) -> None:
        self.backend.save(path)

    def load(self, path: str) -> None:
        self.backend.load(path)
