"""Training objectives of `actor_train`: the loss functions a pipeline hands the trainer, by name.

An objective is built once per trainer rank from the run config, `OBJECTIVES[name](config) -> loss_fn`,
and passed to `backend.train_step(batch, loss_fn)` on every step; the backend does the micro-batching and
the global loss normalization. `loss_fn(logits, micro_batch, normalizer) -> (loss, metrics)` (see
`rollflow.backends.base.LossFn`). The math of each objective lives in `rollflow.algorithms`.

- `policy_gradient`: the RL policy loss of the RLVR pipeline (`ActorLoss`: policy loss, train-inference
  correction, KL to the reference, entropy bonus).
- `nll`: supervised fine-tuning, the negative log-likelihood of the response tokens (`loss_mask` decides
  which tokens count: an assistant turn, never the prompt).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rollflow.algorithms import LOSS_AGGREGATIONS, LossNormalizer, token_nll
from rollflow.backends.logprobs import response_tokens
from rollflow.data.sample import Batch
from rollflow.registry import Registry
from rollflow.workers.actor_loss import ActorLoss

OBJECTIVES: Registry[Callable[[Any], Callable]] = Registry("training objective")


@OBJECTIVES.register("policy_gradient")
def policy_gradient(config) -> ActorLoss:
    """The RL policy loss configured by `config.algorithm`, at the rollout temperature."""
    return ActorLoss(config.algorithm, config.rollout.temperature)


class NLLLoss:
    """`loss_fn(logits, micro_batch, normalizer) -> (loss, metrics)`: the negative log-likelihood of the
    batch's response tokens (where `response_mask` is 1), reduced with a `LOSS_AGGREGATIONS` mode.

    Args:
        aggregation: a `LOSS_AGGREGATIONS` name ("token_mean": every target token weighs the same).
    """

    def __init__(self, aggregation: str = "token_mean"):
        self.aggregation = LOSS_AGGREGATIONS.get(aggregation)

    def __call__(self, logits: torch.Tensor, batch: Batch, normalizer: LossNormalizer):
        mask = batch.response_mask  # [b, T]
        per_token = token_nll(logits, response_tokens(batch))  # [b, T]
        loss = self.aggregation(per_token, mask, normalizer)
        nll = float((per_token.detach() * mask).sum() / mask.sum().clamp(min=1.0))
        return loss, {"sft/nll": nll}


@OBJECTIVES.register("nll")
def nll(config=None) -> NLLLoss:
    """Supervised fine-tuning: token-mean negative log-likelihood of the response tokens."""
    return NLLLoss("token_mean")


def train_mini_batches(backend, batch: Batch, loss_fn, mini_batches: int,
                       generator: torch.Generator | None = None) -> dict[str, float]:
    """Shuffle `batch`, split it into `mini_batches` near-equal parts, take one optimizer step on each.

    Returns the metrics averaged over the optimizer steps. Parts are empty only when the batch has fewer
    rows than `mini_batches` (after the difficulty mask dropped groups); those are skipped.

    Each part keeps the batch's full width (the default L of `seq_mean_token_sum_norm` is that width); the
    backend orders a part's rows by length and trims each micro-batch to its rows.
    """
    order = torch.randperm(batch.size, generator=generator)
    parts = [part for part in order.tensor_split(mini_batches) if part.numel()]
    metrics: dict[str, float] = {}
    for part in parts:
        for key, value in backend.train_step(batch.select(part), loss_fn).items():
            metrics[key] = metrics.get(key, 0.0) + value / len(parts)
    return metrics
