"""Logit distillation from a teacher's top-k log-probs: divergences registered in `DIVERGENCES`.

What the teacher sends. Per response token, the teacher worker sends the ids of its k most likely tokens,
`teacher_ids [B, T, k]` (long), and its log-probs at those ids, `teacher_logprobs [B, T, k]` (the
full-vocabulary log-softmax at the teacher's temperature). k is typically 20-100, so the full `[B, T, V]`
teacher logits never cross the network.

Renormalization. BOTH distributions are restricted to the teacher's top-k ids and renormalized over those k
(`restrict_to_topk`): the teacher's `p` is its top-k log-probs minus their logsumexp, the student's `q` is
the log-softmax over k of its logits gathered at the same ids. Every divergence below is therefore between
two proper distributions over the same k outcomes; with k = V it is the exact full-vocabulary divergence.
(alibaba/ROLL's distillation does the same: softmax over the teacher's top-k logits, student logits
gathered at the top-k ids, then log-softmax over k.)

Every divergence has the signature

    fn(student_logq [B, T, k], teacher_logp [B, T, k], *, **options) -> per_token_divergence [B, T]

(>= 0 up to rounding) and is differentiable with respect to `student_logq`; the teacher carries no gradient.
Mix it with the SFT cross-entropy with `distill_token_loss`, then reduce with a `LOSS_AGGREGATIONS` mode.
Mixtures are computed in log space, `log(a p + (1 - a) q) = logaddexp(log a + log p, log(1 - a) + log q)`,
and `0 log 0 = 0`, so a teacher entry of -inf (probability 0) is allowed (the reverse-direction terms are
then infinite, as the math says; keep teacher log-probs finite for `reverse_kl` and `adaptive_kl`).
Padded positions must hold finite values (e.g. zeros); mask the result.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from rollflow.algorithms.registries import DIVERGENCES

# Guards the 0/0 of AKL's weights when p == q on a token (both gaps 0; then FKL = RKL = 0 too).
AKL_EPSILON = 1e-12


def restrict_to_topk(
    student_logits: Tensor, teacher_ids: Tensor, teacher_logprobs: Tensor, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Restrict student and teacher to the teacher's top-k ids, each renormalized over those k.

    The student's logits are divided by `temperature`, gathered at `teacher_ids`, then log-softmaxed over k
    (gathering first avoids a `[B, T, V]` log-softmax). The teacher's log-probs are shifted by their
    logsumexp over k. Computed in float32 or wider.

    Args:
        student_logits: [B, T, V] student logits at the response positions (requires grad).
        teacher_ids: [B, T, k] long, the teacher's top-k token ids.
        teacher_logprobs: [B, T, k] teacher log-probs at those ids (full-vocabulary log-softmax at the
            teacher's temperature).
        temperature: the student's softmax temperature (> 0).

    Returns:
        (student_logq [B, T, k], teacher_logp [B, T, k]), each log-normalized over k.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if teacher_ids.shape != teacher_logprobs.shape or teacher_ids.shape[:-1] != student_logits.shape[:-1]:
        raise ValueError(
            f"need teacher_ids and teacher_logprobs [B, T, k] and student_logits [B, T, V], got "
            f"{tuple(teacher_ids.shape)}, {tuple(teacher_logprobs.shape)}, {tuple(student_logits.shape)}"
        )
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    logits = student_logits.to(dtype).gather(-1, teacher_ids) / temperature  # [B, T, k]
    student_logq = logits - logits.logsumexp(dim=-1, keepdim=True)  # [B, T, k]
    teacher = teacher_logprobs.detach().to(dtype)  # [B, T, k]
    teacher_logp = teacher - teacher.logsumexp(dim=-1, keepdim=True)  # [B, T, k]
    return student_logq, teacher_logp


def _kl(log_a: Tensor, log_b: Tensor) -> Tensor:
    """KL(a || b) = sum_k a (log a - log b) over the last dim, with 0 log 0 = 0 (also in the gradient)."""
    a = log_a.exp()  # [B, T, k]
    safe_log_a = torch.where(a > 0, log_a, torch.zeros_like(log_a))  # [B, T, k], no -inf where a = 0
    return (a * (safe_log_a - log_b)).sum(dim=-1)  # [B, T]


def _log_mixture(log_a: Tensor, log_b: Tensor, weight: float) -> Tensor:
    """log(weight * a + (1 - weight) * b), elementwise, in log space."""
    return torch.logaddexp(math.log(weight) + log_a, math.log1p(-weight) + log_b)  # [B, T, k]


def _check_open_unit(name: str, value: float) -> None:
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {value}")


@DIVERGENCES.register("forward_kl")
def forward_kl(student_logq: Tensor, teacher_logp: Tensor) -> Tensor:
    """Forward KL, KL(p || q) = sum_k p (log p - log q): mode-covering (standard KD, Hinton et al. 2015).

    Its gradient with respect to the student's logits over the k ids is `(q - p) / temperature`.

    Args:
        student_logq: [B, T, k] student log-probs, normalized over k.
        teacher_logp: [B, T, k] teacher log-probs, normalized over k.

    Returns:
        [B, T] per-token divergence.
    """
    return _kl(teacher_logp, student_logq)


@DIVERGENCES.register("reverse_kl")
def reverse_kl(student_logq: Tensor, teacher_logp: Tensor) -> Tensor:
    """Reverse KL, KL(q || p) = sum_k q (log q - log p): mode-seeking (MiniLLM, Gu et al. 2024).

    Args:
        student_logq: [B, T, k] student log-probs, normalized over k.
        teacher_logp: [B, T, k] teacher log-probs, normalized over k.

    Returns:
        [B, T] per-token divergence.
    """
    return _kl(student_logq, teacher_logp)


@DIVERGENCES.register("js")
def js(student_logq: Tensor, teacher_logp: Tensor, *, beta: float = 0.5) -> Tensor:
    """Generalized Jensen-Shannon divergence (GKD, Agarwal et al. 2024).

    Convention: `m = beta p + (1 - beta) q`, `JS_beta = beta KL(p || m) + (1 - beta) KL(q || m)`, p the
    teacher and q the student. `beta = 0.5` is the symmetric JS divergence (at most ln 2). It is not
    rescaled: it goes to 0 at both ends beta -> 0 and beta -> 1 (use `forward_kl` / `reverse_kl` there).
    alibaba/ROLL's `js_divergence` is the beta = 0.5 case, computed as `log(prob + 1e-9)`.

    Args:
        student_logq: [B, T, k] student log-probs, normalized over k.
        teacher_logp: [B, T, k] teacher log-probs, normalized over k.
        beta: the teacher's weight in the mixture, in (0, 1).

    Returns:
        [B, T] per-token divergence.
    """
    _check_open_unit("js beta", beta)
    log_m = _log_mixture(teacher_logp, student_logq, beta)  # [B, T, k]
    return beta * _kl(teacher_logp, log_m) + (1.0 - beta) * _kl(student_logq, log_m)  # [B, T]


@DIVERGENCES.register("skewed_forward_kl")
def skewed_forward_kl(student_logq: Tensor, teacher_logp: Tensor, *, alpha: float = 0.1) -> Tensor:
    """Skew forward KL (DistiLLM, Ko et al. 2024): `KL(p || alpha p + (1 - alpha) q)`.

    Mixing some of the teacher into the student's side bounds the divergence (by `-log alpha`) and
    smooths its gradient where q is tiny. Same convention as alibaba/ROLL's `skew_lambda`.

    Args:
        student_logq: [B, T, k] student log-probs, normalized over k.
        teacher_logp: [B, T, k] teacher log-probs, normalized over k.
        alpha: the teacher's share of the mixture, in (0, 1).

    Returns:
        [B, T] per-token divergence.
    """
    _check_open_unit("skewed_forward_kl alpha", alpha)
    return _kl(teacher_logp, _log_mixture(teacher_logp, student_logq, alpha))


@DIVERGENCES.register("skewed_reverse_kl")
def skewed_reverse_kl(student_logq: Tensor, teacher_logp: Tensor, *, alpha: float = 0.1) -> Tensor:
    """Skew reverse KL (DistiLLM, Ko et al. 2024): `KL(q || alpha q + (1 - alpha) p)`.

    Same convention as alibaba/ROLL's `skew_lambda` (the mixture is `(1 - alpha) p + alpha q`).

    Args:
        student_logq: [B, T, k] student log-probs, normalized over k.
        teacher_logp: [B, T, k] teacher log-probs, normalized over k.
        alpha: the student's share of the mixture, in (0, 1).

    Returns:
        [B, T] per-token divergence.
    """
    _check_open_unit("skewed_reverse_kl alpha", alpha)
    return _kl(student_logq, _log_mixture(student_logq, teacher_logp, alpha))


@DIVERGENCES.register("adaptive_kl")
def adaptive_kl(student_logq: Tensor, teacher_logp: Tensor, *, mu: float = 0.5) -> Tensor:
    """Adaptive KL, AKL (Wu et al. 2024, "Rethinking Kullback-Leibler Divergence in Knowledge Distillation
    for Large Language Models").

    Per token: sort the teacher's k outcomes by p, descending; the head is the most likely tokens up to and
    including the one whose cumulative probability reaches `mu` (so the head holds at least `mu` of the
    mass), the tail is the rest. With the gaps `g_head = sum_head |p - q|` and `g_tail = sum_tail |p - q|`,

        AKL = g_head / (g_head + g_tail) * KL(p || q) + g_tail / (g_head + g_tail) * KL(q || p).

    The two weights are detached (no gradient flows through the gaps), so the gradient is the weighted sum
    of the forward and reverse KL gradients. The denominator is clamped to `AKL_EPSILON`: where p == q both
    gaps are 0 and AKL is 0 instead of 0/0. Ties in p at the head/tail boundary are split in sort order.

    Differences from alibaba/ROLL's `compute_adaptive_kl_divergence`: ROLL sorts ascending and puts in the
    tail the least likely tokens whose ascending cumulative probability is <= its `adaptive_kl_alpha`, so its
    alpha bounds the TAIL mass; our mu is the HEAD mass, and `mu = 1 - adaptive_kl_alpha` gives the same
    split (identical at the default 0.5). ROLL divides by `g_head + g_tail` unguarded, which is NaN on a
    token where the student matches the teacher exactly; here it is 0.

    Args:
        student_logq: [B, T, k] student log-probs, normalized over k.
        teacher_logp: [B, T, k] teacher log-probs, normalized over k.
        mu: head mass threshold, in (0, 1]; mu = 1 puts (nearly) every token in the head, i.e. forward KL.

    Returns:
        [B, T] per-token divergence.
    """
    if not 0.0 < mu <= 1.0:
        raise ValueError(f"adaptive_kl mu must be in (0, 1], got {mu}")
    p = teacher_logp.detach().exp()  # [B, T, k]
    q = student_logq.detach().exp()  # [B, T, k]
    sorted_p, order = p.sort(dim=-1, descending=True)  # [B, T, k]
    mass_before = F.pad(sorted_p.cumsum(dim=-1)[..., :-1], (1, 0))  # [B, T, k], mass of the likelier tokens
    head_sorted = mass_before < mu  # [B, T, k], includes the token that crosses mu
    head = torch.zeros_like(head_sorted).scatter(-1, order, head_sorted)  # [B, T, k], original order
    gap = (p - q).abs()  # [B, T, k]
    g_head = torch.where(head, gap, torch.zeros_like(gap)).sum(dim=-1)  # [B, T]
    g_tail = torch.where(head, torch.zeros_like(gap), gap).sum(dim=-1)  # [B, T]
    total = (g_head + g_tail).clamp_min(AKL_EPSILON)  # [B, T]
    forward = _kl(teacher_logp, student_logq)  # [B, T]
    reverse = _kl(student_logq, teacher_logp)  # [B, T]
    return (g_head / total) * forward + (g_tail / total) * reverse  # [B, T]


def distill_token_loss(ce: Tensor, kd: Tensor, kd_weight: float) -> Tensor:
    """Per-token mix of the SFT cross-entropy and the distillation divergence: `(1 - w) ce + w kd`.

    Args:
        ce: [B, T] per-token cross-entropy on the target tokens (e.g. `token_nll`).
        kd: [B, T] per-token divergence from a `DIVERGENCES` entry.
        kd_weight: w in [0, 1]; 1 is pure distillation, 0 pure SFT.

    Returns:
        [B, T] per-token loss; mask and reduce it with a `LOSS_AGGREGATIONS` mode.
    """
    if not 0.0 <= kd_weight <= 1.0:
        raise ValueError(f"kd_weight must be in [0, 1], got {kd_weight}")
    return (1.0 - kd_weight) * ce + kd_weight * kd  # [B, T]
