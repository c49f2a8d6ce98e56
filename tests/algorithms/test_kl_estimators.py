"""KL estimators (values and the k3 gradient), the reward KL penalty and the KL controllers."""

import math

import pytest
import torch
from torch.testing import assert_close

from rollflow.algorithms import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_penalty

# delta = logp - ref = (-1 + 1.5, -2 + 1) = (0.5, -1.0)
LOGPROBS = [[-1.0, -2.0]]
REF = [[-1.5, -1.0]]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("k1", [[0.5, -1.0]]),  # delta
        ("k2", [[0.125, 0.5]]),  # 0.5 * delta^2
        ("mse", [[0.125, 0.5]]),
        ("abs", [[0.5, 1.0]]),  # |delta|
        # k3 with x = ref - logp = (-0.5, 1): exp(x) - x - 1 = (0.606531 + 0.5 - 1, 2.718282 - 2) = (0.106531, 0.718282)
        ("k3", [[0.106531, 0.718282]]),
    ],
)
def test_kl_values(name, expected):
    result = KL_ESTIMATORS.get(name)(torch.tensor(LOGPROBS), torch.tensor(REF))
    assert_close(result, torch.tensor(expected), atol=1e-6, rtol=0)


def test_k3_gradient():
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp) = (1 - 0.606531, 1 - 2.718282).
    logprobs = torch.tensor(LOGPROBS, requires_grad=True)
    KL_ESTIMATORS.get("k3")(logprobs, torch.tensor(REF)).sum().backward()
    assert_close(logprobs.grad, torch.tensor([[0.393469, -1.718282]]), atol=1e-6, rtol=0)


def _three_token_case():
    theta = torch.tensor([0.3, -0.2, 0.5], requires_grad=True, dtype=torch.float64)
    ref = torch.log_softmax(torch.tensor([0.0, 0.4, -0.1], dtype=torch.float64), 0)
    return theta, ref


def test_k3_is_unbiased_for_kl():
    # Exact expectation by enumeration over a 3-token vocabulary: E_pi[k3] = KL(pi || ref), and the full
    # gradient of that expectation (pathwise + score-function terms) is grad KL(pi || ref).
    theta, ref = _three_token_case()
    logp = torch.log_softmax(theta, 0)
    k3 = KL_ESTIMATORS.get("k3")(logp, ref)
    kl = (logp.exp() * (logp - ref)).sum()
    assert_close((logp.exp() * k3).sum(), kl)
    surrogate = (logp.exp().detach() * (k3 + k3.detach() * logp)).sum()
    grad_surrogate = torch.autograd.grad(surrogate, theta, retain_graph=True)[0]
    assert_close(grad_surrogate, torch.autograd.grad(kl, theta)[0])


def test_k3_loss_gradient_is_reverse_kl_gradient():
    # Used as a loss term on sampled tokens (no score-function term), E_pi[grad k3] = sum_y (pi - ref) grad log pi
    # = -sum_y ref grad log pi = grad KL(ref || pi): the gradient of the reverse KL, as documented in kl.py.
    theta, ref = _three_token_case()
    logp = torch.log_softmax(theta, 0)
    pathwise = (logp.exp().detach() * KL_ESTIMATORS.get("k3")(logp, ref)).sum()
    reverse_kl = (ref.exp() * (ref - logp)).sum()
    grad_pathwise = torch.autograd.grad(pathwise, theta, retain_graph=True)[0]
    assert_close(grad_pathwise, torch.autograd.grad(reverse_kl, theta)[0])


def test_k3_is_clamped_and_has_no_gradient_there():
    # x = ref - logp = 12: exp(12) - 13 = 162741 > 10 -> 10, and the clamp cuts the gradient.
    logprobs = torch.tensor([[0.0]], requires_grad=True)
    value = KL_ESTIMATORS.get("k3")(logprobs, torch.tensor([[12.0]]))
    value.sum().backward()
    assert value.item() == 10.0 and logprobs.grad.item() == 0.0


def test_kl_penalty_is_detached():
    logprobs = torch.tensor(LOGPROBS, requires_grad=True)
    penalty = kl_penalty(logprobs, torch.tensor(REF), "k1")
    assert not penalty.requires_grad
    assert_close(penalty, torch.tensor([[0.5, -1.0]]))


def test_fixed_kl_controller():
    controller = FixedKLController(0.2)
    controller.update(current_kl=5.0, n_steps=100)
    assert controller.value == 0.2


def test_adaptive_kl_controller():
    controller = AdaptiveKLController(init=0.1, target=1.0, horizon=100)
    # kl 1.5: error clip(1.5/1 - 1, -0.2, 0.2) = 0.2; beta *= 1 + 0.2 * 10/100 = 1.02 -> 0.102
    controller.update(current_kl=1.5, n_steps=10)
    assert controller.value == pytest.approx(0.102)
    # kl 0.9: error -0.1; beta *= 1 - 0.1 * 10/100 = 0.99 -> 0.10098
    controller.update(current_kl=0.9, n_steps=10)
    assert controller.value == pytest.approx(0.10098)
    assert math.isfinite(controller.value)
    with pytest.raises(ValueError):
        AdaptiveKLController(init=0.1, target=0.0, horizon=100)
