"""Every failure ends the run with one line, in bounded time, and leaves the last checkpoint usable: weights
that training made non-finite, an engine whose decoding fails, a worker killed mid-run, a reward that fails on
every row. A reward that hangs on some rows costs those samples `reward.timeout_s`, never the run."""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

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


# ---- a worker killed mid-run, through the real CLI ------------------------------------------------------

CLI_RUN = ["rollout.groups_per_step=4", "rollout.group_size=4", "train.train_micro_batch_size=16",
           "data.eval.limit=8", "eval.every_steps=0", "output.trackers=[jsonl]", "checks.logprob_parity_samples=0",
           "output.save_every_steps=1", "name=killed", "roles.actor_infer.hybrid=false"]  # an engine process
EXITS_WITHIN_S = 30  # after the kill


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollflow.cli", "train", "examples/quickstart.yaml", *args]


def _descendants(root: int) -> list[int]:
    """Every process under `root` (Ray's raylet and its workers are children of the driver's session)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(parent, []).append(int(entry.name))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _find_worker(root: int, actor_class: str) -> int | None:
    """The pid of the `actor_class` actor's process under `root` (Ray titles it `ray::RolloutWorker...`)."""
    for pid in _descendants(root):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if title.startswith(f"ray::{actor_class}"):
            return pid
    return None


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"{what} did not happen within {timeout_s} s")


def test_a_killed_engine_worker_ends_the_run_in_one_line_and_the_checkpoint_resumes(tmp_path):
    run_dir = tmp_path / "killed"
    process = subprocess.Popen(_cli(*CLI_RUN, "train.steps=200", f"output.dir={tmp_path}"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        _wait_for(lambda: (run_dir / "checkpoints" / "step_1" / "driver_state.json").exists()
                  or process.poll() is not None, 300, "the first checkpoint")
        assert process.poll() is None, process.communicate()
        worker = _wait_for(lambda: _find_worker(process.pid, "RolloutWorker"), 30, "finding the engine worker")
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        stdout, stderr = process.communicate(timeout=EXITS_WITHIN_S + 30)
        exited_after = time.monotonic() - killed
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode not in (0, None), stdout[-2000:] + stderr[-2000:]
    assert exited_after < EXITS_WITHIN_S, f"exited {exited_after:.0f} s after the kill"
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert lines[0].startswith("rollflow: error: actor_infer worker 0 died"), lines[0]

    # the newest complete checkpoint resumes: one more step from it finishes
    steps = sorted(int(path.parent.name.removeprefix("step_"))
                   for path in (run_dir / "checkpoints").glob("step_*/driver_state.json"))
    assert steps and steps[0] == 1
    last = steps[-1]
    assert json.loads((run_dir / "checkpoints" / f"step_{last}" / "driver_state.json").read_text())["step"] == last
    resumed = subprocess.run(_cli(*CLI_RUN, f"train.steps={last + 1}", f"output.dir={tmp_path}", "resume=true"),
                             capture_output=True, text=True, timeout=600)
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
    config = load_config(None, [*SMALL, "train.steps=2", "reward.functions=[{name: 'user_rewards:hangs_on_odd_sums'}]",
                                "reward.timeout_s=1", "output.samples_logged_per_step=16", "name=hangs",
                                f"output.dir={tmp_path}"])
    assert _run_until_it_fails(config) is None  # each hung call costs 1 s on one of 4 threads, not forever
    rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    samples = [json.loads(line) for line in (config.run_dir / "samples.jsonl").read_text().splitlines()]
    failed = [s for s in samples if s["status"] == "failed"]
    assert failed and all("timed out after 1 s (reward.timeout_s)" in s["error"] for s in failed)
