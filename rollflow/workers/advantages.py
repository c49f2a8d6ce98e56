"""The advantage stage of the RL objective: reward shaping, the advantage estimator and advantage
post-processing, in the order of `rollflow.algorithms.reward_shaping` (docs/algorithms.md).

It runs on the driver between the rollout and the actor update, next to the policy loss it feeds
(`rollflow.workers.actor_loss`); the math is in `rollflow.algorithms`.
"""

from __future__ import annotations

import torch

from rollflow.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdaptiveKLController,
    AdvantageInputs,
    FixedKLController,
    RunningMoments,
    clip_advantages,
    clip_rewards,
    kl_penalty,
    normalize_rewards,
    normalize_rewards_by_domain,
    overlong_filter_mask,
    overlong_reward_penalty,
    whiten,
)
from rollflow.config import AlgorithmConfig
from rollflow.data.sample import Batch


class AdvantageStage:
    """Reward shaping, the advantage estimator and advantage post-processing, in the order of
    `rollflow.algorithms.reward_shaping`. Holds what lives across steps: running reward moments and the KL
    coefficient of the reward penalty.

    Reads `batch.rewards`, `response_mask`, `truncated`, `response_lengths` and, when configured,
    `extras["old_logprobs"]` (policy), `extras["ref_logprobs"]` (reference, also the `opd` teacher) and
    `extras["values"]` (critic). Writes `extras["advantages"]` and `extras["returns"]` [B, T] and, with the
    overlong filter, a new `response_mask`.

    Args:
        algorithm: the algorithm config.
        max_response_length: L of the DAPO overlong penalty (`rollout.max_new_tokens`).
    """

    def __init__(self, algorithm: AlgorithmConfig, max_response_length: int):
        self.algorithm = algorithm
        self.max_response_length = max_response_length
        self.estimator = ADVANTAGE_ESTIMATORS.get(algorithm.advantage)
        self.reward_moments = RunningMoments()
        self.domain_reward_moments: dict[str, RunningMoments] = {}  # `reward_norm_by_domain`: per domain name
        if algorithm.kl_reward_controller == "adaptive":
            self.kl_controller = AdaptiveKLController(algorithm.kl_reward_coef, algorithm.kl_reward_target,
                                                      algorithm.kl_reward_horizon)
        else:
            self.kl_controller = FixedKLController(algorithm.kl_reward_coef)

    @property
    def needs_policy_logprobs(self) -> bool:
        """The trainer's logprobs are needed before the estimator: KL in the reward, or `opd`."""
        return self.algorithm.kl_reward_coef > 0 or self.algorithm.advantage == "opd"

    def __call__(self, batch: Batch) -> dict[str, float]:
        """Fill `batch.extras["advantages"]` and `["returns"]` [B, T]; returns the stage's metrics."""
        algorithm, metrics = self.algorithm, {}
        if algorithm.overlong_filter:
            batch.response_mask = overlong_filter_mask(batch.response_mask, batch.truncated)  # [B, T]
            metrics["reward_shaping/overlong_filtered_frac"] = float(batch.truncated.float().mean())
        rewards = batch.rewards  # [B]
        if algorithm.overlong_buffer is not None:
            penalty = overlong_reward_penalty(  # [B]
                batch.response_lengths, self.max_response_length, algorithm.overlong_buffer,
                algorithm.overlong_penalty_factor)
            rewards = rewards + penalty
            metrics["reward_shaping/overlong_penalty_mean"] = float(penalty.mean())
        if (algorithm.reward_norm_mean, algorithm.reward_norm_std) != ("none", "none"):
            rewards = self._normalized(rewards, batch)  # [B]
        rewards = clip_rewards(rewards, algorithm.reward_clip)  # [B]
        if rewards is not batch.rewards:
            metrics["reward_shaping/reward_mean"] = float(rewards.mean())
        inputs = AdvantageInputs(
            rewards=rewards,
            mask=batch.response_mask,
            group_ids=batch.group_ids,
            token_rewards=self._kl_token_rewards(batch, metrics),
            values=batch.extras.get("values"),
            logprobs=batch.extras.get("old_logprobs"),
            teacher_logprobs=batch.extras.get("ref_logprobs"),  # the reference worker is the opd teacher
        )
        advantages, returns, estimator_metrics = self.estimator(inputs, **algorithm.advantage_kwargs)
        metrics.update({f"advantage/{k}": float(v) for k, v in estimator_metrics.items()})
        if algorithm.whiten_advantages:
            advantages = whiten(advantages, batch.response_mask)  # [B, T]
        if algorithm.advantage_clip is not None:
            metrics["advantage/clip_frac"] = _masked_mean(
                (advantages.abs() > algorithm.advantage_clip).float(), batch.response_mask)
            advantages = clip_advantages(advantages, algorithm.advantage_clip)  # [B, T]
        batch.extras["advantages"] = advantages
        batch.extras["returns"] = returns
        return metrics

    def _normalized(self, rewards: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Reward normalization over the batch, or per domain (`reward_norm_by_domain`), whose running
        moments are kept by domain name: a batch's domain ids index only its own `domain_names`."""
        algorithm = self.algorithm
        if not algorithm.reward_norm_by_domain or batch.domain_ids is None:
            return normalize_rewards(rewards, batch.group_ids, algorithm.reward_norm_mean,
                                     algorithm.reward_norm_std, self.reward_moments)  # [B]
        moments = [self.domain_reward_moments.setdefault(name, RunningMoments())
                   for name in batch.domain_names]
        return normalize_rewards_by_domain(rewards, batch.group_ids, batch.domain_ids,  # [B]
                                           algorithm.reward_norm_mean, algorithm.reward_norm_std, moments)

    def _kl_token_rewards(self, batch: Batch, metrics: dict[str, float]) -> torch.Tensor | None:
        """`-beta * KL(policy || reference)` per token [B, T], then the controller's update; None when off."""
        if self.algorithm.kl_reward_coef == 0:
            return None
        mask = batch.response_mask  # [B, T]
        kl = kl_penalty(batch.extras["old_logprobs"], batch.extras["ref_logprobs"],
                        self.algorithm.kl_reward_estimator) * mask  # [B, T]
        beta = self.kl_controller.value
        per_sample = (kl.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0))  # [B] token mean within each sample
        current_kl = float(per_sample.mean())
        self.kl_controller.update(current_kl, n_steps=batch.size)  # horizon counts samples
        metrics.update({"kl_reward/kl": current_kl, "kl_reward/coef": beta})
        return -beta * kl

    def state(self) -> dict:
        """What a checkpoint keeps: running reward moments (overall and per domain) and the KL coefficient
        (JSON-serializable)."""
        return {"reward_moments": dict(vars(self.reward_moments)), "kl_coef": self.kl_controller.value,
                "domain_reward_moments": {name: dict(vars(moments))
                                          for name, moments in self.domain_reward_moments.items()}}

    def load_state(self, state: dict | None) -> None:
        """Restore what `state` returned (None: a checkpoint from before the stage kept state)."""
        if state is None:
            return
        vars(self.reward_moments).update(state["reward_moments"])
        self.kl_controller.value = state["kl_coef"]
        self.domain_reward_moments = {}
        for name, moments in state.get("domain_reward_moments", {}).items():  # absent in older checkpoints
            vars(self.domain_reward_moments.setdefault(name, RunningMoments())).update(moments)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float((values * mask).sum() / mask.sum().clamp(min=1.0))
