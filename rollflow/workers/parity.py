"""The step-0 check that the trainer and the inference engines run the same model: the trainer's logprobs of
the tokens an engine sampled must match the engine's own."""

from __future__ import annotations

import torch

from rollflow.data.sample import Batch, Sample
from rollflow.errors import ParityError


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


def parity_probe(samples: list[Sample], count: int) -> list[int]:
    """Row indices of up to `count` samples per inference-engine worker, so the check covers every engine."""
    taken: dict[int, int] = {}
    rows = []
    for row, sample in enumerate(samples):
        worker = sample.metadata.get("worker", 0)
        if taken.get(worker, 0) < count:
            taken[worker] = taken.get(worker, 0) + 1
            rows.append(row)
    return rows
