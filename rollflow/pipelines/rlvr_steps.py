"""The pieces of an RLVR step that the driver loop calls by name: advantages, checks, metrics, logging.

Kept out of `rlvr.py` so the loop reads top to bottom without tensor code.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from rollflow.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdaptiveKLController,
    AdvantageInputs,
    FixedKLController,
    RunningMoments,
    clip_advantages,
    clip_rewards,
    difficulty_mask,
    kl_penalty,
    normalize_rewards,
    overlong_filter_mask,
    overlong_reward_penalty,
    whiten,
)
from rollflow.config import AlgorithmConfig, DataConfig, DatasetConfig, RewardConfig, RoleConfig
from rollflow.data.prompts import Row, load_rows
from rollflow.data.sample import Batch, Sample, SampleStatus
from rollflow.errors import ConfigError, ParityError
from rollflow.rewards import CombinedReward, ModelReward, combine_rewards, resolve_reward


def load_dataset(dataset: DatasetConfig, data: DataConfig, seed: int) -> list[Row]:
    """Rows of one configured dataset (train or eval), with the config's column names."""
    return load_rows(dataset.task, dataset.path, dataset.split, seed, dataset.limit, data.prompt_key,
                     data.answer_key)


def build_reward_fn(reward: RewardConfig, role: RoleConfig | None = None, device: str = "cpu") -> CombinedReward:
    """The weighted sum of the configured reward functions: `(completion, **row) -> (total, parts)`.

    Plain functions run on the driver. Each model reward (`llm_judge`, `http_judge`, `reward_model`) gets its
    own `role.num_workers` reward workers, started on first use (or by `.start()`) and ended by `.close()`.

    Args:
        reward: the `reward` config section.
        role: `roles.reward` (workers per model reward, their CPU share, their devices); default one worker.
        device: `cluster.device`; on "gpu" a reward role with a `device_mapping` runs its models on CUDA,
            the mapping split evenly over the workers (single node: indices are the node's GPUs).
    """
    from rollflow.workers.reward import RemoteReward

    role = role or RoleConfig()
    on_gpu = device == "gpu" and role.device_mapping is not None
    gpus = None
    if on_gpu:  # each worker sees its share of the role's GPUs; like other roles it reserves no Ray resources
        mapping, workers = role.device_mapping, role.num_workers
        if len(mapping) % workers:
            raise ConfigError(f"roles.reward.device_mapping lists {len(mapping)} devices for num_workers="
                              f"{workers}; give a multiple of {workers} devices")
        share = len(mapping) // workers
        gpus = [tuple(mapping[i * share:(i + 1) * share]) for i in range(workers)]
    rewards = []
    for function in reward.functions:
        fn = resolve_reward(function.name, function.kwargs)
        if isinstance(fn, ModelReward):
            fn = RemoteReward(function.name, fn, role.num_workers, role.num_cpus, "cuda" if on_gpu else "cpu",
                              gpus)
        rewards.append((function.name, fn, function.weight))
    return combine_rewards(rewards)


def drop_groups(batch: Batch, algorithm: AlgorithmConfig) -> tuple[Batch, dict[str, float]]:
    """Difficulty mask: keep only the groups whose mean reward lies strictly inside `difficulty_mask`.

    The dropped rows are removed (not just masked), so they cost no forward pass and do not enter batch
    statistics (batch std, whitening). Returns the batch unchanged when the mask is off; the kept batch
    may be empty.
    """
    if algorithm.difficulty_mask is None:
        return batch, {}
    low, high = algorithm.difficulty_mask
    keep = difficulty_mask(batch.rewards, batch.group_ids, low, high)  # [B] bool
    kept = batch.select(keep.nonzero().squeeze(1))
    groups = int(batch.group_ids.unique().numel())
    kept_groups = int(kept.group_ids.unique().numel())
    return kept, {"difficulty_mask/kept_samples": float(kept.size),
                  "difficulty_mask/kept_group_frac": kept_groups / max(groups, 1)}


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
            rewards = normalize_rewards(rewards, batch.group_ids, algorithm.reward_norm_mean,
                                        algorithm.reward_norm_std, self.reward_moments)  # [B]
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
        """What a checkpoint keeps: running reward moments and the KL coefficient (JSON-serializable)."""
        return {"reward_moments": dict(vars(self.reward_moments)), "kl_coef": self.kl_controller.value}

    def load_state(self, state: dict | None) -> None:
        """Restore what `state` returned (None: a checkpoint from before the stage kept state)."""
        if state is None:
            return
        vars(self.reward_moments).update(state["reward_moments"])
        self.kl_controller.value = state["kl_coef"]


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float((values * mask).sum() / mask.sum().clamp(min=1.0))


def check_logprob_parity(batch: Batch, trainer_logprobs: torch.Tensor, tolerance: float) -> float:
    """Max |trainer - engine| logprob over the batch's response tokens; raises `ParityError` past tolerance.

    A large gap means the trainer and the engine do not run the same model (wrong weights, a different
    chat template or tokenizer, a broken sync), and every importance ratio after it would be wrong.
    """
    mask = batch.response_mask > 0  # [B, T]
    gap = float((trainer_logprobs - batch.rollout_logprobs).abs()[mask].max()) if mask.any() else 0.0
    if gap > tolerance:
        raise ParityError(
            f"step-0 logprob check failed: trainer and inference engine differ by up to {gap:.4g} "
            f"(tolerance checks.logprob_parity_tolerance={tolerance}); they are not running the same model"
        )
    return gap


def usable(samples: list[Sample]) -> list[Sample]:
    """Samples that can be trained on: not failed or aborted, with at least one response token."""
    bad = (SampleStatus.FAILED, SampleStatus.ABORTED, SampleStatus.FILTERED)
    return [s for s in samples if s.status not in bad and s.response_ids]


def rollout_metrics(samples: list[Sample], prefix: str = "rollout") -> dict[str, float]:
    """Reward, accuracy (primary reward == 1), lengths, status counts and per-reward means."""
    if not samples:
        return {f"{prefix}/samples": 0.0}
    rewards = [s.reward for s in samples]
    metrics = {
        f"{prefix}/samples": float(len(samples)),
        f"{prefix}/accuracy": statistics.fmean(is_correct(s) for s in samples),
        f"{prefix}/response_length": statistics.fmean(len(s.response_ids) for s in samples),
        f"{prefix}/truncated_ratio": statistics.fmean(s.status == SampleStatus.TRUNCATED for s in samples),
        f"{prefix}/failed_ratio": statistics.fmean(s.status == SampleStatus.FAILED for s in samples),
        f"{prefix}/reward_mean": statistics.fmean(rewards),
    }
    names = sorted({name for s in samples for name in s.rewards})  # a failed first sample has none
    for name in names:
        metrics[f"{prefix}/reward/{name}"] = statistics.fmean(s.rewards.get(name, 0.0) for s in samples)
    if prefix == "rollout":
        metrics["reward/mean"] = metrics[f"{prefix}/reward_mean"]
        metrics["reward/std"] = statistics.pstdev(rewards)
    return metrics


def is_correct(sample: Sample) -> bool:
    """A sample is correct when its first (primary) reward function scores it 1."""
    if sample.status == SampleStatus.FAILED or not sample.rewards:
        return False
    return next(iter(sample.rewards.values())) >= 1.0 - 1e-6


def write_samples(path: Path, step: int, samples: list[Sample], count: int) -> None:
    """Append the first `count` decoded samples of this step to `samples.jsonl`."""
    with path.open("a") as out:
        for sample in samples[:count]:
            out.write(json.dumps({
                "step": step, "group": sample.group_id, "prompt": sample.prompt_text,
                "response": sample.response_text, "reward": sample.reward, "rewards": sample.rewards,
                "status": sample.status.value, "answer": sample.row.get("answer"),
            }) + "\n")
