"""Loss aggregation: hand-computed values, and independence from micro-batch and data-parallel splits."""

import pytest
import torch
from torch.testing import assert_close

from rollflow.algorithms import LOSS_AGGREGATIONS, LossNormalizer, aggregate_loss, loss_normalizer

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 2 has no trained token


def test_loss_normalizer():
    assert loss_normalizer(MASK) == LossNormalizer(num_tokens=3.0, num_sequences=2.0, max_response_length=3.0)
    assert loss_normalizer(MASK, max_response_length=10).max_response_length == 10.0


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token_mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq_mean_token_mean", 2.75),  # (mean(1, 2) + mean(4)) / 2 sequences = (1.5 + 4) / 2
        ("seq_mean_token_sum", 3.5),  # ((1 + 2) + 4) / 2 sequences
        ("seq_mean_token_sum_norm", 7 / 6),  # ((1 + 2)/3 + 4/3) / 2 with L = T = 3
    ],
)
def test_aggregation_values(mode, expected):
    assert aggregate_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_dr_grpo_constant_and_empty_batch():
    normalizer = loss_normalizer(MASK, max_response_length=10)
    assert aggregate_loss(LOSS, MASK, "seq_mean_token_sum_norm", normalizer).item() == pytest.approx(
        0.35
    )  # 7/10/2
    empty = torch.zeros(2, 3)
    for mode in LOSS_AGGREGATIONS.names():
        assert aggregate_loss(LOSS[:2], empty, mode).item() == 0.0


def _problem(seed=0, batch=8, length=6):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 1, 3, 0, 5, 2, 4, 6])
    mask = (torch.arange(length) < lengths.unsqueeze(1)).double()  # [B, T], one empty row
    mask[0, 3] = 0.0  # a hole inside a row
    weights = torch.randn(batch, length, generator=generator, dtype=torch.float64)
    parameter = torch.randn(batch, length, generator=generator, dtype=torch.float64)
    return mask, weights, parameter


def _gradient(mode, mask, weights, parameter, splits, normalizer):
    """Sum of backward() over the given row splits, each aggregated with `normalizer`."""
    theta = parameter.clone().requires_grad_()
    for rows in splits:
        per_token = torch.sin(theta[rows]) * weights[rows] + theta[rows] ** 2  # any nonlinear per-token loss
        LOSS_AGGREGATIONS.get(mode)(per_token, mask[rows], normalizer).backward()
    return theta.grad


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS.names())
def test_gradient_independent_of_micro_batches_and_ranks(mode):
    mask, weights, parameter = _problem()
    full = _gradient(mode, mask, weights, parameter, [slice(0, 8)], loss_normalizer(mask))
    # 4 micro-batches of 2 sequences on one rank, with the normalizer of the whole batch.
    micro = [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    assert_close(
        _gradient(mode, mask, weights, parameter, micro, loss_normalizer(mask)), full, atol=1e-6, rtol=0
    )
    # 2 ranks of 4 sequences (2 micro-batches each). Each rank counts its own mask; the all-reduce SUMs the counts,
    # and the gradient all-reduce SUMs the ranks' gradients.
    rank_masks = [mask[0:4], mask[4:8]]
    counts = [loss_normalizer(m) for m in rank_masks]
    global_normalizer = LossNormalizer(
        num_tokens=sum(c.num_tokens for c in counts),
        num_sequences=sum(c.num_sequences for c in counts),
        max_response_length=6.0,
    )
    assert global_normalizer == loss_normalizer(mask)
    rank_gradients = [
        _gradient(mode, mask, weights, parameter, [slice(0, 2), slice(2, 4)], global_normalizer),
        _gradient(mode, mask, weights, parameter, [slice(4, 6), slice(6, 8)], global_normalizer),
    ]
    assert_close(rank_gradients[0] + rank_gradients[1], full, atol=1e-6, rtol=0)


def test_averaging_local_means_would_not_be_invariant():
    # Why the global normalizer matters: averaging each micro-batch's own token_mean weights tokens unevenly.
    mask, weights, parameter = _problem()
    full = _gradient("token_mean", mask, weights, parameter, [slice(0, 8)], loss_normalizer(mask))
    theta = parameter.clone().requires_grad_()
    for rows in (slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)):
        per_token = torch.sin(theta[rows]) * weights[rows] + theta[rows] ** 2
        (aggregate_loss(per_token, mask[rows], "token_mean") / 4).backward()
    assert not torch.allclose(theta.grad, full, atol=1e-3)
