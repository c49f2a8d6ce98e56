"""Policy losses, registered in `POLICY_LOSSES`.

Every loss has the signature

    fn(inputs: PolicyLossInputs, *, **options) -> (per_token_loss [B, T], metrics: dict[str, float])

The per-token loss is zero where `mask == 0`; reduce it with a `LOSS_AGGREGATIONS` mode. Metrics are
python floats over the trained tokens. `ratio = exp(logprobs - old_logprobs)` (current over proximal /
old policy); its log is clamped to [-20, 20] so a stray padded value cannot overflow. `sg(x)` below means
`x.detach()` (stop-gradient). Common metrics:

* `ratio_mean`, `ratio_max`, `ratio_min`: the importance ratio over trained tokens.
* `approx_kl`: mean of `0.5 * (logprobs - old_logprobs)^2` (k2 estimate of KL(old || current)).
* `policy_kl`: mean of `old_logprobs - logprobs` (k1 estimate of the same KL).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rollflow.algorithms.reductions import masked_float_metric
from rollflow.algorithms.registries import POLICY_LOSSES

LOG_RATIO_LIMIT = 20.0


@dataclass
class PolicyLossInputs:
    """What a policy loss may read.

    Attributes:
        logprobs: [B, T] log-probs of the sampled tokens under the current policy (requires grad).
        old_logprobs: [B, T] under the proximal / old policy (detached).
        advantages: [B, T].
        mask: [B, T] float, 1.0 on trained tokens.
        rollout_logprobs: [B, T] under the behaviour policy (the inference engine), or None.
        rewards: [B] scalar rewards (topr and raft_pp use their sign), or None.
        segment_ids: [B, T] long, the turn index of each response token in a multi-turn trajectory, -1 on
            environment / tool / padding tokens (ipa_chunk), or None.
    """

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    rollout_logprobs: Tensor | None = None
    rewards: Tensor | None = None
    segment_ids: Tensor | None = None


def _log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """`logprobs - old_logprobs`, 0 on untrained tokens, clamped to +-20."""
    log_ratio = torch.where(mask > 0, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    return log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)  # [B, T]


def _trained(logprobs: Tensor, mask: Tensor) -> Tensor:
    """`logprobs` with untrained positions set to 0, so a NaN or inf in the padding cannot leak into the loss."""
    return torch.where(mask > 0, logprobs, torch.zeros_like(logprobs))  # [B, T]


def _ratio_metrics(log_ratio: Tensor, mask: Tensor) -> dict[str, float]:
    log_ratio = log_ratio.detach()
    ratio = log_ratio.exp()
    return {
        "ratio_mean": masked_float_metric(ratio, mask, "mean"),
        "ratio_max": masked_float_metric(ratio, mask, "max"),
        "ratio_min": masked_float_metric(ratio, mask, "min"),
        "approx_kl": masked_float_metric(0.5 * log_ratio**2, mask, "mean"),
        "policy_kl": masked_float_metric(-log_ratio, mask, "mean"),
    }


def _require_rewards(inputs: PolicyLossInputs, loss: str) -> Tensor:
    if inputs.rewards is None:
        raise ValueError(f"policy loss {loss!r} needs PolicyLossInputs.rewards")
    return inputs.rewards


def _check_clip(clip_low: float, clip_high: float) -> None:
    if not 0.0 <= clip_low <= 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low <= 1 and clip_high >= 0, got {clip_low}, {clip_high}")


@POLICY_LOSSES.register("vanilla_pg")
def vanilla_pg(inputs: PolicyLossInputs) -> tuple[Tensor, dict]:
    """Vanilla policy gradient (REINFORCE, Williams 1992): `loss_t = -A_t * logprobs_t`.

    On-policy only: it ignores `old_logprobs` except for metrics.

    Args:
        inputs: logprobs, old_logprobs, advantages, mask.

    Returns:
        (per_token_loss [B, T], metrics).
    """
    loss = -inputs.advantages * _trained(inputs.logprobs, inputs.mask) * inputs.mask  # [B, T]
    return loss, _ratio_metrics(_log_ratio(inputs.logprobs, inputs.old_logprobs, inputs.mask), inputs.mask)


@POLICY_LOSSES.register("ppo")
def ppo(
    inputs: PolicyLossInputs,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    decoupled: bool = False,
    behaviour_weight_cap: float | None = 2.0,
) -> tuple[Tensor, dict]:
    """PPO clipped surrogate (Schulman et al., 2017), with clip-higher, dual clip and decoupled PPO.

    `loss_t = max(-A ratio, -A clip(ratio, 1 - clip_low, 1 + clip_high))`. Clip-higher (DAPO, Yu et al.,
    2025) is `clip_high > clip_low`. Dual clip (Ye et al., 2020): where `A < 0`,
    `loss_t = min(loss_t, -A * dual_clip)`, bounding the loss when the ratio explodes; `dual_clip` is the
    constant c > 1 (typically 3.0). Decoupled PPO (Hilton et al., 2022): the ratio is taken against the
    proximal policy `old_logprobs` and the loss is multiplied by the behaviour weight
    `sg(min(exp(old_logprobs - rollout_logprobs), behaviour_weight_cap))`.

    Args:
        inputs: logprobs, old_logprobs, advantages, mask; rollout_logprobs when decoupled.
        clip_low: epsilon below 1.
        clip_high: epsilon above 1.
        dual_clip: c for the dual clip, or None to disable.
        decoupled: apply the behaviour weight (needs rollout_logprobs).
        behaviour_weight_cap: upper bound of the behaviour weight, or None for no bound.

    Returns:
        (per_token_loss [B, T], metrics incl. clip_frac, clip_frac_high, clip_frac_low, dual_clip_frac and,
        when decoupled, behaviour_weight_mean / behaviour_weight_clip_frac).
    """
    _check_clip(clip_low, clip_high)
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (e.g. 3.0), got {dual_clip}")
    mask, advantages = inputs.mask, inputs.advantages
    log_ratio = _log_ratio(inputs.logprobs, inputs.old_logprobs, mask)  # [B, T]
    ratio = log_ratio.exp()  # [B, T]
    unclipped = -advantages * ratio  # [B, T]
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [B, T]
    loss = torch.maximum(unclipped, clipped)  # [B, T]
    metrics = _ratio_metrics(log_ratio, mask)
    metrics["clip_frac"] = masked_float_metric((clipped > unclipped).float(), mask)
    metrics["clip_frac_high"] = masked_float_metric((ratio > 1.0 + clip_high).float(), mask)
    metrics["clip_frac_low"] = masked_float_metric((ratio < 1.0 - clip_low).float(), mask)
    if dual_clip is not None:
        dual_bound = -advantages * dual_clip  # [B, T]
        dual_active = (advantages < 0) & (loss > dual_bound)  # [B, T]
        loss = torch.where(dual_active, dual_bound, loss)
        metrics["dual_clip_frac"] = masked_float_metric(dual_active.float(), mask)
    if decoupled:
        if inputs.rollout_logprobs is None:
            raise ValueError("ppo with decoupled=True needs PolicyLossInputs.rollout_logprobs")
        behaviour_log = _log_ratio(inputs.old_logprobs, inputs.rollout_logprobs, mask).detach()  # [B, T]
        weight = behaviour_log.exp()  # [B, T]
        if behaviour_weight_cap is not None:
            metrics["behaviour_weight_clip_frac"] = masked_float_metric(
                (weight > behaviour_weight_cap).float(), mask
            )
            weight = weight.clamp(max=behaviour_weight_cap)
        metrics["behaviour_weight_mean"] = masked_float_metric(weight, mask)
        loss = loss * weight
    return loss * mask, metrics


@POLICY_LOSSES.register("gspo")
def gspo(inputs: PolicyLossInputs, *, clip_low: float = 3e-4, clip_high: float = 4e-4) -> tuple[Tensor, dict]:
    """GSPO (Zheng et al., 2025): PPO clipping on the sequence-level, length-normalized ratio.

    `s_i = exp(mean_t (logprobs - old_logprobs))` over the trained tokens of sample i. Per token, the
    GSPO-token form `s_it = sg(s_i) * exp(logprobs_t - sg(logprobs_t))` has the value of `s_i` and the
    gradient `s_i * grad logprobs_t`, so with a per-sequence advantage and `seq_mean_token_mean`
    aggregation the gradient equals GSPO's `s_i A_i (1/|y_i|) sum_t grad logprobs_t`.
    `loss_t = max(-A s_it, -A clip(s_it, 1 - clip_low, 1 + clip_high))`.

    Args:
        inputs: logprobs, old_logprobs, advantages, mask.
        clip_low: epsilon below 1 (the paper uses 3e-4).
        clip_high: epsilon above 1 (the paper uses 4e-4).

    Returns:
        (per_token_loss [B, T], metrics incl. clip_frac (fraction of sequences clipped) and seq_ratio_mean).
    """
    _check_clip(clip_low, clip_high)
    mask, advantages = inputs.mask, inputs.advantages
    logprobs = _trained(inputs.logprobs, mask)  # [B, T]
    log_ratio = _log_ratio(logprobs, inputs.old_logprobs, mask)  # [B, T]
    lengths = mask.sum(dim=1).clamp(min=1.0)  # [B]
    seq_log_ratio = (log_ratio * mask).sum(dim=1) / lengths  # [B]
    token_log_ratio = seq_log_ratio.detach().unsqueeze(1) + logprobs - logprobs.detach()  # [B, T]
    seq_ratio = token_log_ratio.clamp(max=LOG_RATIO_LIMIT).exp()  # [B, T], value s_i on every token
    unclipped = -advantages * seq_ratio  # [B, T]
    clipped = -advantages * seq_ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [B, T]
    loss = torch.maximum(unclipped, clipped) * mask  # [B, T]
    has_tokens = (mask.sum(dim=1, keepdim=True) > 0).float()  # [B, 1]
    seq_clipped = ((clipped > unclipped) & (mask > 0)).any(dim=1, keepdim=True)  # [B, 1]
    metrics = _ratio_metrics(log_ratio, mask)
    metrics["clip_frac"] = masked_float_metric(seq_clipped.float(), has_tokens)
    metrics["seq_ratio_mean"] = masked_float_metric(seq_log_ratio.detach().exp().unsqueeze(1), has_tokens)
    return loss, metrics


@POLICY_LOSSES.register("cispo")
def cispo(
    inputs: PolicyLossInputs,
    *,
    clip_low: float = 1.0,
    clip_high: float = 0.2,
    unified_mask: bool = False,
) -> tuple[Tensor, dict]:
    """CISPO (MiniMax-M1, 2025): clip the importance weight, not the update.

    `loss_t = -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A_t * logprobs_t`. Every token keeps a
    gradient, scaled by its clipped weight. `clip_low = 1` (lower bound 0) follows the paper, which sets no
    lower bound. With `unified_mask`, tokens that PPO would clip (A > 0 and ratio > 1 + clip_high, or A < 0
    and ratio < 1 - clip_low) are dropped instead.

    Args:
        inputs: logprobs, old_logprobs, advantages, mask.
        clip_low: epsilon below 1.
        clip_high: epsilon above 1.
        unified_mask: apply the PPO trust-region token mask.

    Returns:
        (per_token_loss [B, T], metrics incl. clip_frac (weight clipped) and masked_frac with unified_mask).
    """
    _check_clip(clip_low, clip_high)
    mask, advantages = inputs.mask, inputs.advantages
    log_ratio = _log_ratio(inputs.logprobs, inputs.old_logprobs, mask)  # [B, T]
    ratio = log_ratio.detach().exp()  # [B, T]
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [B, T], no gradient
    loss = -weight * advantages * _trained(inputs.logprobs, mask)  # [B, T]
    metrics = _ratio_metrics(log_ratio, mask)
    metrics["clip_frac"] = masked_float_metric((weight != ratio).float(), mask)
    if unified_mask:
        outside = ((advantages > 0) & (ratio > 1.0 + clip_high)) | (
            (advantages < 0) & (ratio < 1.0 - clip_low)
        )
        metrics["masked_frac"] = masked_float_metric(outside.float(), mask)
        loss = loss * (~outside).to(loss.dtype)
    return loss * mask, metrics


@POLICY_LOSSES.register("tis")
def tis(
    inputs: PolicyLossInputs, *, lower_bound: float = 0.0, upper_bound: float = 1.0
) -> tuple[Tensor, dict]:
    """Truncated importance-sampled policy gradient (IMPALA-style, Espeholt et al., 2018).

    `loss_t = -sg(clip(ratio, lower_bound, upper_bound)) * A_t * logprobs_t`.

    Args:
        inputs: logprobs, old_logprobs, advantages, mask.
        lower_bound: lower truncation of the ratio.
        upper_bound: upper truncation of the ratio.

    Returns:
        (per_token_loss [B, T], metrics incl. clip_frac_high, clip_frac_low).
    """
    if not 0.0 <= lower_bound <= upper_bound:
        raise ValueError(f"need 0 <= lower_bound <= upper_bound, got {lower_bound}, {upper_bound}")
    mask = inputs.mask
    log_ratio = _log_ratio(inputs.logprobs, inputs.old_logprobs, mask)  # [B, T]
    ratio = log_ratio.detach().exp()  # [B, T]
    weight = ratio.clamp(lower_bound, upper_bound)  # [B, T], no gradient
    loss = -weight * inputs.advantages * _trained(inputs.logprobs, mask) * mask  # [B, T]
    metrics = _ratio_metrics(log_ratio, mask)
    metrics["clip_frac_high"] = masked_float_metric((ratio > upper_bound).float(), mask)
    metrics["clip_frac_low"] = masked_float_metric((ratio < lower_bound).float(), mask)
    return loss, metrics


@POLICY_LOSSES.register("topr")
def topr(
    inputs: PolicyLossInputs, *, positive_weight: float = 1.0, negative_weight: float = 1.0
) -> tuple[Tensor, dict]:
    """TOPR, tapered off-policy REINFORCE (Le Roux et al., 2025).

    Samples with reward > 0: `loss_t = -positive_weight * A_t * logprobs_t` (no importance weight).
    Samples with reward <= 0: `loss_t = -negative_weight * sg(clip(ratio, 0, 1)) * A_t * logprobs_t`.

    Args:
        inputs: logprobs, old_logprobs, advantages, mask, rewards.
        positive_weight: weight of the positive-reward samples.
        negative_weight: weight of the other samples.

    Returns:
        (per_token_loss [B, T], metrics incl. positive_frac (of samples) and negative_clip_frac).
    """
    rewards = _require_rewards(inputs, "topr")
    mask = inputs.mask
    log_ratio = _log_ratio(inputs.logprobs, inputs.old_logprobs, mask)  # [B, T]
    ratio = log_ratio.detach().exp()  # [B, T]
    positive = (rewards > 0).unsqueeze(1)  # [B, 1]
    weight = torch.where(positive, positive_weight, negative_weight * ratio.clamp(0.0, 1.0))  # [B, T]
    loss = -weight * inputs.advantages * _trained(inputs.logprobs, mask) * mask  # [B, T]
    negative_mask = mask * (~positive).to(mask.dtype)  # [B, T]
    metrics = _ratio_metrics(log_ratio, mask)
    metrics["positive_frac"] = float((rewards > 0).float().mean()) if rewards.numel() else 0.0
    metrics["negative_clip_frac"] = masked_float_metric((ratio > 1.0).float(), negative_mask)
    return loss, metrics


@POLICY_LOSSES.register("raft_pp")
def raft_pp(
    inputs: PolicyLossInputs, *, clip_low: float = 0.2, clip_high: float = 0.2
) -> tuple[Tensor, dict]:
    """RAFT++ (Xiong et al., 2025, "A Minimalist Approach to LLM Reasoning").

    Rejection-sampling fine-tuning with PPO's clipped importance ratio: only samples with reward > 0 are
    trained, each token with advantage 1, `loss_t = -min(ratio, clip(ratio, 1 - clip_low, 1 + clip_high))`.
    `inputs.advantages` is not used, as in the paper.

    Args:
        inputs: logprobs, old_logprobs, mask, rewards.
        clip_low: epsilon below 1.
        clip_high: epsilon above 1.

    Returns:
        (per_token_loss [B, T], metrics incl. kept_frac (of samples) and clip_frac).
    """
    _check_clip(clip_low, clip_high)
    rewards = _require_rewards(inputs, "raft_pp")
    keep = (rewards > 0).unsqueeze(1).to(inputs.mask.dtype)  # [B, 1]
    mask = inputs.mask * keep  # [B, T]
    log_ratio = _log_ratio(inputs.logprobs, inputs.old_logprobs, mask)  # [B, T]
    ratio = log_ratio.exp()  # [B, T]
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [B, T]
    loss = -torch.minimum(ratio, clipped) * mask  # [B, T]
    metrics = _ratio_metrics(log_ratio, mask)
    metrics["kept_frac"] = float(keep.mean()) if rewards.numel() else 0.0
    metrics["clip_frac"] = masked_float_metric((clipped < ratio).float(), mask)
    return loss, metrics


@POLICY_LOSSES.register("kimi15")
def kimi15(inputs: PolicyLossInputs, *, tau: float = 0.1) -> tuple[Tensor, dict]:
    """Kimi k1.5 online mirror descent surrogate (Kimi Team, 2025).

    `loss_t = -A_t * logprobs_t + tau / 2 * (logprobs_t - old_logprobs_t)^2`: a policy gradient with a
    squared log-ratio penalty that keeps the policy near the old one.

    Args:
        inputs: logprobs, old_logprobs, advantages, mask.
        tau: strength of the penalty.

    Returns:
        (per_token_loss [B, T], metrics incl. penalty_mean).
    """
    mask = inputs.mask
    log_ratio = _log_ratio(inputs.logprobs, inputs.old_logprobs, mask)  # [B, T]
    penalty = 0.5 * tau * log_ratio**2  # [B, T]
    loss = (-inputs.advantages * _trained(inputs.logprobs, mask) + penalty) * mask  # [B, T]
    metrics = _ratio_metrics(log_ratio, mask)
    metrics["penalty_mean"] = masked_float_metric(penalty, mask)
    return loss, metrics


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution at each position, for an entropy bonus.

    `H = logsumexp(z) - sum_v softmax(z)_v z_v`, computed in float32 at least.

    Args:
        logits: [B, T, V].

    Returns:
        [B, T] entropy in nats (subtract `coef * aggregate(H)` from the loss for a bonus).
    """
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    probs = torch.softmax(logits, dim=-1)  # [B, T, V]
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)  # [B, T]
