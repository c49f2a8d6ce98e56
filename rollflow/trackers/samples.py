"""`samples.jsonl`: a few decoded samples per step, for reading what the model actually wrote; and
`eval_samples.jsonl`: every greedy eval sample of each eval, in the same records."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rollflow.data.sample import Sample
from rollflow.trackers.durable_files import append_records


def write_samples(path: Path, step: int, samples: list[Sample], count: int, columns: Sequence[str] = ()) -> None:
    """Append the first `count` decoded samples of this step to `path` (`samples.jsonl`,
    `eval_samples.jsonl`), all in one write (a crash leaves all of a step's samples or none).

    Each record: `step`, `group`, `prompt`, `response`, `reward` (the weighted total), `rewards` (each
    function's), `status`, `answer`, `error` (a failed sample's reason), and with `columns` a `columns` dict of
    those dataset columns' values (`eval.group_by`).

    Raises:
        DiskFullError: the disk filled up.
    """
    append_records(path, [{
        "step": step, "group": sample.group_id, "prompt": sample.prompt_text,
        "response": sample.response_text, "reward": sample.reward, "rewards": sample.rewards,
        "status": sample.status.value, "answer": sample.row.get("answer"),
        **({"error": sample.metadata["error"]} if "error" in sample.metadata else {}),  # why it failed
        **({"columns": {column: sample.row.get(column) for column in columns}} if columns else {}),
    } for sample in samples[:count]])
