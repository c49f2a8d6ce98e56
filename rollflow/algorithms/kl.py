"""KL estimators (registered in `KL_ESTIMATORS`), the reward KL penalty and KL coefficient controllers.

Each estimator maps per-token log-probs of the sampled tokens under the policy and under the reference
to a per-token estimate of KL(policy || reference), with `delta = logprobs - ref_logprobs`
(Schulman, "Approximating KL divergence", 2020):

* `k1`: `delta` (unbiased, high variance, can be negative).
* `k2` (alias `mse`): `0.5 * delta^2` (biased, low variance).
* `k3`: `exp(-delta) + delta - 1` (unbiased, always >= 0), clamped to [-10, 10] as in ROLL/verl; the
  clamp cuts the gradient on clamped tokens.
* `abs`: `|delta|`.

Use `k3` for a KL term in the loss and `k1` for a KL penalty in the reward (`kl_penalty`). Note on k3 in
the loss: its per-token gradient is `(1 - exp(-delta)) * grad logprobs`, whose expectation over tokens
sampled from the policy is the gradient of KL(reference || policy), not of KL(policy || reference); the two
agree to first order near the reference (tested in tests/algorithms/test_kl_estimators.py).
"""

from __future__ import annotations

from torch import Tensor

from rollflow.algorithms.registries import KL_ESTIMATORS

K3_CLAMP = 10.0


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 estimate: `logprobs - ref_logprobs`.

    Args:
        logprobs: [B, T] policy log-probs.
        ref_logprobs: [B, T] reference log-probs.

    Returns:
        [B, T] per-token estimate.
    """
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 estimate: `0.5 * (logprobs - ref_logprobs)^2`.

    Args:
        logprobs: [B, T] policy log-probs.
        ref_logprobs: [B, T] reference log-probs.

    Returns:
        [B, T] per-token estimate.
    """
    return 0.5 * (logprobs - ref_logprobs) ** 2


KL_ESTIMATORS.register("mse")(kl_k2)


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 estimate: `exp(ref - logp) - (ref - logp) - 1`, clamped to [-10, 10].

    Args:
        logprobs: [B, T] policy log-probs.
        ref_logprobs: [B, T] reference log-probs.

    Returns:
        [B, T] per-token estimate (>= 0).
    """
    log_ratio = ref_logprobs - logprobs  # [B, T]
    return (log_ratio.exp() - log_ratio - 1.0).clamp(-K3_CLAMP, K3_CLAMP)


@KL_ESTIMATORS.register("abs")
def kl_abs(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Absolute estimate: `|logprobs - ref_logprobs|`.

    Args:
        logprobs: [B, T] policy log-probs.
        ref_logprobs: [B, T] reference log-probs.

    Returns:
        [B, T] per-token estimate.
    """
    return (logprobs - ref_logprobs).abs()


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token KL for a reward penalty: `token_rewards = -beta * kl_penalty(...) * mask`.

    The result is detached: a reward carries no gradient.

    Args:
        logprobs: [B, T] policy (or old policy) log-probs.
        ref_logprobs: [B, T] reference log-probs.
        estimator: a `KL_ESTIMATORS` name.

    Returns:
        [B, T] detached per-token KL estimate.
    """
    return KL_ESTIMATORS.get(estimator)(logprobs.detach(), ref_logprobs.detach())


class FixedKLController:
    """A constant KL coefficient.

    Args:
        init: the coefficient beta.
    """

    def __init__(self, init: float):
        self.value = init

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op, same interface as `AdaptiveKLController.update`."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al., 2019), the OpenRLHF / ROLL formula.

    `beta <- beta * (1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon)`.

    Args:
        init: initial beta.
        target: the KL to steer towards (> 0).
        horizon: steps over which a 20% error changes beta by 20%.
    """

    def __init__(self, init: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target and horizon must be > 0, got {target}, {horizon}")
        self.value = init
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move beta towards the target.

        Args:
            current_kl: the KL measured on the last batch.
            n_steps: samples (or steps, matching `horizon`'s unit) since the last update.
        """
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
