"""Same seed, same run: two runs log identical metrics step by step, and a driver killed with `kill -9` and
resumed logs the same metrics as the run that was never interrupted. For RLVR (the quickstart) and for agentic
RL (step samples of guess-the-number: the rollout core's deterministic rounds cover env groups too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollflow.config import load_config
from rollflow.pipelines.agentic import run_agentic
from rollflow.pipelines.rlvr import run_rlvr
from tests.e2e.test_interrupted_runs import kill_9_after_checkpoint

pytestmark = pytest.mark.slow

RUN = ["train.steps=4", "rollout.groups_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6",
       "train.train_micro_batch_size=8", "train.lr=1e-4", "data.eval.limit=16", "eval.every_steps=2",
       "output.trackers=[jsonl]", "roles.actor_train.num_cpus=1", "output.save_every_steps=1", "seed=3"]
QUICKSTART = str(Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml")
# a short agentic run: step samples of guess-the-number (the bundled model writes numbers, so some guesses are
# valid and groups differ), an eval every 2 steps, a checkpoint every step
AGENTIC = ["env.id=guess_number", "env.kwargs={low: 1, high: 9, max_turns: 4}", "env.max_turns=4", "rollout.samples=step",
           "rollout.groups_per_step=4", "rollout.group_size=2", "rollout.max_new_tokens=6", "train.steps=4",
           "train.lr=1e-4", "eval.every_steps=2", "eval.episodes=8", "output.trackers=[jsonl]",
           "output.save_every_steps=1", "seed=3"]
NOISY = ("time/", "memory/", "seconds", "per_second")  # wall-clock and memory readings differ run to run
# The engine-trainer parity check reads float noise (~1e-6 nats): how large depends on which rows the engine's
# continuous batch held when a sequence was computed, and in agentic runs that follows when each env's turn came
# back. So it is not compared for equality: each reading must be far inside the check's default tolerance (1e-2).
PARITY = "check/logprob_max_abs_diff"
PARITY_TOLERANCE = 1e-4


def _metrics(run_dir: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in row.items() if not any(n in k for n in NOISY)} for row in rows]
    for row in rows:
        if PARITY in row:
            assert 0 <= row[PARITY] < PARITY_TOLERANCE, row
            row[PARITY] = "within tolerance"
    return rows


@pytest.fixture(scope="module")
def uninterrupted(ray_session, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs")
    run_rlvr(load_config(QUICKSTART, [*RUN, "name=first", f"output.dir={out}"]), manage_ray=False)
    return out / "first"


def test_two_runs_with_the_same_seed_log_the_same_metrics(uninterrupted, tmp_path):
    run_rlvr(load_config(QUICKSTART, [*RUN, "name=second", f"output.dir={tmp_path}"]), manage_ray=False)
    first, second = _metrics(uninterrupted), _metrics(tmp_path / "second")
    assert [row["step"] for row in first] == [0, 1, 2, 3, 4]
    assert any(row.get("grad_norm", 0) > 0 for row in first)  # it trained: there is something to differ
    for a, b in zip(first, second, strict=True):
        assert a == b, {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


def test_kill_9_of_the_driver_then_resume_gives_the_uninterrupted_run(uninterrupted, tmp_path):
    _kill_9_then_resume(QUICKSTART, RUN, run_rlvr, uninterrupted, tmp_path)


@pytest.fixture(scope="module")
def agentic_config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("agentic") / "agentic.yaml"
    path.write_text("pipeline: agentic\n")
    return str(path)


@pytest.fixture(scope="module")
def agentic_uninterrupted(ray_session, agentic_config, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("agentic_runs")
    run_agentic(load_config(agentic_config, [*AGENTIC, "name=first", f"output.dir={out}"]), manage_ray=False)
    return out / "first"


def test_two_agentic_runs_with_the_same_seed_log_the_same_metrics(agentic_uninterrupted, agentic_config, tmp_path):
    run_agentic(load_config(agentic_config, [*AGENTIC, "name=second", f"output.dir={tmp_path}"]), manage_ray=False)
    first, second = _metrics(agentic_uninterrupted), _metrics(tmp_path / "second")
    assert [row["step"] for row in first] == [0, 1, 2, 3, 4]
    assert any(row.get("grad_norm", 0) > 0 for row in first) and "eval/success" in first[2]
    for a, b in zip(first, second, strict=True):
        assert a == b, {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


def test_kill_9_of_an_agentic_driver_then_resume_gives_the_uninterrupted_run(agentic_uninterrupted, agentic_config,
                                                                             tmp_path):
    _kill_9_then_resume(agentic_config, AGENTIC, run_agentic, agentic_uninterrupted, tmp_path)


def _kill_9_then_resume(config_path: str, overrides: list[str], run, uninterrupted: Path, tmp_path: Path) -> None:
    """Run the CLI until its step-2 checkpoint, `kill -9` it, resume in this process: the metrics of the
    uninterrupted run, row for row (the resumed driver's first-step parity check aside)."""
    kill_9_after_checkpoint(config_path, [*overrides, "name=killed", f"output.dir={tmp_path}"], tmp_path / "killed")
    run(load_config(config_path, [*overrides, "name=killed", f"output.dir={tmp_path}", "resume=true"]),
        manage_ray=False)
    expected, got = _metrics(uninterrupted), _metrics(tmp_path / "killed")
    assert [row["step"] for row in got] == [0, 1, 2, 3, 4]  # no step twice, none missing
    checked = [row for row in got[2:] if PARITY in row]
    assert len(checked) == (PARITY in expected[1])  # each driver checks its first step
    for row in checked:
        del row[PARITY]
    for a, b in zip(expected, got, strict=True):
        assert a == b, {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
