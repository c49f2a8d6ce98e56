"""The actor loss with train-inference mismatch corrections (TIS weights, MIS masks)."""

import math

import pytest
import torch

from rollflow.algorithms import loss_normalizer
from rollflow.backends.logprobs import response_tokens, token_logprobs
from rollflow.config import AlgorithmConfig, TrainInferCorrectionConfig
from rollflow.data.sample import Sample, collate
from rollflow.workers.actor_loss import ActorLoss

VOCAB = 5


def _batch():
    # two samples with 2 response tokens each; advantages +1 on sample 0, -1 on sample 1
    samples = [Sample([1], [2, 3], [-1.0, -1.0], group_id=0, reward=1.0),
               Sample([1], [4, 2], [-1.0, -1.0], group_id=0, reward=0.0)]
    batch = collate(samples, pad_token_id=0)
    batch.extras["advantages"] = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    return batch


def _loss(batch, logits, **options):
    loss_fn = ActorLoss(AlgorithmConfig(policy_loss="vanilla_pg", **options), temperature=1.0)
    return loss_fn(logits, batch, loss_normalizer(batch.response_mask))


def test_no_correction_is_the_plain_policy_loss():
    torch.manual_seed(0)
    batch, logits = _batch(), torch.randn(2, 2, VOCAB)
    loss, metrics = _loss(batch, logits)
    logprobs = token_logprobs(logits, response_tokens(batch))  # [2, 2]
    # vanilla_pg, token_mean over 4 tokens: -(lp00 + lp01 - lp10 - lp11) / 4
    assert loss.item() == pytest.approx(float(-(logprobs[0].sum() - logprobs[1].sum()) / 4), abs=1e-6)
    assert not any("train_infer" in key for key in metrics)


def test_token_tis_multiplies_the_loss_by_truncated_weights():
    torch.manual_seed(0)
    batch, logits = _batch(), torch.randn(2, 2, VOCAB)
    # old - rollout per token: ln 3 (weight min(3, 2) = 2), ln 0.5 (0.5), 0 (1), 0 (1)
    batch.extras["old_logprobs"] = batch.rollout_logprobs + torch.tensor([[math.log(3), math.log(0.5)], [0, 0]])
    correction = TrainInferCorrectionConfig(weight_level="token", upper_bound=2.0)
    loss, metrics = _loss(batch, logits, train_infer_correction=correction)
    logprobs = token_logprobs(logits, response_tokens(batch))
    expected = -(2.0 * logprobs[0, 0] + 0.5 * logprobs[0, 1] - logprobs[1, 0] - logprobs[1, 1]) / 4
    assert loss.item() == pytest.approx(float(expected), abs=1e-6)
    assert metrics["actor/is_weight_mean"] == pytest.approx((2.0 + 0.5 + 1 + 1) / 4)
    assert metrics["actor/is_weight_clip_frac"] == pytest.approx(1 / 4)


def test_sequence_mis_drops_a_sequence_but_keeps_it_in_the_normalizer():
    torch.manual_seed(0)
    batch, logits = _batch(), torch.randn(2, 2, VOCAB, requires_grad=True)
    # sequence log ratios: sample 0 ln 3 + 0 = ln 3 > ln 2 (dropped); sample 1 0 (kept, weight 1)
    batch.extras["old_logprobs"] = batch.rollout_logprobs + torch.tensor([[math.log(3), 0.0], [0.0, 0.0]])
    correction = TrainInferCorrectionConfig(weight_level=None, mask_level="sequence", low=0.5, high=2.0)
    loss, metrics = _loss(batch, logits, train_infer_correction=correction)
    logprobs = token_logprobs(logits.detach(), response_tokens(batch))
    # only sample 1 is trained, still divided by all 4 tokens: -(-lp10 - lp11) / 4
    assert loss.item() == pytest.approx(float((logprobs[1, 0] + logprobs[1, 1]) / 4), abs=1e-6)
    assert metrics["actor/mis_kept_frac"] == pytest.approx(0.5)
    loss.backward()
    assert torch.all(logits.grad[0] == 0) and logits.grad[1].abs().sum() > 0
