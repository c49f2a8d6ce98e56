"""Which samples of a step are trained on: usable samples, and group filters (DAPO's difficulty mask).

A filter marks the samples it drops `SampleStatus.FILTERED` instead of removing them, so the step's
samples log says why a sample was not trained on; `usable` then leaves them out of the batch.
"""

from __future__ import annotations

import torch

from rollflow.algorithms import difficulty_mask
from rollflow.data.sample import Sample, SampleStatus
from rollflow.errors import StepFailedError

UNUSABLE = (SampleStatus.FAILED, SampleStatus.ABORTED, SampleStatus.FILTERED)


def usable(samples: list[Sample]) -> list[Sample]:
    """Samples that can be trained on: not failed, aborted or filtered, with at least one response token."""
    return [s for s in samples if s.status not in UNUSABLE and s.response_ids]


def check_some_succeeded(samples: list[Sample], where: str) -> None:
    """Raise `StepFailedError` when every sample of a step (`where`: "step 3", "eval at step 0") failed, with the first one's error (a reward
    that fails on every row would otherwise train on nothing, step after step)."""
    if samples and all(s.status == SampleStatus.FAILED for s in samples):
        first = (samples[0].metadata.get("error") or "no error recorded").splitlines()[0]
        raise StepFailedError(f"{where}: all {len(samples)} samples failed; the first failed with: {first}")


def failure_warning(samples: list[Sample], where: str) -> str | None:
    """A warning line when some samples of `where` failed (a reward that raises on some rows, say), not all
    (`check_some_succeeded` stops the run then): how many, and the first one's error; None when none failed."""
    failed = [s for s in samples if s.status == SampleStatus.FAILED]
    if not failed:
        return None
    first = (failed[0].metadata.get("error") or "no error recorded").splitlines()[0]
    return f"{where}: {len(failed)} of {len(samples)} samples failed; the first failed with: {first}"


def filter_by_difficulty(samples: list[Sample], bounds: tuple[float, float] | None) -> dict[str, float]:
    """Difficulty mask: mark `FILTERED` every usable sample of a group whose mean reward (over its usable
    samples) is not strictly inside `bounds` = (low, high). Such a group (all right, all wrong) has no
    advantage signal and would only shrink the batch statistics.

    Args:
        samples: the step's samples; changed in place.
        bounds: `algorithm.difficulty_mask`, or None (off: nothing changes).

    Returns:
        Metrics: kept samples and the kept fraction of groups (empty when off).
    """
    if bounds is None:
        return {}
    candidates = usable(samples)
    if not candidates:
        return {"difficulty_mask/kept_samples": 0.0, "difficulty_mask/kept_group_frac": 0.0}
    rewards = torch.tensor([float(s.reward) for s in candidates])  # [B]
    groups = torch.tensor([s.group_id for s in candidates])  # [B]
    keep = difficulty_mask(rewards, groups, *bounds)  # [B] bool
    for sample, kept in zip(candidates, keep.tolist()):
        if not kept:
            sample.status = SampleStatus.FILTERED
            sample.metadata["filtered_by"] = "difficulty_mask"
    kept_groups = {s.group_id for s, kept in zip(candidates, keep.tolist()) if kept}
    return {"difficulty_mask/kept_samples": float(keep.sum()),
            "difficulty_mask/kept_group_frac": len(kept_groups) / len({s.group_id for s in candidates})}
