"""Agentic runs that cannot train, through the command line (its `main` in this process: the `cli` fixture):
an env that fails every episode stops the run with the first episode's error in one line (not 40 empty steps
and exit 0), and a killed env worker stops it within seconds."""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.e2e.test_faults import killing_worker, started_groups  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow

RUN = ["pipeline=agentic", "env.id=tests.e2e.fragile_envs:make", "env.max_turns=3", "rollout.groups_per_step=2",
       "rollout.group_size=2", "eval.every_steps=0", "output.trackers=[jsonl]"]


def _train(cli, tmp_path, *overrides: str):
    (tmp_path / "config.yaml").write_text("name: run\n")
    return cli("train", tmp_path / "config.yaml", *RUN, f"output.dir={tmp_path / 'runs'}", *overrides)


def test_an_env_that_fails_every_episode_stops_the_run_with_the_first_error(tmp_path, cli):
    started = time.monotonic()
    done = _train(cli, tmp_path, "env.kwargs={breaks: step}", "eval.episodes=0", "train.steps=40")
    elapsed = time.monotonic() - started
    run_dir = tmp_path / "runs" / "run"
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


def test_a_killed_env_worker_stops_the_run_in_one_line(tmp_path, cli, started_groups):  # noqa: F811
    metrics = tmp_path / "runs" / "run" / "metrics.jsonl"
    with killing_worker(started_groups, "env",
                        lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2) as kill:
        done = _train(cli, tmp_path, "eval.episodes=2", "train.steps=500")
        returned_at = time.monotonic()
    assert "killed_at" in kill, f"{kill.get('error')}: {done}"
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    exited_after = returned_at - kill["killed_at"]
    assert exited_after < 30, f"exited {exited_after:.0f} s after the kill"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[0].startswith("rollflow: error: env worker 0 died during "), lines[0]
    # the first step is logged, not saved (output.save_every_steps is left at its default): nothing to resume
    assert "(killed, or out of memory?); no checkpoint was saved yet" in lines[0] or \
        re.search(r"\(killed, or out of memory\?\); the last checkpoint, step_\d+, is intact", lines[0]), lines[0]
