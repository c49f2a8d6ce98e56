"""Preference-optimization losses (the DPO family), registered in `PREFERENCE_LOSSES`.

Every loss has the signature

    fn(chosen_logratio [N], rejected_logratio [N], beta: float = 0.1, *, **options) -> per_pair_loss [N]

for N preference pairs, where `chosen_logratio = log pi(y_w|x) - log pi_ref(y_w|x)` is the difference of the
SEQUENCE log-probs (sums over the response tokens, see `sequence_logprob_sums`) of the chosen response under
the policy and under the frozen reference, and likewise `rejected_logratio` for the rejected response.
`h = chosen_logratio - rejected_logratio` is the implicit reward margin divided by beta. Reduce the
per-pair loss with a mean over the global number of pairs.

A trainer whose micro-batches may put the two responses of a pair in different micro-batches uses
`pair_weights` to turn the pair loss into a per-row surrogate with the same gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rollflow.algorithms.registries import PREFERENCE_LOSSES


def _check_pair(chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float) -> None:
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if chosen_logratio.shape != rejected_logratio.shape:
        raise ValueError(
            f"chosen_logratio and rejected_logratio must have the same shape, got "
            f"{tuple(chosen_logratio.shape)} and {tuple(rejected_logratio.shape)}"
        )


def _sigmoid_loss(
    chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float, label_smoothing: float
) -> Tensor:
    """`-(1 - eps) * logsigmoid(beta h) - eps * logsigmoid(-beta h)`, stable for any h."""
    logits = beta * (chosen_logratio - rejected_logratio)  # [N]
    return -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)  # [N]


@PREFERENCE_LOSSES.register("dpo")
def dpo(
    chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float = 0.1, *, label_smoothing: float = 0.0
) -> Tensor:
    """DPO (Rafailov et al., 2023), with optional label smoothing (cDPO, Mitchell 2023).

    `loss = -(1 - eps) * logsigmoid(beta h) - eps * logsigmoid(-beta h)`, `h = chosen_logratio -
    rejected_logratio`. With `eps = label_smoothing > 0` it is conservative DPO: the preference labels are
    assumed flipped with probability eps, so the loss is minimal at a finite margin instead of driving h to
    infinity. Gradient: `d loss / d chosen_logratio = -beta (1 - eps) sigmoid(-beta h) + beta eps sigmoid(beta h)`
    and the opposite for `rejected_logratio`.

    Args:
        chosen_logratio: [N] `log pi(y_w|x) - log pi_ref(y_w|x)` (sequence log-prob sums).
        rejected_logratio: [N] the same for the rejected response.
        beta: inverse temperature of the implicit reward (> 0).
        label_smoothing: eps in [0, 0.5).

    Returns:
        [N] per-pair loss.
    """
    _check_pair(chosen_logratio, rejected_logratio, beta)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    return _sigmoid_loss(chosen_logratio, rejected_logratio, beta, label_smoothing)


@PREFERENCE_LOSSES.register("cdpo")
def cdpo(
    chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float = 0.1, *, label_smoothing: float = 0.1
) -> Tensor:
    """Conservative DPO (cDPO, Mitchell 2023): `dpo` with label smoothing, which must be > 0.

    `loss = -(1 - eps) * logsigmoid(beta h) - eps * logsigmoid(-beta h)`, eps in (0, 0.5).

    Args:
        chosen_logratio: [N] `log pi(y_w|x) - log pi_ref(y_w|x)` (sequence log-prob sums).
        rejected_logratio: [N] the same for the rejected response.
        beta: inverse temperature of the implicit reward (> 0).
        label_smoothing: eps, the assumed probability that a preference label is flipped, in (0, 0.5).

    Returns:
        [N] per-pair loss.
    """
    _check_pair(chosen_logratio, rejected_logratio, beta)
    if not 0.0 < label_smoothing < 0.5:
        raise ValueError(f"cdpo needs label_smoothing in (0, 0.5), got {label_smoothing}; use dpo for 0")
    return _sigmoid_loss(chosen_logratio, rejected_logratio, beta, label_smoothing)


@PREFERENCE_LOSSES.register("ipo")
def ipo(chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float = 0.1) -> Tensor:
    """IPO (Azar et al., 2023, "A General Theoretical Paradigm to Understand Learning from Human Preferences").

    `loss = (h - 1 / (2 beta))^2`, `h = chosen_logratio - rejected_logratio`: a squared loss that regresses
    the margin to the fixed target `1 / (2 beta)` instead of pushing it to infinity. As in the paper, h is
    taken on SEQUENCE log-prob sums; some libraries (e.g. TRL) average the log-probs over tokens instead,
    which changes the scale of h and so the meaning of beta.

    Args:
        chosen_logratio: [N] `log pi(y_w|x) - log pi_ref(y_w|x)` (sequence log-prob sums).
        rejected_logratio: [N] the same for the rejected response.
        beta: regularization strength (> 0); the target margin is `1 / (2 beta)`.

    Returns:
        [N] per-pair loss.
    """
    _check_pair(chosen_logratio, rejected_logratio, beta)
    margin = chosen_logratio - rejected_logratio  # [N]
    return (margin - 1.0 / (2.0 * beta)) ** 2  # [N]


def preference_metrics(chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float) -> dict[str, float]:
    """Implicit-reward metrics of a batch of pairs, as python floats (no gradient).

    The implicit reward of a response is `beta * logratio`.

    Args:
        chosen_logratio: [N] chosen log-ratios.
        rejected_logratio: [N] rejected log-ratios.
        beta: the loss's beta.

    Returns:
        `dpo/rewards_chosen` (mean chosen reward), `dpo/rewards_rejected`, `dpo/reward_margin` (mean of
        chosen minus rejected reward) and `dpo/reward_accuracy` (fraction of pairs whose chosen reward is
        strictly greater). All 0.0 for N = 0.
    """
    rewards_chosen = beta * chosen_logratio.detach().float()  # [N]
    rewards_rejected = beta * rejected_logratio.detach().float()  # [N]
    if rewards_chosen.numel() == 0:
        return dict.fromkeys(
            ("dpo/rewards_chosen", "dpo/rewards_rejected", "dpo/reward_margin", "dpo/reward_accuracy"), 0.0
        )
    return {
        "dpo/rewards_chosen": float(rewards_chosen.mean()),
        "dpo/rewards_rejected": float(rewards_rejected.mean()),
        "dpo/reward_margin": float((rewards_chosen - rewards_rejected).mean()),
        "dpo/reward_accuracy": float((rewards_chosen > rewards_rejected).float().mean()),
    }


def sequence_logprob_sums(token_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Sum of the trained tokens' log-probs of each sequence.

    Untrained positions are replaced by 0 before the sum, so a NaN or inf in the padding cannot leak in.

    Args:
        token_logprobs: [B, T] per-token log-probs.
        mask: [B, T] float, 1.0 on response tokens.

    Returns:
        [B] sequence log-probs.
    """
    trained = torch.where(mask > 0, token_logprobs, torch.zeros_like(token_logprobs))  # [B, T]
    return (trained * mask).sum(dim=-1)  # [B]


def pair_weights(
    loss_fn: Callable[..., Tensor], chosen_logratio: Tensor, rejected_logratio: Tensor, **kwargs: Any
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-pair derivatives of a preference loss with respect to its two log-ratios.

    Why: a pair loss couples two rows (chosen and rejected), but a trainer's micro-batches may put them in
    different micro-batches or on different ranks. The trainer then (1) computes every pair's log-ratios with
    a no-grad forward pass, (2) calls this function, and (3) trains each row on the linear surrogate

        coef_chosen.detach() * seq_logprob(chosen) + coef_rejected.detach() * seq_logprob(rejected)

    (each row contributes its own term, in whichever micro-batch it lands). Because the reference log-probs
    are constants, `d loss / d theta = coef_chosen * d seq_logprob(chosen) / d theta + coef_rejected *
    d seq_logprob(rejected) / d theta` by the chain rule, so the surrogate's gradient equals the pair loss's
    gradient at the current weights (the weights of step (1)). The surrogate's VALUE is not the loss: log the
    returned `losses`. For a mean over the pairs, divide the coefficients by the global number of pairs.

    Computed with torch.autograd on detached copies, so it works under `torch.no_grad()` and never touches the
    inputs' graph. `loss_fn` must be per-pair (loss i depends only on pair i), as every `PREFERENCE_LOSSES`
    entry is: then the gradient of the summed loss is each pair's own derivative.

    Args:
        loss_fn: a preference loss, e.g. `PREFERENCE_LOSSES.get("dpo")`.
        chosen_logratio: [N] chosen log-ratios.
        rejected_logratio: [N] rejected log-ratios.
        **kwargs: passed to `loss_fn` (beta, label_smoothing, ...).

    Returns:
        (coef_chosen [N], coef_rejected [N], losses [N]), all detached, in float32 or wider.
    """
    dtype = torch.promote_types(chosen_logratio.dtype, torch.float32)
    chosen = chosen_logratio.detach().to(dtype).clone().requires_grad_(True)  # [N]
    rejected = rejected_logratio.detach().to(dtype).clone().requires_grad_(True)  # [N]
    with torch.enable_grad():
        losses = loss_fn(chosen, rejected, **kwargs)  # [N]
        coef_chosen, coef_rejected = torch.autograd.grad(losses.sum(), (chosen, rejected))
    return coef_chosen.detach(), coef_rejected.detach(), losses.detach()


def pair_logratios(policy: Tensor, reference: Tensor) -> tuple[Tensor, Tensor]:
    """[B] sequence log-probs of rows that alternate chosen, rejected -> ([N] chosen, [N] rejected) log-ratios
    log pi - log pi_ref."""
    if policy.shape[0] % 2:
        raise ValueError(f"a preference batch alternates chosen and rejected rows; got {policy.shape[0]} rows")
    ratios = policy - reference  # [B]
    return ratios[0::2], ratios[1::2]


class PairLogratios:
    """The chosen and rejected log-ratios of preference pairs, gathered batch by batch (an eval in chunks),
    then their `preference_metrics`."""

    def __init__(self):
        self.chosen: list[Tensor] = []
        self.rejected: list[Tensor] = []

    def add(self, policy: Tensor, reference: Tensor, mask: Tensor) -> None:
        """[B, T] token log-probs of the policy and the reference on rows that alternate chosen, rejected;
        `mask` [B, T] the trained tokens."""
        chosen, rejected = pair_logratios(sequence_logprob_sums(policy, mask), sequence_logprob_sums(reference, mask))
        self.chosen.append(chosen)
        self.rejected.append(rejected)

    def metrics(self, beta: float) -> dict[str, float]:
        return preference_metrics(torch.cat(self.chosen), torch.cat(self.rejected), beta)

