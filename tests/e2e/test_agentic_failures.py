"""Agentic runs that cannot train, through the real CLI: an env that fails every episode stops the run with
the first episode's error in one line (not 40 empty steps and exit 0), and a killed env worker stops it
within seconds."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.test_faults import _find_worker, _wait_for

pytestmark = pytest.mark.slow

ENVS = """
import time

class Env:
    def __init__(self, breaks="nothing"):
        self.breaks = breaks

    def reset(self, seed=None):
        return "pick a number", {}

    def step(self, action):
        if self.breaks == "step":
            raise ValueError("the board is on fire")
        time.sleep(0.05)
        return "go on", 0.0, False, False, {}

def make(**kwargs):
    return Env(**kwargs)
"""
RUN = ["pipeline=agentic", "env.id=user_envs:make", "env.max_turns=3", "rollout.groups_per_step=2",
       "rollout.group_size=2", "eval.every_steps=0", "output.trackers=[jsonl]"]


def _cli(tmp_path: Path, *overrides: str) -> list[str]:
    (tmp_path / "config.yaml").write_text("name: run\n")
    return [sys.executable, "-m", "rollflow.cli", "train", str(tmp_path / "config.yaml"), *RUN,
            f"output.dir={tmp_path / 'runs'}", *overrides]


@pytest.fixture
def user_envs(tmp_path):
    (tmp_path / "user_envs.py").write_text(ENVS)  # found in the working directory, as `module:factory`
    return tmp_path


def test_an_env_that_fails_every_episode_stops_the_run_with_the_first_error(user_envs):
    started = time.monotonic()
    done = subprocess.run(_cli(user_envs, "env.kwargs={breaks: step}", "eval.episodes=0", "train.steps=40"),
                          cwd=user_envs, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - started
    run_dir = user_envs / "runs" / "run"
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "rollflow: error: step 1: all 8 episodes failed; the first failed with: env step raised ValueError: the "
        f"board is on fire (every error: {run_dir / 'error.log'})"], done.stderr  # 2 groups + 2 refills of 2
    assert elapsed < 120  # within the watchdog (900 s), not after 40 empty steps
    log = (run_dir / "error.log").read_text()
    assert "8 x env step raised ValueError: the board is on fire" in log
    assert 'raise ValueError("the board is on fire")' in log  # the env's own traceback
    records = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert records and all(r["status"] == "failed" and "the board is on fire" in r["error"] for r in records)
    assert not (run_dir / "checkpoints").exists()


def test_a_killed_env_worker_stops_the_run_in_one_line(user_envs):
    process = subprocess.Popen(_cli(user_envs, "eval.episodes=2", "train.steps=500"), cwd=user_envs,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    metrics = user_envs / "runs" / "run" / "metrics.jsonl"
    try:
        _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2
                  or process.poll() is not None, 300, "the first step")
        assert process.poll() is None, process.communicate()
        worker = _wait_for(lambda: _find_worker(process.pid, "EnvWorker"), 30, "finding the env worker")
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        stdout, stderr = process.communicate(timeout=90)
        exited_after = time.monotonic() - killed
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 1, stdout[-2000:] + stderr[-2000:]
    assert exited_after < 30, f"exited {exited_after:.0f} s after the kill"
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert lines[0].startswith("rollflow: error: env worker 0 died during "), lines[0]
    # the first step is logged, not saved (output.save_every_steps is left at its default): nothing to resume
    assert "(killed, or out of memory?); no checkpoint was saved yet" in lines[0] or \
        re.search(r"\(killed, or out of memory\?\); the last checkpoint, step_\d+, is intact", lines[0]), lines[0]
