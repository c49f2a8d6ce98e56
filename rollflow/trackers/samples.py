"""`samples.jsonl`: a few decoded samples per step, for reading what the model actually wrote."""

from __future__ import annotations

import json
from pathlib import Path

from rollflow.data.sample import Sample


def write_samples(path: Path, step: int, samples: list[Sample], count: int) -> None:
    """Append the first `count` decoded samples of this step to `samples.jsonl`."""
    with path.open("a") as out:
        for sample in samples[:count]:
            out.write(json.dumps({
                "step": step, "group": sample.group_id, "prompt": sample.prompt_text,
                "response": sample.response_text, "reward": sample.reward, "rewards": sample.rewards,
                "status": sample.status.value, "answer": sample.row.get("answer"),
            }) + "\n")
