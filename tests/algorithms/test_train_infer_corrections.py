"""Train-inference mismatch corrections: truncated and masked importance sampling at each level."""

import math

import pytest
import torch
from torch.testing import assert_close

from rollflow.algorithms import masked_is, train_infer_correction, truncated_is_weights
from rollflow.algorithms.corrections import train_infer_log_ratio

LN = math.log
# ratio = exp(old - rollout): row 0 = (1.5, 0.25, 1.2); row 1 = (3.0, 1.0, pad).
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
OLD = torch.tensor([[LN(1.5), LN(0.25), LN(1.2)], [LN(3.0), 0.0, 5.0]])
ROLLOUT = torch.zeros(2, 3)


def test_log_ratio_levels():
    # sequence: row 0 ln(1.5 * 0.25 * 1.2) = ln 0.45, row 1 ln 3; geometric: divided by 3 and 2 tokens.
    assert_close(train_infer_log_ratio(OLD, ROLLOUT, MASK, "token"), OLD * MASK)
    sequence = train_infer_log_ratio(OLD, ROLLOUT, MASK, "sequence")
    assert_close(sequence, torch.tensor([[LN(0.45)] * 3, [LN(3.0), LN(3.0), 0.0]]))
    geometric = train_infer_log_ratio(OLD, ROLLOUT, MASK, "geometric")
    assert_close(geometric, torch.tensor([[LN(0.45) / 3] * 3, [LN(3.0) / 2, LN(3.0) / 2, 0.0]]))
    with pytest.raises(ValueError, match="valid: token, sequence, geometric"):
        train_infer_log_ratio(OLD, ROLLOUT, MASK, "segment")


def test_truncated_is_token():
    # min(ratio, 2): (1.5, 0.25, 1.2), (2.0, 1.0, 0 on the pad). One of five tokens truncated.
    weights, mask, metrics = truncated_is_weights(OLD, ROLLOUT, MASK, upper_bound=2.0)
    assert_close(weights, torch.tensor([[1.5, 0.25, 1.2], [2.0, 1.0, 0.0]]))
    assert mask is MASK
    assert metrics["is_weight_clip_frac"] == pytest.approx(0.2)
    assert metrics["is_weight_mean"] == pytest.approx((1.5 + 0.25 + 1.2 + 2.0 + 1.0) / 5)


def test_truncated_is_sequence_and_geometric():
    # sequence: row 0 0.45, row 1 min(3, 2) = 2. geometric: row 0 0.45^(1/3) = 0.766309, row 1 3^(1/2) = 1.732051.
    weights, _, _ = truncated_is_weights(OLD, ROLLOUT, MASK, level="sequence", upper_bound=2.0)
    assert_close(weights, torch.tensor([[0.45, 0.45, 0.45], [2.0, 2.0, 0.0]]))
    weights, _, _ = truncated_is_weights(OLD, ROLLOUT, MASK, level="geometric", upper_bound=2.0)
    assert_close(weights, torch.tensor([[0.766309] * 3, [1.732051, 1.732051, 0.0]]), atol=1e-5, rtol=0)


def test_truncated_is_weights_are_detached():
    old = OLD.clone().requires_grad_()
    weights, _, _ = truncated_is_weights(old, ROLLOUT, MASK)
    assert not weights.requires_grad


def test_masked_is_levels():
    # token [0.5, 2]: drop 0.25 and 3.0 -> kept 3 of 5 tokens.
    weights, mask, metrics = masked_is(OLD, ROLLOUT, MASK, level="token", low=0.5, high=2.0)
    assert_close(mask, torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]))
    assert_close(weights, mask)
    assert metrics["mis_kept_frac"] == pytest.approx(0.6)
    # geometric [0.8, 1.8]: row 0 (0.766) dropped whole, row 1 (1.732) kept.
    _, mask, _ = masked_is(OLD, ROLLOUT, MASK, level="geometric", low=0.8, high=1.8)
    assert_close(mask, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    # sequence [0.4, 2.0]: row 0 (0.45) kept, row 1 (3.0) dropped.
    _, mask, _ = masked_is(OLD, ROLLOUT, MASK, level="sequence", low=0.4, high=2.0)
    assert_close(mask, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))


def test_train_infer_correction_combined():
    # Token MIS [0.5, 2] first, then token TIS (bound 2) on the surviving tokens.
    weights, mask, metrics = train_infer_correction(
        OLD, ROLLOUT, MASK, weight_level="token", upper_bound=2.0, mask_level="token", low=0.5, high=2.0
    )
    assert_close(mask, torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]))
    assert_close(weights, torch.tensor([[1.5, 0.0, 1.2], [0.0, 1.0, 0.0]]))
    assert metrics["train_infer_ratio_mean"] == pytest.approx((1.5 + 0.25 + 1.2 + 3.0 + 1.0) / 5)
    assert metrics["is_weight_clip_frac"] == 0.0 and metrics["mis_kept_frac"] == pytest.approx(0.6)
    weights, mask, _ = train_infer_correction(OLD, ROLLOUT, MASK, weight_level=None)
    assert_close(weights, MASK)
    assert_close(mask, MASK)
