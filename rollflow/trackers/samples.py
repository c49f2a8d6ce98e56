"""`samples.jsonl`: a few decoded samples per step, for reading what the model actually wrote."""

from __future__ import annotations

from pathlib import Path

from rollflow.data.sample import Sample
from rollflow.trackers.durable_files import append_records


def write_samples(path: Path, step: int, samples: list[Sample], count: int) -> None:
    """Append the first `count` decoded samples of this step to `samples.jsonl`, all in one write (a crash
    leaves all of a step's samples or none).

    Raises:
        DiskFullError: the disk filled up.
    """
    append_records(path, [{
        "step": step, "group": sample.group_id, "prompt": sample.prompt_text,
        "response": sample.response_text, "reward": sample.reward, "rewards": sample.rewards,
        "status": sample.status.value, "answer": sample.row.get("answer"),
        **({"error": sample.metadata["error"]} if "error" in sample.metadata else {}),  # why it failed
    } for sample in samples[:count]])
