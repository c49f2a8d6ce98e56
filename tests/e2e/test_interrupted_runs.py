"""An interrupted run through the real CLI: Ctrl-C saves the last finished step, leaves no Ray process, and
resume continues from it without a duplicate step. (`kill -9` of the driver: tests/e2e/test_reproducible.py
and tests/cluster/test_runtime_cleanup.py.)"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from rollflow.cluster.reaper import descendants, session_processes

pytestmark = pytest.mark.slow

QUICKSTART = str(Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml")
FAST = ["rollout.groups_per_step=4", "rollout.group_size=4", "train.train_micro_batch_size=16",
        "data.eval.limit=8", "eval.every_steps=0", "output.trackers=[jsonl]", "checks.logprob_parity_samples=0"]


def _start(tmp_path, *overrides):
    return subprocess.Popen([sys.executable, "-m", "rollflow.cli", "train", QUICKSTART, *FAST,
                             "name=run", f"output.dir={tmp_path}", *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def _wait_for_step(run_dir: Path, step: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        path = run_dir / "metrics.jsonl"
        if path.exists() and step in _steps(path):
            return
        time.sleep(0.2)
    pytest.fail(f"step {step} never logged")


def _ray_sessions(driver_pid: int) -> set[str]:
    """The session directories of the Ray processes running under the driver `driver_pid` now: a Ray that the
    command line prestarted is named after the pid of the process that started its head, a child of the
    driver, so only the driver's process tree tells it (while the driver runs)."""
    sessions = set()
    for child in descendants(driver_pid):
        try:
            arguments = (Path("/proc") / str(child) / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        sessions.update(argument.split("=", 1)[1] for argument in arguments
                        if argument.startswith(("--session-dir=", "--session_dir=")))
    return sessions


def _ray_left(driver_pid: int, sessions: Iterable[str] = ()) -> dict[int, str]:
    """Processes of the Ray session the driver started: a session dir named after the driver's pid (Ray's name
    for the one a driver starts itself), and `sessions` (`_ray_sessions`: a prestarted one)."""
    left = {}
    for session in {*glob.glob(f"/tmp/ray/session_*_{driver_pid}"), *sessions}:
        left.update(session_processes(session))
    return left


def _assert_no_ray_left(driver_pid: int, within_s: float = 15, sessions: Iterable[str] = ()) -> None:
    deadline = time.monotonic() + within_s
    while _ray_left(driver_pid, sessions) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert not _ray_left(driver_pid, sessions)


def test_ctrl_c_saves_the_last_finished_step_and_resume_continues(tmp_path, cli):
    run_dir = tmp_path / "run"
    driver = _start(tmp_path, "train.steps=20")
    _wait_for_step(run_dir, 1)
    sessions = _ray_sessions(driver.pid)
    assert sessions, "no Ray process under the driver"  # the command line's prestarted Ray
    driver.send_signal(signal.SIGINT)
    out, err = driver.communicate(timeout=120)
    assert driver.returncode == 130, out[-2000:] + err[-3000:]
    assert "rollflow: interrupted (SIGINT)" in err
    last = _steps(run_dir / "metrics.jsonl")[-1]
    assert f"saving step {last}" in out
    assert json.loads((run_dir / "checkpoints" / f"step_{last}" / "driver_state.json").read_text())["step"] == last
    _assert_no_ray_left(driver.pid, sessions=sessions)

    # the resume through the command line's `main` in this process (a resume never prestarts Ray:
    # tests/test_cli_prestart.py; a finished command leaves no Ray: tests/cluster/test_runtime_cleanup.py)
    resumed = cli("train", QUICKSTART, *FAST, "name=run", f"output.dir={tmp_path}", f"train.steps={last + 1}",
                  "resume=true")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert _steps(run_dir / "metrics.jsonl") == list(range(last + 2))  # 0 (initial eval) .. last + 1, once each


def kill_9_after_checkpoint(config_path: str, overrides: list[str], run_dir: Path, step: int = 2) -> None:
    """Run `rollflow train config_path overrides` until its step-`step` checkpoint is written in `run_dir`, then
    `kill -9` the driver; its prestarted Ray must go with it (the reaper)."""
    driver = subprocess.Popen([sys.executable, "-m", "rollflow.cli", "train", config_path, *overrides],
                              cwd=Path(__file__).resolve().parents[2], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    checkpoint = run_dir / "checkpoints" / f"step_{step}" / "driver_state.json"
    deadline = time.monotonic() + 240
    while not checkpoint.exists() and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert checkpoint.exists(), driver.stderr.read() if driver.poll() is not None else "no checkpoint in time"
    sessions = _ray_sessions(driver.pid)  # the command line's prestarted Ray, named after its head's pid
    assert sessions, "no Ray process under the driver"
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait(timeout=30)
    _assert_no_ray_left(driver.pid, sessions=sessions)  # the reaper took the driver's Ray session down with it
