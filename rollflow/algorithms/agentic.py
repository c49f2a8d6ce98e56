"""Agentic (multi-turn) RL: advantages over episodes and steps, registered in `AGENTIC_ADVANTAGES`, and
the turn-level IPA loss, registered in `POLICY_LOSSES` as `ipa_chunk`.

An env group is the G episodes (trajectories) rolled out from one env seed; `group_ids` marks them. The
rollout yields either trajectory-wise rows (one row per episode, all turns concatenated) or step-wise rows
(one row per turn). The driver computes advantages from per-episode / per-step scalars before collate, so
the estimators take flat 1-D tensors: N rows, or S rows when a row is a step. Every registered estimator
has the signature

    fn(inputs: AgenticAdvantageInputs, *, **options) -> (advantages [S], metrics: dict[str, float])

Group statistics over episodes are taken over DISTINCT episodes (`episode_ids`), so a return repeated on
each step of an episode counts once, whatever the episode's length. Standard deviations are unbiased
(n - 1), as in the `grpo` estimator (and `torch.std` in verl, verl-agent and RAGEN); a group of one has
std 0 and advantage 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rollflow.algorithms.policy_losses import (
    LOG_RATIO_LIMIT,
    PolicyLossInputs,
    _check_clip,
    _log_ratio,
    _ratio_metrics,
    _trained,
)
from rollflow.algorithms.reductions import (
    group_count,
    group_index,
    group_mean,
    group_std,
    masked_float_metric,
)
from rollflow.algorithms.registries import AGENTIC_ADVANTAGES, POLICY_LOSSES

STEP_BASELINES = ("group_mean", "none")


@dataclass
class AgenticAdvantageInputs:
    """What an agentic advantage estimator may read; one entry per row (episode or step).

    Attributes:
        episode_returns: [S] the return of the episode the row belongs to (repeated over its steps).
        group_ids: [S] long, the env group (episodes from one env seed).
        episode_ids: [S] long, unique per episode in the batch; equal on the steps of one episode.
        anchor_ids: [S] long, equal for steps that observed the same state (gigpo), or None.
        step_returns: [S] discounted return from each step, `discounted_step_returns` (gigpo,
            step_reinforce), or None.
    """

    episode_returns: Tensor
    group_ids: Tensor
    episode_ids: Tensor
    anchor_ids: Tensor | None = None
    step_returns: Tensor | None = None


def _require(value: Tensor | None, field: str, estimator: str) -> Tensor:
    if value is None:
        raise ValueError(f"agentic advantage estimator {estimator!r} needs AgenticAdvantageInputs.{field}")
    return value


def episode_group_advantages(
    returns: Tensor, group_ids: Tensor, *, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """StarPO trajectory-level GRPO (Wang et al., 2025, RAGEN): `A = (R - mean_g) / (std_g + eps)`.

    The std is unbiased (n - 1), as in `grpo`. With `normalize_std=False`, `A = R - mean_g`: REINFORCE with
    the group mean as baseline. A group of one episode gets advantage 0.

    Args:
        returns: [N] one return per episode.
        group_ids: [N] long, the env group of each episode.
        normalize_std: divide by the group std.
        eps: added to the std.

    Returns:
        [N] advantages.
    """
    returns = returns.float() if not returns.is_floating_point() else returns
    centered = returns - group_mean(returns, group_ids)  # [N]
    if not normalize_std:
        return centered
    return centered / (group_std(returns, group_ids, unbiased=True) + eps)  # [N]


def _per_episode(values: Tensor, episode_index: Tensor, num_episodes: int, name: str) -> Tensor:
    """The one value each episode holds on all its rows: [S] -> [E]; an episode with two values is an error."""
    per_episode = torch.zeros(num_episodes, dtype=values.dtype, device=values.device)
    per_episode = per_episode.scatter(0, episode_index, values)  # [E], one of each episode's rows
    if not torch.equal(per_episode[episode_index], values):  # exact, in the values' own dtype
        raise ValueError(f"{name} differs between the rows of one episode (episode_ids)")
    return per_episode


def episode_advantages_per_row(
    episode_returns: Tensor,
    group_ids: Tensor,
    episode_ids: Tensor,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor, Tensor]:
    """`episode_group_advantages` over the distinct episodes, broadcast back to every row (step) of each.

    Args:
        episode_returns: [S] the episode's return, repeated on its rows.
        group_ids: [S] long, the env group.
        episode_ids: [S] long, equal on the rows of one episode.
        normalize_std: divide by the group std.
        eps: added to the std.

    Returns:
        (advantages [S], per-episode returns [E], per-episode group ids [E]).

    Raises:
        ValueError: when the rows of one episode disagree on its return or group.
    """
    episode_index, num_episodes = group_index(episode_ids)  # [S], E
    returns = _per_episode(episode_returns, episode_index, num_episodes, "episode_returns")  # [E]
    groups = _per_episode(group_ids, episode_index, num_episodes, "group_ids")  # [E]
    advantages = episode_group_advantages(returns, groups, normalize_std=normalize_std, eps=eps)  # [E]
    return advantages[episode_index], returns, groups  # [S], [E], [E]


def discounted_step_returns(
    step_rewards: Tensor, episode_ids: Tensor, step_index: Tensor, gamma: float
) -> Tensor:
    """`G_t = sum_{k >= t} gamma^(k - t) r_k` over the steps of the same episode.

    Steps may come in any order. `k` is the step index: a missing index inside an episode (a dropped step)
    counts as a step with reward 0, so the discount follows the turn count.

    Args:
        step_rewards: [S] reward of each step.
        episode_ids: [S] long, equal for the steps of one episode.
        step_index: [S] long, 0-based turn index of each step within its episode; unique per episode.
        gamma: discount per step.

    Returns:
        [S] discounted returns, in the input order.

    Raises:
        ValueError: on a negative or repeated (episode, step_index).
    """
    if step_rewards.numel() == 0:
        return step_rewards.clone()
    if bool((step_index < 0).any()):
        raise ValueError("step_index must be >= 0")
    episode_index, num_episodes = group_index(episode_ids)  # [S], E
    num_steps = int(step_index.max()) + 1  # L, the longest episode
    slot = episode_index * num_steps + step_index  # [S], position in the [E, L] table
    occupied = torch.zeros(num_episodes * num_steps, dtype=torch.long, device=slot.device)
    occupied.index_add_(0, slot, torch.ones_like(slot))  # [E * L]
    if bool((occupied > 1).any()):
        raise ValueError("two steps of one episode share a step_index")
    dtype = step_rewards.dtype if step_rewards.is_floating_point() else torch.float32
    rewards = torch.zeros(num_episodes * num_steps, dtype=dtype, device=step_rewards.device)
    rewards = rewards.scatter(0, slot, step_rewards.to(dtype)).view(num_episodes, num_steps)  # [E, L]
    returns = torch.zeros_like(rewards)  # [E, L]
    running = torch.zeros_like(rewards[:, 0])  # [E]
    for t in reversed(range(num_steps)):  # L is the number of turns: short
        running = rewards[:, t] + gamma * running  # [E]
        returns[:, t] = running
    return returns.view(-1)[slot]  # [S]


def gigpo_advantages(
    episode_returns: Tensor,
    group_ids: Tensor,
    episode_ids: Tensor,
    anchor_ids: Tensor,
    step_returns: Tensor,
    *,
    step_weight: float = 1.0,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, dict[str, float]]:
    """GiGPO (Feng et al., 2025, "Group-in-Group Policy Optimization for LLM Agent Training").

    `A = A_episode + step_weight * A_step`, per step row:

    * `A_episode`: `episode_group_advantages` of the episode's return over the distinct episodes of the env
      group (a long episode counts once, not once per step).
    * `A_step`: the step's discounted return normalized within its anchor-state group, the steps sharing
      `(group_id, anchor_id)`: `(G - mean) / (std + eps)`, or `G - mean` without `normalize_std`. An
      anchor group of one step gets 0.

    Args:
        episode_returns: [S] the return of each step's episode, repeated over its steps.
        group_ids: [S] long, the env group.
        episode_ids: [S] long, equal on the steps of one episode.
        anchor_ids: [S] long, equal for steps that observed the same state (e.g. a hash of the observation).
        step_returns: [S] discounted return from each step (`discounted_step_returns`).
        step_weight: weight of the step-level advantage (omega in the paper).
        normalize_std: divide by the std at both levels (False: mean-centering only).
        eps: added to the stds.

    Returns:
        (advantages [S], metrics: anchor_group_nontrivial_frac (fraction of steps whose anchor group has more
        than one step), anchor_group_size_mean (mean size over anchor groups)).
    """
    episode_advantages, _, _ = episode_advantages_per_row(
        episode_returns, group_ids, episode_ids, normalize_std=normalize_std, eps=eps
    )  # [S]
    step_keys = torch.stack([group_ids.long(), anchor_ids.long()], dim=1)  # [S, 2]
    _, anchor_group = torch.unique(step_keys, dim=0, return_inverse=True)  # [S] dense anchor-group id
    returns = step_returns.float() if not step_returns.is_floating_point() else step_returns
    step_advantages = returns - group_mean(returns, anchor_group)  # [S], 0 for a group of one
    if normalize_std:
        step_advantages = step_advantages / (group_std(returns, anchor_group, unbiased=True) + eps)  # [S]
    advantages = episode_advantages + step_weight * step_advantages  # [S]
    sizes = group_count(anchor_group)  # [S], size of each step's anchor group
    metrics = {
        "anchor_group_nontrivial_frac": float((sizes > 1).float().mean()) if sizes.numel() else 0.0,
        # Each group contributes 1/size per member, so the sum counts groups.
        "anchor_group_size_mean": float(sizes.numel() / (1.0 / sizes).sum()) if sizes.numel() else 0.0,
    }
    return advantages, metrics


def step_reinforce_advantages(
    step_returns: Tensor, group_ids: Tensor, *, baseline: str = "group_mean"
) -> Tensor:
    """Step-level REINFORCE: each step's discounted return minus a baseline.

    Args:
        step_returns: [S] discounted return from each step.
        group_ids: [S] long, the env group.
        baseline: "group_mean" (mean step return over all steps of the env group) or "none".

    Returns:
        [S] advantages.
    """
    returns = step_returns.float() if not step_returns.is_floating_point() else step_returns
    if baseline == "group_mean":
        return returns - group_mean(returns, group_ids)  # [S]
    if baseline == "none":
        return returns.clone()
    raise ValueError(f"unknown baseline {baseline!r}; valid: {', '.join(STEP_BASELINES)}")


def _advantage_metrics(advantages: Tensor) -> dict[str, float]:
    if advantages.numel() == 0:
        return {"advantages_mean": 0.0, "advantages_max": 0.0, "advantages_min": 0.0}
    advantages = advantages.detach().float()
    return {
        "advantages_mean": float(advantages.mean()),
        "advantages_max": float(advantages.max()),
        "advantages_min": float(advantages.min()),
    }


@AGENTIC_ADVANTAGES.register("starpo")
def starpo(
    inputs: AgenticAdvantageInputs, *, normalize_std: bool = True, eps: float = 1e-6
) -> tuple[Tensor, dict[str, float]]:
    """StarPO (Wang et al., 2025, RAGEN): trajectory-level GRPO over the episodes of each env group.

    Every row gets its episode's advantage (`episode_group_advantages` over distinct episodes), so it serves
    trajectory-wise rows and step-wise rows alike. `normalize_std=False` is REINFORCE with the group-mean
    baseline.

    Args:
        inputs: needs episode_returns, group_ids, episode_ids.
        normalize_std: divide by the group std of the episode returns.
        eps: added to the std.

    Returns:
        (advantages [S], metrics incl. zero_std_group_frac: fraction of env groups whose episodes all have
        the same return, i.e. no learning signal).
    """
    advantages, returns, groups = episode_advantages_per_row(
        inputs.episode_returns, inputs.group_ids, inputs.episode_ids, normalize_std=normalize_std, eps=eps
    )
    metrics = _advantage_metrics(advantages)
    metrics["zero_std_group_frac"] = 0.0
    if returns.numel():  # count episodes with weight 1 / group size, so each group counts once
        flat = (group_std(returns.float(), groups) < 1e-6).float()  # [E], per episode
        inverse_size = 1.0 / group_count(groups)  # [E]
        metrics["zero_std_group_frac"] = float((flat * inverse_size).sum() / inverse_size.sum())
    return advantages, metrics


@AGENTIC_ADVANTAGES.register("gigpo")
def gigpo(
    inputs: AgenticAdvantageInputs, *, step_weight: float = 1.0, normalize_std: bool = True, eps: float = 1e-6
) -> tuple[Tensor, dict[str, float]]:
    """GiGPO (Feng et al., 2025): episode-level group advantage plus anchor-state step advantage.

    See `gigpo_advantages`; rows are steps.

    Args:
        inputs: needs episode_returns, group_ids, episode_ids, anchor_ids, step_returns.
        step_weight: weight of the step-level advantage.
        normalize_std: divide by the std at both levels.
        eps: added to the stds.

    Returns:
        (advantages [S], metrics incl. anchor_group_nontrivial_frac and anchor_group_size_mean).
    """
    advantages, metrics = gigpo_advantages(
        inputs.episode_returns,
        inputs.group_ids,
        inputs.episode_ids,
        _require(inputs.anchor_ids, "anchor_ids", "gigpo"),
        _require(inputs.step_returns, "step_returns", "gigpo"),
        step_weight=step_weight,
        normalize_std=normalize_std,
        eps=eps,
    )
    return advantages, {**_advantage_metrics(advantages), **metrics}


@AGENTIC_ADVANTAGES.register("step_reinforce")
def step_reinforce(
    inputs: AgenticAdvantageInputs, *, baseline: str = "group_mean"
) -> tuple[Tensor, dict[str, float]]:
    """Step-level REINFORCE: `A = G_t - baseline`, see `step_reinforce_advantages`; rows are steps.

    Args:
        inputs: needs group_ids, step_returns.
        baseline: "group_mean" or "none".

    Returns:
        (advantages [S], metrics).
    """
    step_returns = _require(inputs.step_returns, "step_returns", "step_reinforce")
    advantages = step_reinforce_advantages(step_returns, inputs.group_ids, baseline=baseline)
    return advantages, _advantage_metrics(advantages)



@POLICY_LOSSES.register("ipa_chunk")
def ipa_chunk(
    inputs: PolicyLossInputs, *, clip_low: float = 0.2, clip_high: float = 0.2
) -> tuple[Tensor, dict]:
    """Turn-level (chunk) importance ratio with PPO clipping: GSPO's sequence ratio taken per turn, after the
    chunk-level credit of IPA (Interaction-Perceptive Agentic Policy Optimization; Wang et al., 2025,
    "Let It Flow", the ROME report). A simplified form: one ratio and one advantage per turn, no resampling.

    `r_c = exp(mean_{t in c} (logprobs_t - old_logprobs_t))` over the trained tokens of turn c (the geometric
    mean of their token ratios). Per token, `r_ct = sg(r_c) * exp(logprobs_t - sg(logprobs_t))` has the value
    `r_c` and the gradient `r_c * grad logprobs_t`;
    `loss_t = max(-A_t r_ct, -A_t clip(r_ct, 1 - clip_low, 1 + clip_high))`. The advantage is normally
    constant within a turn; if not, each token uses its own value, as `gspo` does. Averaging the loss over
    each turn's tokens gives the gradient `-r_c A_c mean_{t in c} grad logprobs_t` for an unclipped turn and
    0 for a clipped one. With one turn spanning the response this is `gspo`.

    Args:
        inputs: logprobs, old_logprobs, advantages, mask, segment_ids ([B, T] long turn index, -1 off turns;
            every trained token must lie in a turn).
        clip_low: epsilon below 1.
        clip_high: epsilon above 1.

    Returns:
        (per_token_loss [B, T], metrics incl. clip_frac (fraction of turns clipped) and turn_ratio_mean).

    Raises:
        ValueError: without segment_ids, or when a trained token has segment id -1.
    """
    _check_clip(clip_low, clip_high)
    if inputs.segment_ids is None:
        raise ValueError(
            "policy loss 'ipa_chunk' needs PolicyLossInputs.segment_ids ([B, T] turn index, -1 off turns)"
        )
    mask, advantages, segments = inputs.mask, inputs.advantages, inputs.segment_ids.long()
    if segments.shape != mask.shape:
        raise ValueError(f"segment_ids has shape {tuple(segments.shape)}, mask {tuple(mask.shape)}")
    if bool(((mask > 0) & (segments < 0)).any()):
        raise ValueError(
            "ipa_chunk: a trained token (mask > 0) has segment_ids -1; each trained token needs a turn"
        )
    logprobs = _trained(inputs.logprobs, mask)  # [B, T]
    log_ratio = _log_ratio(logprobs, inputs.old_logprobs, mask)  # [B, T]
    turns_per_row = int(segments.max().clamp(min=0)) + 1 if segments.numel() else 1  # K
    rows = torch.arange(mask.shape[0], device=mask.device).unsqueeze(1)  # [B, 1]
    chunk = (rows * turns_per_row + segments.clamp(min=0)).flatten()  # [B*T], untrained tokens carry weight 0
    num_chunks = mask.shape[0] * turns_per_row  # C
    weight = (mask > 0).to(log_ratio.dtype).flatten()  # [B*T]
    sums = torch.zeros(num_chunks, dtype=log_ratio.dtype, device=mask.device)
    sums = sums.index_add(0, chunk, (log_ratio.detach().flatten() * weight))  # [C]
    counts = torch.zeros_like(sums).index_add(0, chunk, weight)  # [C], trained tokens per turn
    chunk_log_ratio = sums / counts.clamp(min=1.0)  # [C], detached
    token_log_ratio = chunk_log_ratio[chunk].view_as(logprobs) + logprobs - logprobs.detach()  # [B, T]
    turn_ratio = token_log_ratio.clamp(max=LOG_RATIO_LIMIT).exp()  # [B, T], value r_c on every token of c
    unclipped = -advantages * turn_ratio  # [B, T]
    clipped = -advantages * turn_ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [B, T]
    loss = torch.maximum(unclipped, clipped) * mask  # [B, T]
    clipped_tokens = ((clipped > unclipped) & (mask > 0)).to(log_ratio.dtype).flatten().detach()  # [B*T]
    turn_clipped = torch.zeros_like(sums).index_add(0, chunk, clipped_tokens) > 0  # [C]
    has_tokens = (counts > 0).to(log_ratio.dtype)  # [C]
    metrics = _ratio_metrics(log_ratio, mask)
    metrics["clip_frac"] = masked_float_metric(turn_clipped.to(log_ratio.dtype), has_tokens)
    metrics["turn_ratio_mean"] = masked_float_metric(chunk_log_ratio.exp(), has_tokens)
    return loss, metrics
