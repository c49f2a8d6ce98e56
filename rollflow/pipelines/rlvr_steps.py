"""The pieces of an RLVR step that the driver loop calls by name: advantages, checks, metrics, logging.

Kept out of `rlvr.py` so the loop reads top to bottom without tensor code.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from rollflow.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs
from rollflow.config import AlgorithmConfig
from rollflow.data.sample import Batch, Sample, SampleStatus
from rollflow.errors import ParityError


def compute_advantages(batch: Batch, algorithm: AlgorithmConfig) -> dict[str, float]:
    """Fill `batch.extras["advantages"]` [B, T] with the configured estimator; returns its metrics."""
    estimator = ADVANTAGE_ESTIMATORS.get(algorithm.advantage)
    inputs = AdvantageInputs(
        rewards=batch.rewards,
        mask=batch.response_mask,
        group_ids=batch.group_ids,
        values=batch.extras.get("values"),
        logprobs=batch.extras.get("old_logprobs"),
        teacher_logprobs=batch.extras.get("teacher_logprobs"),
    )
    advantages, returns, metrics = estimator(inputs, **algorithm.advantage_kwargs)
    batch.extras["advantages"] = advantages
    batch.extras["returns"] = returns
    return {f"advantage/{k}": float(v) for k, v in metrics.items()}


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
    for name in samples[0].rewards:
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
