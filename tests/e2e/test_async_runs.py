"""Asynchronous training end to end: the CLI on examples/async.yaml (disaggregated, max_staleness 1),
interrupted by its end and resumed with prompts in flight."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

FAST = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "train.train_micro_batch_size=16",
        "data.eval.limit=16", "eval.every_steps=0", "output.trackers=[jsonl]"]


def _train(*overrides: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "rollflow.cli", "train", "examples/async.yaml", *FAST, *overrides],
                            capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_an_asynchronous_run_stays_within_its_staleness_and_resumes_with_prompts_in_flight(tmp_path):
    common = ["name=run", f"output.dir={tmp_path}"]
    _train("train.steps=4", *common)
    resumed = _train("train.steps=6", "resume=true", *common)
    assert "generated again" in resumed.stdout  # the producer ran ahead: the next step's prompts were drawn
    rows = [json.loads(line) for line in (Path(tmp_path) / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(7))  # no step lost, none twice
    steps = rows[1:]
    assert all(r["staleness/max"] <= 1 for r in steps)
    assert any(r["staleness/max"] == 1 for r in steps)  # it did generate ahead of the trainer
    assert all(r["rollout/groups/consumed"] == 4 for r in steps)
    assert all("actor/train_infer_ratio_mean" in r for r in steps)  # TIS on by default when asynchronous
