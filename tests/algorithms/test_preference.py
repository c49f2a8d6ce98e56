"""Preference losses (DPO, cDPO, IPO): values, gradients, metrics, and the split-pair surrogate."""

import math
import re

import pytest
import torch
from torch.testing import assert_close

from rollflow.algorithms import (
    PREFERENCE_LOSSES,
    check_hyperparams,
    pair_weights,
    preference_metrics,
    sequence_logprob_sums,
)
from rollflow.registry import UnknownNameError

# h = chosen - rejected = (1 - 0, -0.5 - 0.5) = (1, -1); with beta = 0.5, beta * h = (0.5, -0.5).
CHOSEN = [1.0, -0.5]
REJECTED = [0.0, 0.5]


def _pairs(dtype=torch.float64):
    return torch.tensor(CHOSEN, dtype=dtype), torch.tensor(REJECTED, dtype=dtype)


def test_registered_names():
    assert {"cdpo", "dpo", "ipo"} <= set(PREFERENCE_LOSSES.names())


@pytest.mark.parametrize(
    ("name", "options", "expected"),
    [
        # -logsigmoid(x) = ln(1 + e^-x): ln(1 + e^-0.5) = ln 1.606531 = 0.474077; ln(1 + e^0.5) = ln 2.648721 = 0.974077
        ("dpo", {}, [0.474077, 0.974077]),
        # eps = 0.2: 0.8 * 0.474077 + 0.2 * 0.974077 = 0.574077; 0.8 * 0.974077 + 0.2 * 0.474077 = 0.874077
        ("dpo", {"label_smoothing": 0.2}, [0.574077, 0.874077]),
        ("cdpo", {"label_smoothing": 0.2}, [0.574077, 0.874077]),
        # cdpo's default eps = 0.1: 0.9 * 0.474077 + 0.1 * 0.974077 = 0.524077; 0.9 * 0.974077 + 0.1 * 0.474077 = 0.924077
        ("cdpo", {}, [0.524077, 0.924077]),
        # target 1 / (2 * 0.5) = 1: (1 - 1)^2 = 0, (-1 - 1)^2 = 4
        ("ipo", {}, [0.0, 4.0]),
    ],
)
def test_loss_values(name, options, expected):
    chosen, rejected = _pairs()
    loss = PREFERENCE_LOSSES.get(name)(chosen, rejected, beta=0.5, **options)
    assert_close(loss, torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=0)


def test_dpo_gradient_matches_hand_formula():
    # d/dchosen = -beta (1 - eps) sigmoid(-beta h) + beta eps sigmoid(beta h), beta = 0.5, eps = 0.2,
    # sigmoid(0.5) = 0.622459, sigmoid(-0.5) = 0.377541:
    #   pair 0 (beta h = 0.5):  -0.5 * 0.8 * 0.377541 + 0.5 * 0.2 * 0.622459 = -0.151016 + 0.062246 = -0.088770
    #   pair 1 (beta h = -0.5): -0.5 * 0.8 * 0.622459 + 0.5 * 0.2 * 0.377541 = -0.248984 + 0.037754 = -0.211230
    # and d/drejected is the opposite.
    chosen, rejected = (t.requires_grad_(True) for t in _pairs())
    PREFERENCE_LOSSES.get("dpo")(chosen, rejected, beta=0.5, label_smoothing=0.2).sum().backward()
    expected = torch.tensor([-0.088770, -0.211230], dtype=torch.float64)
    assert_close(chosen.grad, expected, atol=1e-6, rtol=0)
    assert_close(rejected.grad, -expected, atol=1e-6, rtol=0)


def test_dpo_gradient_formula_on_random_inputs():
    torch.manual_seed(0)
    chosen = torch.randn(16, dtype=torch.float64, requires_grad=True)
    rejected = torch.randn(16, dtype=torch.float64, requires_grad=True)
    beta, eps = 0.3, 0.15
    PREFERENCE_LOSSES.get("dpo")(chosen, rejected, beta=beta, label_smoothing=eps).sum().backward()
    h = (chosen - rejected).detach()
    expected = -beta * (1 - eps) * torch.sigmoid(-beta * h) + beta * eps * torch.sigmoid(beta * h)
    assert_close(chosen.grad, expected)
    assert_close(rejected.grad, -expected)


def test_ipo_gradient():
    # d/dchosen (h - 1)^2 = 2 (h - 1) = (2 * 0, 2 * -2) = (0, -4); d/drejected = (0, 4).
    chosen, rejected = (t.requires_grad_(True) for t in _pairs())
    PREFERENCE_LOSSES.get("ipo")(chosen, rejected, beta=0.5).sum().backward()
    assert_close(chosen.grad, torch.tensor([0.0, -4.0], dtype=torch.float64))
    assert_close(rejected.grad, torch.tensor([0.0, 4.0], dtype=torch.float64))


def _loop_loss(name, chosen, rejected, beta, eps):
    """Plain-python per-pair loss, one pair at a time."""
    out = []
    for c, r in zip(chosen.tolist(), rejected.tolist()):
        h = c - r
        if name == "ipo":
            out.append((h - 1.0 / (2.0 * beta)) ** 2)
        else:  # -logsigmoid(x) = ln(1 + e^-x)
            out.append((1 - eps) * math.log1p(math.exp(-beta * h)) + eps * math.log1p(math.exp(beta * h)))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize(
    ("name", "options"), [("dpo", {}), ("dpo", {"label_smoothing": 0.3}), ("cdpo", {}), ("ipo", {})]
)
def test_vectorized_matches_loop(name, options):
    torch.manual_seed(1)
    chosen, rejected = torch.randn(7, dtype=torch.float64) * 3, torch.randn(7, dtype=torch.float64) * 3
    beta = 0.4
    eps = options.get("label_smoothing", 0.1 if name == "cdpo" else 0.0)
    loss = PREFERENCE_LOSSES.get(name)(chosen, rejected, beta=beta, **options)
    assert_close(loss, _loop_loss(name, chosen, rejected, beta, eps))


def test_dpo_is_stable_for_large_margins():
    # beta h = +-1000: -logsigmoid(1000) = 0 and -logsigmoid(-1000) = 1000, no overflow.
    loss = PREFERENCE_LOSSES.get("dpo")(torch.tensor([1000.0, -1000.0]), torch.zeros(2), beta=1.0)
    assert_close(loss, torch.tensor([0.0, 1000.0]))


def test_unknown_name_lists_valid_names():
    valid = re.escape(f"Valid: {', '.join(PREFERENCE_LOSSES.names())}")
    with pytest.raises(UnknownNameError, match=rf"Did you mean 'dpo'\? {valid}"):
        PREFERENCE_LOSSES.get("dpoo")


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("dpo", {"beta": 0.0}),
        ("dpo", {"beta": -0.1}),
        ("dpo", {"label_smoothing": 0.5}),
        ("dpo", {"label_smoothing": -0.1}),
        ("cdpo", {"label_smoothing": 0.0}),
        ("cdpo", {"label_smoothing": 0.5}),
        ("ipo", {"beta": 0.0}),
    ],
)
def test_bad_options_raise(name, kwargs):
    chosen, rejected = _pairs()
    with pytest.raises(ValueError):
        PREFERENCE_LOSSES.get(name)(chosen, rejected, **kwargs)


def test_mismatched_shapes_raise():
    with pytest.raises(ValueError, match="same shape"):
        PREFERENCE_LOSSES.get("dpo")(torch.zeros(2), torch.zeros(3))


def test_check_hyperparams_knows_the_options():
    check_hyperparams(PREFERENCE_LOSSES.get("dpo"), {"beta": 0.1, "label_smoothing": 0.1})
    check_hyperparams(PREFERENCE_LOSSES.get("ipo"), {"beta": 0.1})
    with pytest.raises(ValueError, match="did you mean 'label_smoothing'"):
        check_hyperparams(PREFERENCE_LOSSES.get("dpo"), {"label_smooth": 0.1})
    with pytest.raises(ValueError, match="valid: beta"):
        check_hyperparams(PREFERENCE_LOSSES.get("ipo"), {"label_smoothing": 0.1})


def test_preference_metrics():
    # beta = 0.5: chosen rewards 0.5 * (2, 1, -1) = (1, 0.5, -0.5), mean 1/3;
    # rejected rewards 0.5 * (0, 0.5, 1) = (0, 0.25, 0.5), mean 0.25;
    # margins (1, 0.25, -1), mean 0.083333; chosen > rejected in 2 of 3 pairs.
    chosen = torch.tensor([2.0, 1.0, -1.0], requires_grad=True)
    metrics = preference_metrics(chosen, torch.tensor([0.0, 0.5, 1.0]), beta=0.5)
    assert metrics == pytest.approx(
        {
            "dpo/rewards_chosen": 1 / 3,
            "dpo/rewards_rejected": 0.25,
            "dpo/reward_margin": 0.25 / 3,
            "dpo/reward_accuracy": 2 / 3,
        }
    )
    assert all(isinstance(value, float) for value in metrics.values())
    assert set(preference_metrics(torch.zeros(0), torch.zeros(0), 0.1).values()) == {0.0}


def test_sequence_logprob_sums_ignore_padding():
    # (-1 - 2) = -3 (the NaN sits in padding); (-0.5 * 3) = -1.5.
    token_logprobs = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, -0.5, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert_close(sequence_logprob_sums(token_logprobs, mask), torch.tensor([-3.0, -1.5]))


def test_pair_weights_are_the_hand_derivatives():
    chosen, rejected = _pairs()
    with torch.no_grad():  # works without grad mode: it differentiates detached copies
        coef_chosen, coef_rejected, losses = pair_weights(
            PREFERENCE_LOSSES.get("dpo"), chosen, rejected, beta=0.5, label_smoothing=0.2
        )
    # the hand derivatives of test_dpo_gradient_matches_hand_formula
    expected = torch.tensor([-0.088770, -0.211230], dtype=torch.float64)
    assert_close(coef_chosen, expected, atol=1e-6, rtol=0)
    assert_close(coef_rejected, -expected, atol=1e-6, rtol=0)
    assert_close(losses, torch.tensor([0.574077, 0.874077], dtype=torch.float64), atol=1e-6, rtol=0)
    assert not (coef_chosen.requires_grad or coef_rejected.requires_grad or losses.requires_grad)
    assert chosen.grad is None and not chosen.requires_grad


class _TinyLM(torch.nn.Module):
    """Per-token logits from fixed features: logits = features @ weight, so log-probs are differentiable."""

    def __init__(self, dim: int, vocab: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim, vocab, dtype=torch.float64) * 0.5)

    def sequence_logprobs(self, features, tokens, mask):
        logprobs = torch.log_softmax(features @ self.weight, dim=-1)  # [B, T, V]
        token_logprobs = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B, T]
        return sequence_logprob_sums(token_logprobs, mask)  # [B]


@pytest.mark.parametrize(
    ("name", "options"),
    [("dpo", {"beta": 0.3}), ("cdpo", {"beta": 0.3, "label_smoothing": 0.2}), ("ipo", {"beta": 0.5})],
)
def test_pair_weights_surrogate_gradient_equals_pair_loss_gradient(name, options):
    torch.manual_seed(2)
    pairs, width, dim, vocab = 3, 4, 5, 7
    model = _TinyLM(dim, vocab)
    features = torch.randn(2 * pairs, width, dim, dtype=torch.float64)  # rows 0..2 chosen, 3..5 rejected
    tokens = torch.randint(0, vocab, (2 * pairs, width))
    mask = torch.ones(2 * pairs, width, dtype=torch.float64)
    mask[1, 3:] = 0.0
    mask[4, 2:] = 0.0
    ref = torch.randn(2 * pairs, dtype=torch.float64)  # reference sequence log-probs, constants
    loss_fn = PREFERENCE_LOSSES.get(name)

    # Direct: the mean pair loss over the whole batch.
    logratio = model.sequence_logprobs(features, tokens, mask) - ref  # [2P]
    loss_fn(logratio[:pairs], logratio[pairs:], **options).mean().backward()
    direct = model.weight.grad.clone()
    model.weight.grad = None

    # Split: a no-grad pass for the coefficients, then micro-batches that break every pair apart.
    with torch.no_grad():
        logratio = model.sequence_logprobs(features, tokens, mask) - ref
    coef_chosen, coef_rejected, _ = pair_weights(loss_fn, logratio[:pairs], logratio[pairs:], **options)
    coef = torch.cat([coef_chosen, coef_rejected]) / pairs  # [2P], row i's coefficient; / P for the mean
    for rows in ([0, 5], [3], [1, 2, 4]):
        rows = torch.tensor(rows)
        seq = model.sequence_logprobs(features[rows], tokens[rows], mask[rows])  # [mb]
        (coef[rows].detach() * seq).sum().backward()  # gradients accumulate across micro-batches
    assert_close(model.weight.grad, direct)
