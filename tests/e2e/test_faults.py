"""Every failure ends the run with one line, in bounded time, and leaves the last checkpoint usable: weights
that training made non-finite, an engine whose decoding fails, a worker killed mid-run, a reward that fails on
every row. A reward that hangs on some rows costs those samples `reward.timeout_s`, never the run.

Every run is in this process, in the session's Ray (`ray_session`, or the command line's `main` through the
`cli` fixture), with its kept workers."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file, save_file

from rollflow.cluster.groups import WorkerGroups
from rollflow.config import load_config
from rollflow.errors import EngineError, NonFiniteError, RollflowError, StepFailedError
from rollflow.models import resolve_model_path
from rollflow.pipelines.rlvr import run_rlvr

pytestmark = pytest.mark.slow

SMALL = ["train.steps=3", "rollout.groups_per_step=4", "rollout.group_size=4",
         "train.train_micro_batch_size=16", "data.eval.limit=8", "eval.every_steps=0", "output.trackers=[jsonl]",
         "roles.actor_train.num_cpus=1", "checks.logprob_parity_samples=0"]
FAILS_WITHIN_S = 120  # a run of a few tiny steps takes ~20 s; the bound only tells an error from a hang


def _run_until_it_fails(config) -> BaseException | None:
    """`run_rlvr` on a thread, so a hang fails the test (after FAILS_WITHIN_S) instead of blocking it.

    Returns:
        What the run raised, or None if it finished.
    """
    outcome: dict[str, BaseException | None] = {"error": None}

    def run() -> None:
        try:
            run_rlvr(config, manage_ray=False)
        except BaseException as err:  # handed to the test's thread
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=FAILS_WITHIN_S)
    assert not thread.is_alive(), f"the run neither failed nor finished within {FAILS_WITHIN_S} s (a hang?)"
    return outcome["error"]


def _assert_one_line(error: BaseException | None, kind: type[RollflowError]) -> str:
    assert isinstance(error, kind), repr(error)
    message = str(error)
    assert message and "\n" not in message and "Traceback" not in message, message
    return message


def test_weights_made_non_finite_stop_the_run_before_they_reach_the_engines(ray_session, tmp_path):
    """A huge LR and weight decay (the config refuses inf itself): AdamW's decay factor 1 - lr * decay
    (-1e40) overflows float32, the first optimizer step makes every weight inf / NaN; the trainer says so,
    and nothing is synced or saved."""
    config = load_config(None, [*SMALL, "train.lr=1e20", "train.weight_decay=1e20", "name=overflowing_lr",
                                f"output.dir={tmp_path}"])
    error = _run_until_it_fails(config)
    message = _assert_one_line(error, NonFiniteError)
    assert message == "actor_train: weights became non-finite after optimizer step 1 (train.lr too high?)"
    assert error.exit_code == 1
    assert not (config.run_dir / "checkpoints" / "step_1").exists()


def test_a_huge_learning_rate_fails_in_one_line(ray_session, tmp_path):
    """train.lr=1e30: finite but useless weights (|w| ~ 1e30) whose outputs overflow at the next forward:
    the engine's decoding or the next update refuses them, whichever comes first."""
    config = load_config(None, [*SMALL, "train.lr=1e30", "name=huge_lr", f"output.dir={tmp_path}"])
    error = _run_until_it_fails(config)
    message = _assert_one_line(error, RollflowError)
    assert isinstance(error, (EngineError, NonFiniteError)), message
    assert "non-finite" in message or "not finite" in message


def _nan_model(directory: Path) -> str:
    """The bundled tiny model with every weight NaN (tokenizer and config as they are)."""
    shutil.copytree(resolve_model_path("tiny"), directory)
    weights = load_file(directory / "model.safetensors")
    save_file({name: torch.full_like(tensor, float("nan")) for name, tensor in weights.items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
    return str(directory)


def test_an_engine_whose_decoding_fails_ends_the_run_in_one_line(ray_session, tmp_path):
    """A model whose weights are NaN: the first generation (the eval before step 1) fails in the engine, and
    the run stops with the engine's one line instead of waiting for completions that never come."""
    model = _nan_model(tmp_path / "models" / "nan")
    config = load_config(None, [*SMALL, f"model.path={model}", "name=nan_weights", f"output.dir={tmp_path}"])
    error = _run_until_it_fails(config)
    message = _assert_one_line(error, EngineError)
    assert message == "hf engine: decoding failed: the model's logits are not finite (non-finite weights?)"


# ---- a worker killed mid-run, through the command line ------------------------------------------------

CLI_RUN = ["rollout.groups_per_step=4", "rollout.group_size=4", "train.train_micro_batch_size=16",
           "data.eval.limit=8", "eval.every_steps=0", "output.trackers=[jsonl]", "checks.logprob_parity_samples=0",
           "output.save_every_steps=1", "name=killed", "roles.actor_infer.hybrid=false"]  # an engine process
EXITS_WITHIN_S = 30  # after the kill


@pytest.fixture
def started_groups(monkeypatch) -> list[WorkerGroups]:
    """The worker groups of each run this test starts in this process, once they are up (a spy on
    `start_roles`): which process serves a role of the run in progress, among the session's kept workers."""
    from rollflow.workers import roles

    started, start_roles = [], roles.start_roles

    def spy(*args, **kwargs) -> WorkerGroups:
        groups = start_roles(*args, **kwargs)
        started.append(groups)
        return groups

    monkeypatch.setattr(roles, "start_roles", spy)
    return started


@contextlib.contextmanager
def killing_worker(started_groups: list[WorkerGroups], role: str, ready: Callable[[], bool],
                   timeout_s: float = 300) -> Iterator[dict[str, float | str]]:
    """Around a run in this process: a thread SIGKILLs the process of `role`'s worker 0 of the run's groups
    once `ready()` holds, and records when (`killed_at`, `time.monotonic()`). If that has not happened within
    `timeout_s` (or the block ended first), `error` says so; every worker of the run is killed then, so that
    a run meant to be cut short ends instead of running its hundreds of steps."""
    outcome: dict[str, float | str] = {}
    block_ended = threading.Event()

    def kill() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not block_ended.is_set():
            if started_groups and ready():
                handle = started_groups[-1][role].handles[0]
                os.kill(ray.get(handle.__ray_call__.remote(lambda worker: os.getpid()), timeout=60), signal.SIGKILL)
                outcome["killed_at"] = time.monotonic()
                return
            time.sleep(0.2)
        outcome["error"] = f"the run did not get to the kill of its {role} worker within {timeout_s} s"
        for groups in started_groups:
            for handle in (handle for group in groups.own() for handle in group.handles):
                ray.kill(handle)

    thread = threading.Thread(target=kill, name="worker-killer", daemon=True)
    thread.start()
    try:
        yield outcome
    finally:
        block_ended.set()
        thread.join(timeout=120)


def test_a_killed_engine_worker_ends_the_run_in_one_line_and_the_checkpoint_resumes(tmp_path, cli, started_groups):
    run_dir = tmp_path / "killed"
    with killing_worker(started_groups, "actor_infer",
                        lambda: (run_dir / "checkpoints" / "step_1" / "driver_state.json").exists()) as kill:
        result = cli("train", "examples/quickstart.yaml", *CLI_RUN, "train.steps=200", f"output.dir={tmp_path}")
        returned_at = time.monotonic()
    assert "killed_at" in kill, f"{kill.get('error')}: {result}"
    assert result.returncode not in (0, None), result.stdout[-2000:] + result.stderr[-2000:]
    exited_after = returned_at - kill["killed_at"]
    assert exited_after < EXITS_WITHIN_S, f"exited {exited_after:.0f} s after the kill"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines[0].startswith("rollflow: error: actor_infer worker 0 died"), lines[0]

    # the newest complete checkpoint resumes: one more step from it finishes
    steps = sorted(int(path.parent.name.removeprefix("step_"))
                   for path in (run_dir / "checkpoints").glob("step_*/driver_state.json"))
    assert steps and steps[0] == 1
    last = steps[-1]
    assert json.loads((run_dir / "checkpoints" / f"step_{last}" / "driver_state.json").read_text())["step"] == last
    resumed = cli("train", "examples/quickstart.yaml", *CLI_RUN, f"train.steps={last + 1}", f"output.dir={tmp_path}",
                  "resume=true")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert (run_dir / "checkpoints" / f"step_{last + 1}" / "driver_state.json").exists()


REWARDS = """
import time

def always_fails(completion, **row):
    raise RuntimeError("this reward is broken")

def hangs_on_odd_sums(completion, **row):
    if int(row["answer"]) % 2:
        time.sleep(3600)
    return float(completion.strip() == str(row["answer"]))
"""


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    (tmp_path / "user_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_reward_that_fails_on_every_row_stops_the_run_with_its_reason(ray_session, tmp_path, rewards_module,
                                                                        caplog):
    config = load_config(None, [*SMALL, "reward.functions=[{name: 'user_rewards:always_fails'}]", "data.eval=null",
                                "name=broken", f"output.dir={tmp_path}"])
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        error = _run_until_it_fails(config)
        gc.collect()  # an asyncio future's unread exception is logged when the future is collected
    message = _assert_one_line(error, StepFailedError)
    # 4 prompts x 4 samples, and the 4 prompts that refilled the failed groups (rollout.max_refill_groups)
    assert message == "step 1: all 32 samples failed; the first failed with: RuntimeError: this reward is broken"
    assert not (config.run_dir / "checkpoints").exists()  # nothing trained, nothing saved
    assert "never retrieved" not in caplog.text, caplog.text  # no reward traceback on the console either


def test_a_reward_that_hangs_on_some_rows_fails_only_those_samples(ray_session, tmp_path, rewards_module):
    config = load_config(None, [*SMALL, "train.steps=1", "reward.functions=[{name: 'user_rewards:hangs_on_odd_sums'}]",
                                "reward.timeout_s=1", "output.samples_logged_per_step=16", "name=hangs",
                                f"output.dir={tmp_path}"])
    assert _run_until_it_fails(config) is None  # each hung call costs 1 s on one of 4 threads, not forever
    rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1]
    samples = [json.loads(line) for line in (config.run_dir / "samples.jsonl").read_text().splitlines()]
    failed = [s for s in samples if s["status"] == "failed"]
    assert failed and all("timed out after 1 s (reward.timeout_s)" in s["error"] for s in failed)
