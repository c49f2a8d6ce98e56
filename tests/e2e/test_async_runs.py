"""Asynchronous training end to end: examples/async.yaml (disaggregated, max_staleness 1, partial rollout
`continue`) in the shared Ray session, its driver killed with `kill -9` while the next step's prompts are in
flight, then resumed: it trains every prompt exactly once, in the steps the uninterrupted run trains them."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollflow.config import load_config
from rollflow.pipelines.rlvr import run_rlvr

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ASYNC = str(REPO / "examples" / "async.yaml")
FAST = ["rollout.groups_per_step=4", "rollout.group_size=4", "train.train_micro_batch_size=16",
        "data.eval.limit=16", "eval.every_steps=0", "output.trackers=[console,jsonl]", "output.save_every_steps=1",
        "train.steps=5", "output.samples_logged_per_step=16"]


def _trained_prompts(run_dir: Path) -> dict[int, collections.Counter]:
    """Step -> the prompts its trained samples came from (`samples.jsonl` holds every sample of a step)."""
    steps: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["status"] in ("finished", "truncated"):
            steps[record["step"]][record["prompt"]] += 1
    return dict(steps)


def test_an_asynchronous_run_killed_with_prompts_in_flight_resumes_to_train_each_prompt_once(ray_session, tmp_path,
                                                                                           capsys):
    run_rlvr(load_config(ASYNC, [*FAST, "name=whole", f"output.dir={tmp_path}"]), manage_ray=False)
    # the command line, killed once its step-2 checkpoint is written (the producer runs a step ahead of it)
    killed = [*FAST, "name=killed", f"output.dir={tmp_path}"]
    driver = subprocess.Popen([sys.executable, "-m", "rollflow.cli", "train", ASYNC, *killed], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    checkpoint = tmp_path / "killed" / "checkpoints" / "step_2" / "driver_state.json"
    deadline = time.monotonic() + 240
    while not checkpoint.exists() and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert checkpoint.exists(), driver.stderr.read() if driver.poll() is not None else "no checkpoint in time"
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait(timeout=30)
    capsys.readouterr()
    config = load_config(ASYNC, [*killed, "resume=true"])
    run_rlvr(config, manage_ray=False)
    assert "generated again" in capsys.readouterr().out  # what was in flight at the checkpoint is played again

    # staleness bounded at admission: each step trains the prompts drawn for it, whatever finished first, so the
    # killed and resumed run trains the uninterrupted run's prompts, step by step (none skipped, none twice)
    whole, resumed = _trained_prompts(tmp_path / "whole"), _trained_prompts(config.run_dir)
    assert sorted(whole) == sorted(resumed) == [1, 2, 3, 4, 5]
    assert all(sum(prompts.values()) == 16 for prompts in whole.values())
    assert resumed == whole
    rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6))  # no step lost, none twice
    steps = rows[1:]
    assert all(r["staleness/max"] <= 1 and r["rollout/stale_dropped"] == 0 for r in steps)
    assert any(r["staleness/max"] == 1 for r in steps)  # it did generate ahead of the trainer
    assert all(r["rollout/groups/consumed"] == 4 for r in steps)
    assert all("actor/train_infer_ratio_mean" in r for r in steps)  # TIS on by default when asynchronous
