"""The actor's loss: a policy loss (optionally corrected for train-inference mismatch) + optional
KL-to-reference and entropy terms, aggregated globally.

Built from the algorithm config's registry names; the math lives in `rollflow.algorithms`.
"""

from __future__ import annotations

import torch

from rollflow.algorithms import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    LossNormalizer,
    PolicyLossInputs,
    entropy_from_logits,
    train_infer_correction,
)
from rollflow.backends.logprobs import response_tokens, token_logprobs
from rollflow.config import AlgorithmConfig
from rollflow.data.sample import Batch


class ActorLoss:
    """`loss_fn(logits, micro_batch, normalizer) -> (loss, metrics)` for `TorchBackend.train_step`.

    Needs `micro_batch.extras["advantages"]` [b, T]; uses `extras["old_logprobs"]` when present (several
    optimizer steps per RL step) and the current logprobs, detached, otherwise (one step: ratio == 1);
    `extras["ref_logprobs"]` when `kl_loss_coef > 0`; `extras["segment_ids"]` [b, T] (turn index per token)
    when the policy loss works per turn (`ipa_chunk`).

    With `algorithm.train_infer_correction`, the policy-gradient term is multiplied by truncated IS weights
    and/or masked (MIS) per `algorithms.train_infer_correction(old_logprobs, rollout_logprobs)`; the KL and
    entropy terms are not. Dropped tokens still count in the loss normalizer: masking acts as an IS weight
    of 0, it does not renormalize over the kept tokens (and the normalizer stays global).

    With `algorithm.old_logprobs: exact` the old logprobs are each token's sampling version's
    (`rollflow.workers.old_logprobs`): the correction's ratio is then the engine-trainer discrepancy alone, the
    PPO ratio the staleness, logged as `actor/staleness_ratio_mean` and `actor/staleness_log_ratio_abs_mean`.
    """

    def __init__(self, algorithm: AlgorithmConfig, temperature: float):
        self.policy_loss = POLICY_LOSSES.get(algorithm.policy_loss)
        self.policy_loss_kwargs = dict(algorithm.policy_loss_kwargs)
        self.aggregation = LOSS_AGGREGATIONS.get(algorithm.loss_aggregation)
        self.kl = KL_ESTIMATORS.get(algorithm.kl_estimator) if algorithm.kl_loss_coef > 0 else None
        self.kl_coef = algorithm.kl_loss_coef
        self.entropy_coef = algorithm.entropy_coef
        self.temperature = temperature
        correction = algorithm.train_infer_correction
        self.correction = correction.model_dump() if correction is not None else None
        self.exact_old = algorithm.old_logprobs == "exact"  # the old logprobs are the sampling versions'

    def __call__(self, logits: torch.Tensor, batch: Batch, normalizer: LossNormalizer):
        mask = batch.response_mask  # [b, T]
        logprobs = token_logprobs(logits, response_tokens(batch), self.temperature)  # [b, T]
        old = batch.extras.get("old_logprobs")
        old = logprobs.detach() if old is None else old  # [b, T]
        policy_mask, weights, metrics = mask, None, {}
        if self.correction is not None:
            weights, policy_mask, metrics = train_infer_correction(
                old, batch.rollout_logprobs, mask, **self.correction)  # [b, T], [b, T]
        inputs = PolicyLossInputs(
            logprobs=logprobs,
            old_logprobs=old,
            advantages=batch.extras["advantages"],
            mask=policy_mask,
            rollout_logprobs=batch.rollout_logprobs,
            rewards=batch.rewards,
            segment_ids=batch.extras.get("segment_ids"),  # [b, T] turn index (ipa_chunk), or None
        )
        per_token, loss_metrics = self.policy_loss(inputs, **self.policy_loss_kwargs)  # [b, T]
        if weights is not None:
            per_token = per_token * weights  # [b, T], stop-gradient weights
        loss = self.aggregation(per_token, policy_mask, normalizer)
        metrics = {f"actor/{k}": v for k, v in {**loss_metrics, **metrics}.items()}
        if self.exact_old and "old_logprobs" in batch.extras:  # the staleness term, sampling version -> now
            log_ratio = (logprobs.detach() - old) * mask  # [b, T]
            metrics["actor/staleness_ratio_mean"] = _masked_mean(log_ratio.exp(), mask)
            metrics["actor/staleness_log_ratio_abs_mean"] = _masked_mean(log_ratio.abs(), mask)
        if self.kl is not None:
            kl = self.kl(logprobs, batch.extras["ref_logprobs"])  # [b, T]
            kl_loss = self.aggregation(kl, mask, normalizer)
            loss = loss + self.kl_coef * kl_loss
            metrics["actor/kl"] = _masked_mean(kl, mask)
        if self.entropy_coef:
            entropy = entropy_from_logits(logits / self.temperature)  # [b, T]
            loss = loss - self.entropy_coef * self.aggregation(entropy, mask, normalizer)
            metrics["actor/entropy"] = _masked_mean(entropy, mask)
        return loss, metrics


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Token mean of a [b, T] tensor (the backend averages micro-batches weighted by token count)."""
    return float((values.detach() * mask).sum() / mask.sum().clamp(min=1))
