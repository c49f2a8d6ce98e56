"""Top-k logit distillation: renormalization, divergences (values, gradients, loops), options."""

import math

import pytest
import torch
from torch.testing import assert_close

from rollflow.algorithms import DIVERGENCES, check_hyperparams, distill_token_loss, restrict_to_topk
from rollflow.registry import UnknownNameError

ALL = DIVERGENCES.names()  # every registered divergence goes through the generic checks below


def _logs(*probs):
    """[1, len(probs), k] float64 log-probs from rows of probabilities."""
    return torch.tensor([probs], dtype=torch.float64).log()


def test_registered_names():
    assert {"adaptive_kl", "forward_kl", "js", "reverse_kl", "skewed_forward_kl", "skewed_reverse_kl"} <= \
        set(ALL)


# p = teacher (0.5, 0.5), q = student (0.25, 0.75).
@pytest.mark.parametrize(
    ("name", "options", "expected"),
    [
        # 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 ln 2 + 0.5 ln(2/3) = 0.5 ln(4/3) = 0.143841
        ("forward_kl", {}, 0.143841),
        # 0.25 ln(0.25/0.5) + 0.75 ln(0.75/0.5) = -0.173287 + 0.304099 = 0.130812
        ("reverse_kl", {}, 0.130812),
        # m = (0.375, 0.625); KL(p||m) = 0.5 ln(0.5/0.375) + 0.5 ln(0.5/0.625) = 0.5 ln(16/15) = 0.032269;
        # KL(q||m) = 0.25 ln(0.25/0.375) + 0.75 ln(0.75/0.625) = -0.101366 + 0.136741 = 0.035375;
        # 0.5 * 0.032269 + 0.5 * 0.035375 = 0.033822
        ("js", {}, 0.033822),
        # beta = 0.25: m = 0.25 p + 0.75 q = (0.3125, 0.6875); KL(p||m) = 0.075775, KL(q||m) = 0.009473;
        # 0.25 * 0.075775 + 0.75 * 0.009473 = 0.018944 + 0.007105 = 0.026048
        ("js", {"beta": 0.25}, 0.026048),
        # m = 0.1 p + 0.9 q = (0.275, 0.725); 0.5 ln(0.5/0.275) + 0.5 ln(0.5/0.725) = 0.298919 - 0.185782 = 0.113137
        ("skewed_forward_kl", {}, 0.113137),
        # m = 0.1 q + 0.9 p = (0.475, 0.525); 0.25 ln(0.25/0.475) + 0.75 ln(0.75/0.525) = -0.160463 + 0.267506 = 0.107043
        ("skewed_reverse_kl", {}, 0.107043),
    ],
)
def test_two_outcome_values(name, options, expected):
    value = DIVERGENCES.get(name)(_logs([0.25, 0.75]), _logs([0.5, 0.5]), **options)
    assert value.shape == (1, 1)
    assert_close(value, torch.tensor([[expected]], dtype=torch.float64), atol=1e-6, rtol=0)


# AKL on p = (0.1, 0.6, 0.3) (deliberately not sorted), q = (0.7, 0.2, 0.1):
# FKL = 0.6 ln 3 + 0.3 ln 3 + 0.1 ln(1/7) = 0.988751 - 0.194591 = 0.794160
# RKL = 0.2 ln(1/3) + 0.1 ln(1/3) + 0.7 ln 7 = -0.329584 + 1.362137 = 1.032553
AKL_P, AKL_Q = [0.1, 0.6, 0.3], [0.7, 0.2, 0.1]


@pytest.mark.parametrize(
    ("mu", "expected"),
    [
        # sorted p = (0.6, 0.3, 0.1), mass before = (0, 0.6, 0.9): mu = 0.5 -> head {0.6}.
        # g_head = |0.6 - 0.2| = 0.4, g_tail = |0.3 - 0.1| + |0.1 - 0.7| = 0.8 -> (0.794160 + 2 * 1.032553) / 3 = 0.953089
        (0.5, 0.953089),
        # mu = 0.7: 0.6 < 0.7, so the head also takes 0.3 (its cumulative 0.9 crosses mu).
        # g_head = 0.4 + 0.2 = 0.6, g_tail = 0.6 -> (0.794160 + 1.032553) / 2 = 0.913357
        (0.7, 0.913357),
        # mu = 1: every token is in the head, g_tail = 0 -> FKL
        (1.0, 0.794160),
    ],
)
def test_adaptive_kl_values(mu, expected):
    value = DIVERGENCES.get("adaptive_kl")(_logs(AKL_Q), _logs(AKL_P), mu=mu)
    assert_close(value, torch.tensor([[expected]], dtype=torch.float64), atol=1e-6, rtol=0)


def test_restrict_to_topk_renormalizes_both():
    # Student logits (0, ln 3, 7), teacher ids (1, 0): gathered (ln 3, 0) -> q = (3/4, 1/4).
    # Teacher log-probs (ln 0.3, ln 0.1) -> p = (0.3, 0.1) / 0.4 = (0.75, 0.25).
    logits = torch.tensor([[[0.0, math.log(3.0), 7.0]]])
    ids = torch.tensor([[[1, 0]]])
    teacher = torch.tensor([[[math.log(0.3), math.log(0.1)]]])
    student_logq, teacher_logp = restrict_to_topk(logits, ids, teacher)
    assert_close(student_logq.exp(), torch.tensor([[[0.75, 0.25]]]))
    assert_close(teacher_logp.exp(), torch.tensor([[[0.75, 0.25]]]))
    # temperature 2: (ln 3 / 2, 0) -> q = (sqrt 3, 1) / (sqrt 3 + 1) = (0.633975, 0.366025).
    student_logq, _ = restrict_to_topk(logits, ids, teacher, temperature=2.0)
    assert_close(student_logq.exp(), torch.tensor([[[0.633975, 0.366025]]]), atol=1e-6, rtol=0)


def test_restrict_to_topk_with_k_equal_v_is_the_full_log_softmax():
    torch.manual_seed(0)
    batch, width, vocab, temperature = 2, 3, 6, 1.7
    logits = torch.randn(batch, width, vocab)
    teacher_full = torch.log_softmax(torch.randn(batch, width, vocab), dim=-1)
    ids = teacher_full.argsort(dim=-1, descending=True)  # [B, T, V], a permutation per token
    student_logq, teacher_logp = restrict_to_topk(logits, ids, teacher_full.gather(-1, ids), temperature)
    assert_close(student_logq, torch.log_softmax(logits / temperature, dim=-1).gather(-1, ids))
    assert_close(teacher_logp, teacher_full.gather(-1, ids))


def _student_teacher(seed=0, batch=2, width=3, vocab=8, k=4, temperature=1.0, dtype=torch.float64):
    torch.manual_seed(seed)
    logits = torch.randn(batch, width, vocab, dtype=dtype, requires_grad=True)
    teacher_full = torch.log_softmax(2 * torch.randn(batch, width, vocab, dtype=dtype), dim=-1)
    teacher_logprobs, ids = teacher_full.topk(k, dim=-1)
    return logits, ids, teacher_logprobs


def test_forward_kl_gradient_is_q_minus_p():
    # d/dz_j sum_i p_i (log p_i - log q_i) = q_j - p_j over the k ids, 0 elsewhere; with temperature T
    # the logits are z / T, so the gradient is (q - p) / T.
    temperature = 2.0
    logits, ids, teacher_logprobs = _student_teacher()
    student_logq, teacher_logp = restrict_to_topk(logits, ids, teacher_logprobs, temperature)
    DIVERGENCES.get("forward_kl")(student_logq, teacher_logp).sum().backward()
    expected = torch.zeros_like(logits).scatter(-1, ids, (student_logq.exp() - teacher_logp.exp()).detach())
    assert_close(logits.grad, expected / temperature)


def _reverse_kl_grad(logq, logp):
    """d/dz_j sum_i q_i (log q_i - log p_i) = q_j (log q_j - log p_j - KL(q || p))."""
    kl = (logq.exp() * (logq - logp)).sum(-1, keepdim=True)
    return logq.exp() * (logq - logp - kl)


def test_reverse_kl_gradient():
    logits, ids, teacher_logprobs = _student_teacher(seed=1)
    student_logq, teacher_logp = restrict_to_topk(logits, ids, teacher_logprobs)
    DIVERGENCES.get("reverse_kl")(student_logq, teacher_logp).sum().backward()
    grad_k = _reverse_kl_grad(student_logq.detach(), teacher_logp)
    assert_close(logits.grad, torch.zeros_like(logits).scatter(-1, ids, grad_k))


def test_adaptive_kl_gradient_uses_detached_weights():
    # AKL gradient = w_head * (q - p) + w_tail * RKL gradient, the weights (from the gaps) constant.
    logq, logp = _logs(AKL_Q), _logs(AKL_P)
    logits = logq.clone().requires_grad_(True)  # softmax(log q) = q: logits equal to the log-probs
    DIVERGENCES.get("adaptive_kl")(torch.log_softmax(logits, dim=-1), logp, mu=0.5).sum().backward()
    # weights 0.4 / 1.2 = 1/3 and 0.8 / 1.2 = 2/3 (test_adaptive_kl_values, mu = 0.5)
    expected = (1 / 3) * (logq.exp() - logp.exp()) + (2 / 3) * _reverse_kl_grad(logq, logp)
    assert_close(logits.grad, expected)


def _kl_loop(a, b):
    return sum(x * math.log(x / y) for x, y in zip(a, b) if x > 0)


def _divergence_loop(name, q, p, options):
    """Plain-python divergence of one token's distributions (lists of probabilities)."""
    if name == "forward_kl":
        return _kl_loop(p, q)
    if name == "reverse_kl":
        return _kl_loop(q, p)
    if name == "js":
        beta = options.get("beta", 0.5)
        m = [beta * x + (1 - beta) * y for x, y in zip(p, q)]
        return beta * _kl_loop(p, m) + (1 - beta) * _kl_loop(q, m)
    if name == "skewed_forward_kl":
        alpha = options.get("alpha", 0.1)
        return _kl_loop(p, [alpha * x + (1 - alpha) * y for x, y in zip(p, q)])
    if name == "skewed_reverse_kl":
        alpha = options.get("alpha", 0.1)
        return _kl_loop(q, [alpha * y + (1 - alpha) * x for x, y in zip(p, q)])
    mu = options.get("mu", 0.5)
    head, mass = set(), 0.0
    for i in sorted(range(len(p)), key=lambda i: -p[i]):
        if mass >= mu:
            break
        head.add(i)
        mass += p[i]
    g_head = sum(abs(p[i] - q[i]) for i in head)
    g_tail = sum(abs(p[i] - q[i]) for i in range(len(p)) if i not in head)
    return (g_head * _kl_loop(p, q) + g_tail * _kl_loop(q, p)) / (g_head + g_tail)


@pytest.mark.parametrize(
    ("name", "options"),
    [(name, {}) for name in ALL]
    + [("js", {"beta": 0.3}), ("skewed_forward_kl", {"alpha": 0.4}), ("skewed_reverse_kl", {"alpha": 0.6})]
    + [("adaptive_kl", {"mu": 0.3}), ("adaptive_kl", {"mu": 0.8})],
)
def test_vectorized_matches_loop(name, options):
    logits, ids, teacher_logprobs = _student_teacher(seed=3, batch=3, width=4, k=5)
    student_logq, teacher_logp = restrict_to_topk(logits, ids, teacher_logprobs)
    result = DIVERGENCES.get(name)(student_logq, teacher_logp, **options)  # [B, T]
    expected = torch.zeros(3, 4, dtype=torch.float64)
    for b in range(3):
        for t in range(4):
            q = student_logq[b, t].exp().tolist()
            p = teacher_logp[b, t].exp().tolist()
            expected[b, t] = _divergence_loop(name, q, p, options)
    assert_close(result.detach(), expected)


@pytest.mark.parametrize("name", ALL)
def test_zero_when_student_equals_teacher(name):
    logits, ids, teacher_logprobs = _student_teacher(seed=4, dtype=torch.float32)
    _, teacher_logp = restrict_to_topk(logits, ids, teacher_logprobs)
    student_logq = teacher_logp.clone().requires_grad_(True)
    value = DIVERGENCES.get(name)(student_logq, teacher_logp)
    assert_close(value.detach(), torch.zeros_like(value), atol=1e-6, rtol=0)
    value.sum().backward()  # AKL's 0/0 is guarded: no NaN in the value or the gradient
    assert torch.isfinite(student_logq.grad).all()


@pytest.mark.parametrize("name", ALL)
def test_non_negative_on_random_inputs(name):
    logits, ids, teacher_logprobs = _student_teacher(seed=5, batch=4, width=16, vocab=32, k=8)
    value = DIVERGENCES.get(name)(*restrict_to_topk(logits, ids, teacher_logprobs))
    assert value.shape == (4, 16)
    assert (value >= -1e-12).all()


def test_js_is_at_most_ln2():
    # Disjoint-ish supports: p ~ (1, 0), q ~ (0, 1) -> JS -> ln 2 = 0.693147.
    value = DIVERGENCES.get("js")(_logs([1e-12, 1 - 1e-12]), _logs([1 - 1e-12, 1e-12]))
    assert_close(value, torch.tensor([[math.log(2.0)]], dtype=torch.float64), atol=1e-9, rtol=0)


def test_teacher_zero_probability_entry_is_allowed_in_forward_directions():
    # p = (1, 0) with log p = (0, -inf), q = (0.5, 0.5): FKL = 1 * ln(1 / 0.5) = ln 2 = 0.693147, gradient finite.
    teacher = torch.tensor([[[0.0, -float("inf")]]], dtype=torch.float64)
    for name in ("forward_kl", "js", "skewed_forward_kl", "skewed_reverse_kl"):
        student = _logs([0.5, 0.5]).requires_grad_(True)
        value = DIVERGENCES.get(name)(student, teacher)
        value.sum().backward()
        assert torch.isfinite(value).all() and torch.isfinite(student.grad).all(), name
    assert_close(
        DIVERGENCES.get("forward_kl")(_logs([0.5, 0.5]), teacher),
        torch.tensor([[math.log(2.0)]], dtype=torch.float64),
    )


def test_unknown_name_lists_valid_names():
    with pytest.raises(UnknownNameError) as error:
        DIVERGENCES.get("forward-kl")
    message = str(error.value)
    assert "Did you mean 'forward_kl'?" in message
    assert "Valid: " + ", ".join(ALL) in message


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("js", {"beta": 0.0}),
        ("js", {"beta": 1.0}),
        ("skewed_forward_kl", {"alpha": 0.0}),
        ("skewed_forward_kl", {"alpha": 1.0}),
        ("skewed_reverse_kl", {"alpha": 1.5}),
        ("skewed_reverse_kl", {"alpha": -0.1}),
        ("adaptive_kl", {"mu": 0.0}),
        ("adaptive_kl", {"mu": 1.01}),
    ],
)
def test_bad_options_raise(name, options):
    with pytest.raises(ValueError):
        DIVERGENCES.get(name)(_logs([0.25, 0.75]), _logs([0.5, 0.5]), **options)


def test_bad_restrict_arguments_raise():
    logits, ids, teacher_logprobs = _student_teacher()
    with pytest.raises(ValueError, match="temperature"):
        restrict_to_topk(logits, ids, teacher_logprobs, temperature=0.0)
    with pytest.raises(ValueError, match="teacher_ids"):
        restrict_to_topk(logits, ids[..., :2], teacher_logprobs)


def test_check_hyperparams_knows_the_options():
    check_hyperparams(DIVERGENCES.get("js"), {"beta": 0.3})
    check_hyperparams(DIVERGENCES.get("adaptive_kl"), {"mu": 0.5})
    with pytest.raises(ValueError, match="valid: beta"):
        check_hyperparams(DIVERGENCES.get("js"), {"alpha": 0.1})
    with pytest.raises(ValueError, match="valid: \\(none\\)"):
        check_hyperparams(DIVERGENCES.get("forward_kl"), {"alpha": 0.1})


def test_distill_token_loss():
    # w = 0.25: 0.75 * 2 + 0.25 * 0.5 = 1.625; 0.75 * 1 + 0.25 * 3 = 1.5
    loss = distill_token_loss(torch.tensor([[2.0, 1.0]]), torch.tensor([[0.5, 3.0]]), kd_weight=0.25)
    assert_close(loss, torch.tensor([[1.625, 1.5]]))
    for bad in (-0.1, 1.1):
        with pytest.raises(ValueError, match="kd_weight"):
            distill_token_loss(torch.zeros(1, 2), torch.zeros(1, 2), kd_weight=bad)
