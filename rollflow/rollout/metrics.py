"""Per-step rollout metrics: reward, accuracy, lengths, status counts, per-reward means."""

from __future__ import annotations

import statistics

from rollflow.data.sample import Sample, SampleStatus


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
