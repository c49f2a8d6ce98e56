"""Per-step rollout metrics: reward, accuracy, lengths, status counts, per-reward and per-domain means."""

from __future__ import annotations

import statistics

from rollflow.data.sample import Sample, SampleStatus


def rollout_metrics(samples: list[Sample], prefix: str = "rollout") -> dict[str, float]:
    """Reward, accuracy (primary reward == 1), lengths, status counts, per-reward and per-domain means.

    `{prefix}/reward/NAME` is reward NAME's mean over the samples of the domains that use it (every sample,
    in a run of one domain). Samples of named domains (`Sample.domain` other than "default": a
    `data.domains` run, or a dataset with a `domain` column) also give, per domain D, `{prefix}/D/samples`,
    `{prefix}/D/accuracy` and `{prefix}/D/reward_mean`, and for the rollout `reward/D`, the mean training
    reward of D's samples. The overall figures pool every sample, whatever its domain.
    """
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
        users = {s.domain for s in samples if name in s.rewards}  # a domain's rewards may be its own
        metrics[f"{prefix}/reward/{name}"] = statistics.fmean(
            s.rewards.get(name, 0.0) for s in samples if s.domain in users)
    by_domain: dict[str, list[Sample]] = {}
    for sample in samples:
        by_domain.setdefault(sample.domain, []).append(sample)
    if set(by_domain) != {"default"}:
        for domain in sorted(by_domain):
            metrics.update(_domain_metrics(domain, by_domain[domain], prefix))
    if prefix == "rollout":  # after the domains': the overall figures win over a domain called `mean`
        metrics["reward/mean"] = metrics[f"{prefix}/reward_mean"]
        metrics["reward/std"] = statistics.pstdev(rewards)
    return metrics


def _domain_metrics(domain: str, samples: list[Sample], prefix: str) -> dict[str, float]:
    """One domain's sample count, accuracy and mean reward (and `reward/DOMAIN` for the rollout)."""
    reward = statistics.fmean(s.reward for s in samples)
    metrics = {f"{prefix}/{domain}/samples": float(len(samples)),
               f"{prefix}/{domain}/accuracy": statistics.fmean(is_correct(s) for s in samples),
               f"{prefix}/{domain}/reward_mean": reward}
    if prefix == "rollout":
        metrics[f"reward/{domain}"] = reward
    return metrics


def is_correct(sample: Sample) -> bool:
    """A sample is correct when its first (primary) reward function scores it 1."""
    if sample.status == SampleStatus.FAILED or not sample.rewards:
        return False
    return next(iter(sample.rewards.values())) >= 1.0 - 1e-6
