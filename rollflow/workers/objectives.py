"""Training objectives of `actor_train`: the loss functions a pipeline hands the trainer, by name.

An objective is built once per trainer rank from the run config, `OBJECTIVES[name](config) -> loss_fn`,
and passed to `backend.train_step(batch, loss_fn)` on every step; the backend does the micro-batching and
the global loss normalization. `loss_fn(logits, micro_batch, normalizer) -> (loss, metrics)` (see
`rollflow.backends.base.LossFn`). The math of each objective lives in `rollflow.algorithms`.

- `policy_gradient`: the RL policy loss of the RLVR pipeline (`ActorLoss`: policy loss, train-inference
  correction, KL to the reference, entropy bonus).
- `nll`: supervised fine-tuning, the negative log-likelihood of the response tokens (`loss_mask` decides
  which tokens count: an assistant turn, never the prompt).
- `preference`: DPO / IPO / cDPO over rows that alternate chosen, rejected (`PreferenceLoss`).
- `distill`: (1 - w) * CE + w * KD against the teacher's top-k log-probs (`DistillLoss`).

The critic's value loss (`CriticLoss`) is here too, beside them: the loss the `critic` role trains.

An objective may also have `prepare(batch, backend) -> metrics`, which the trainer runs once on the whole
batch before splitting it (a forward pass over every row, say), so the loss of a micro-batch can use numbers
of rows that sit in other micro-batches or on other ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rollflow.algorithms import LOSS_AGGREGATIONS, LossNormalizer, clipped_value_loss, token_nll
from rollflow.algorithms.distillation import DIVERGENCES, distill_token_loss, restrict_to_topk
from rollflow.algorithms.preference import (
    PREFERENCE_LOSSES,
    pair_logratios,
    pair_weights,
    preference_metrics,
    sequence_logprob_sums,
)
from rollflow.backends.logprobs import response_tokens, token_logprobs
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


class PreferenceLoss:
    """DPO-family loss over a batch whose rows alternate chosen, rejected (pair i: rows 2i and 2i + 1).

    A pair's loss couples its two rows, but a micro-batch (or a data-parallel rank) may hold one row of a pair
    without the other. So `prepare` runs a no-grad forward over the whole batch, takes each pair's log-ratios
    against `extras["ref_logprobs"]` and the derivative of the pair's loss with respect to each
    (`rollflow.algorithms.preference.pair_weights`), and stores it per row (`extras["sequence_coef"]`, divided
    by the number of pairs). A micro-batch's loss is then `sum_rows coef * log pi(row)`: a sum over rows whose
    gradient is exactly the gradient of the batch's mean pair loss at the current weights (one optimizer step
    per batch; the model has no dropout, or the two forwards would differ). It costs one extra forward pass.
    The train metric `loss` is that surrogate; `dpo/loss` is the real one.

    Args:
        loss: a `PREFERENCE_LOSSES` name.
        loss_kwargs: its options (`beta`, `label_smoothing`).
    """

    def __init__(self, loss: str, loss_kwargs: dict[str, float]):
        self.loss = PREFERENCE_LOSSES.get(loss)
        self.loss_kwargs = dict(loss_kwargs)
        self.beta = float(loss_kwargs["beta"])

    def prepare(self, batch: Batch, backend) -> dict[str, float]:
        """Per-row coefficients into `batch.extras["sequence_coef"]`; returns the batch's `dpo/` metrics."""
        policy = sequence_logprob_sums(backend.forward_logprobs(batch), batch.response_mask)  # [B]
        reference = sequence_logprob_sums(batch.extras["ref_logprobs"], batch.response_mask)  # [B]
        chosen, rejected = pair_logratios(policy, reference)  # [N] each
        coef_chosen, coef_rejected, losses = pair_weights(self.loss, chosen, rejected, **self.loss_kwargs)
        coef = torch.stack([coef_chosen, coef_rejected], dim=1).reshape(-1) / len(losses)  # [B], rows' order
        batch.extras["sequence_coef"] = coef.float()
        return {"dpo/loss": float(losses.mean()), **preference_metrics(chosen, rejected, self.beta)}

    def __call__(self, logits: torch.Tensor, batch: Batch, normalizer: LossNormalizer):
        logprobs = token_logprobs(logits, response_tokens(batch))  # [b, t]
        sequence = (logprobs * batch.response_mask).sum(dim=1)  # [b]
        return (batch.extras["sequence_coef"] * sequence).sum(), {}


@OBJECTIVES.register("preference")
def preference(config) -> PreferenceLoss:
    """The DPO pipeline's loss: `config.dpo` (loss name, beta, label smoothing)."""
    return PreferenceLoss(config.dpo.loss, config.dpo.loss_kwargs())


class DistillLoss:
    """`(1 - w) * CE + w * KD` per token, token-mean over the batch's trained tokens.

    KD is a `DIVERGENCES` term between the student's and the teacher's distributions over the teacher's top-k
    tokens, both renormalized there (`restrict_to_topk`), at `temperature`; the teacher's ids and log-probs
    arrive as `extras["teacher_ids"]` / `extras["teacher_logprobs"]` [B, T, k]. CE is the student's NLL of the
    data's tokens where `extras["ce_mask"]` is 1 (the response; default: every trained token); KD counts on
    every trained token (`response_mask`: the response, or with prompt distillation the prompt too).

    Args:
        divergence: a `DIVERGENCES` name; divergence_kwargs: its options.
        kd_weight: w in [0, 1].
        temperature: divides the student's logits (the teacher's came at the same temperature).
    """

    def __init__(self, divergence: str, divergence_kwargs: dict[str, float], kd_weight: float,
                 temperature: float = 1.0):
        self.divergence = DIVERGENCES.get(divergence)
        self.divergence_kwargs = dict(divergence_kwargs)
        self.kd_weight, self.temperature = kd_weight, temperature
        self.aggregation = LOSS_AGGREGATIONS.get("token_mean")

    def __call__(self, logits: torch.Tensor, batch: Batch, normalizer: LossNormalizer):
        mask = batch.response_mask  # [b, t]
        ce_mask = batch.extras.get("ce_mask", mask)  # [b, t]
        ce = token_nll(logits, response_tokens(batch))  # [b, t]
        student, teacher = restrict_to_topk(logits, batch.extras["teacher_ids"], batch.extras["teacher_logprobs"],
                                            self.temperature)  # [b, t, k] each
        kd = self.divergence(student, teacher, **self.divergence_kwargs)  # [b, t]
        per_token = distill_token_loss(ce * ce_mask, kd, self.kd_weight)  # [b, t]
        loss = self.aggregation(per_token, mask, normalizer)
        tokens = mask.sum().clamp(min=1.0)
        metrics = {"distill/kd": float((kd.detach() * mask).sum() / tokens),
                   "distill/ce": float((ce.detach() * ce_mask).sum() / ce_mask.sum().clamp(min=1.0))}
        return loss, metrics


@OBJECTIVES.register("distill")
def distill(config) -> DistillLoss:
    """The distillation pipeline's loss: `config.distill`."""
    settings = config.distill
    return DistillLoss(settings.divergence, settings.divergence_kwargs, settings.kd_weight, settings.temperature)


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
