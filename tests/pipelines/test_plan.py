"""`rollflow plan` without Ray: what it refuses before anything starts (its size, a plan that measures nothing),
what it prints (the answer first; the runs' own output in plan.log), the response limit the engines keep and the
report reads, and a stop signal anywhere in it. tests/e2e/test_simulated_runs.py runs it on simulated GPUs."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from rollflow.cli import main
from rollflow.pipelines import plan as planner
from rollflow.pipelines.interrupts import Interrupted
from rollflow.pipelines.plan import (
    ENGINE_PROCESS_BYTES,
    Candidate,
    check_plan_size,
    format_plan,
    simulated_gpu_limit,
    simulated_overrides,
    throughput,
)

QUICKSTART = "examples/quickstart.yaml"
GiB = 2**30


def test_the_simulated_gpu_limit_is_the_cores_or_the_memory_whichever_is_less():
    # 2 cores: 32 engines each, 64; 24 GiB: 24 * 1024 / 250 MB = 98 processes, 8 of them not engines: 90
    assert simulated_gpu_limit(cores=2, available_bytes=24 * GiB)[0] == 64
    # 4 GiB: 4 * 1024 / 250 = 16 processes, 8 of them not engines: 8
    limit, why = simulated_gpu_limit(cores=2, available_bytes=4 * GiB)
    assert limit == 8 and "4.0 GB of memory available" in why and "(2 here)" in why
    assert simulated_gpu_limit(cores=8, available_bytes=3 * ENGINE_PROCESS_BYTES)[0] == 0


@pytest.mark.parametrize("gpus, steps, max_new_tokens, expected", [
    (100_000, 6, None, "rollflow plan --gpus 100000: this machine can simulate at most 64 GPUs: each simulated "
                       "GPU's engine is a Ray actor process of its own"),
    (65, 6, None, "at most 64 GPUs"),
    (0, 6, None, "at least 2 GPUs to split, got --gpus 0"),
    (-3, 6, None, "at least 2 GPUs to split, got --gpus -3"),
    (4, 2, None, "rollflow plan --steps 2: throughput counts the steps after the first 2; give --steps 3 or more"),
    (4, 6, 0, "rollflow plan --max-new-tokens 0"),
])
def test_a_plan_it_cannot_simulate_or_measure_is_refused(gpus, steps, max_new_tokens, expected):
    with pytest.raises(planner.ConfigError) as caught:
        check_plan_size(gpus, steps, max_new_tokens, limit=simulated_gpu_limit(2, 24 * GiB))
    assert expected in str(caught.value) and "\n" not in str(caught.value)
    check_plan_size(64, 3, 6, limit=simulated_gpu_limit(2, 24 * GiB))  # the limit itself is fine


def test_plan_gpus_100000_is_one_line_before_anything_starts(capsys, monkeypatch):
    monkeypatch.setattr(planner, "start_ray", _never)
    monkeypatch.setattr(planner, "load_config", _never)  # refused before the config is even read
    assert main(["plan", QUICKSTART, "--gpus", "100000"]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith("rollflow: error: rollflow plan --gpus 100000: this machine can simulate at most ")
    assert captured.out == ""


def _never(*args, **kwargs):
    raise AssertionError("reached past the checks")


def test_the_engines_keep_the_config_s_limit_which_token_scale_does_not_divide():
    overrides = simulated_overrides(Candidate(2, 2, True, 0), "h800-7b", 20.0, 16, 6, 4)
    assert "rollout.max_new_tokens=1" in overrides  # the payload's limit: one token of 16 simulated ones
    (kwargs,) = [o.split("=", 1)[1] for o in overrides if o.startswith("roles.actor_infer.engine_kwargs=")]
    assert json.loads(kwargs) == {"max_new_simulated_tokens": 6}


def _metrics(run_dir, response_length: float, steps: int = 4):
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"step": step, "time/step": 0.5, "time/rollout": 0.2, "time/train": 0.3, "train/samples": 8.0,
             "rollout/response_length": response_length} for step in range(1, steps + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_the_reported_response_never_exceeds_the_limit(tmp_path):
    _metrics(tmp_path / "six", response_length=1.0)  # every response 1 payload token: 16 simulated at most
    assert throughput(tmp_path / "six", 20.0, token_scale=16, max_new_tokens=6)["response_tokens"] == 6
    # 8 samples a step, 2 steps after the warm-up of 2, each 0.5 s x 20 simulated: 16 / 20 s = 0.8 samples/s
    assert throughput(tmp_path / "six", 20.0, token_scale=16)["samples_per_s"] == pytest.approx(0.8)
    _metrics(tmp_path / "long", response_length=20.0)  # 20 x 16 = 320, under a limit of 1024
    assert throughput(tmp_path / "long", 20.0, token_scale=16, max_new_tokens=1024)["response_tokens"] == 320


def _fake_run(seconds: dict[str, float]):
    """A `run_rlvr` that prints what a run prints and logs 4 steps of `seconds[name]` wall seconds each."""

    def run(config, manage_ray=True):
        print("starting workers: actor_train x1 (sim), actor_infer x4 (sim) ...")
        print("role         worker  node  devices          threads")
        print("rollflow: warning: every group's samples got the same reward", file=sys.stderr)
        config.run_dir.mkdir(parents=True)
        rows = [{"step": step, "time/step": seconds[config.name], "time/rollout": 0.1, "train/samples": 8.0,
                 "rollout/response_length": 1.0} for step in range(1, 5)]
        (config.run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        return {}

    return run


SECONDS = {"sync_colocated_4": 0.4, "async_k1_train1_rollout3": 0.3, "async_k1_train2_rollout2": 0.2,
           "async_k2_train2_rollout2": 0.25}


@pytest.mark.parametrize("verbose", [False, True])
def test_the_answer_comes_first_and_the_runs_output_goes_to_plan_log(tmp_path, capsys, monkeypatch, verbose):
    monkeypatch.setattr(planner, "run_rlvr", _fake_run(SECONDS))
    monkeypatch.setattr(planner, "check_plan_size", lambda *args: None)  # whatever this machine holds
    result = planner.plan(QUICKSTART, ["rollout.max_new_tokens=6"], "h800-7b", 4, tmp_path, steps=4,
                          manage_ray=False, verbose=verbose)
    captured = capsys.readouterr()
    progress = [f"simulating placement {i}/4: " for i in range(1, 5)]
    log = (tmp_path / "plan.log").read_text()
    if verbose:
        assert "role         worker" in captured.out and "rollflow: warning" in captured.err
    else:
        assert [line[:len(prefix)] for line, prefix in zip(captured.out.splitlines(), progress)] == progress
        assert len(captured.out.splitlines()) == 4 and captured.err == ""
        assert log.count("role         worker") == 4 and log.count("rollflow: warning") == 4
    assert result["best"] == "async_k1_train2_rollout2" and result["max_new_tokens"] == 6
    lines = format_plan(result, tmp_path).splitlines()
    # 8 samples in each of steps 3 and 4, of 0.2 wall s x time_scale 20: 16 / 8 = 2 samples/s; the synchronous
    # placement's steps of 0.4 s: 1 sample/s
    assert lines[0] == ("recommended: asynchronous (max_staleness 1): 2 GPUs train, 2 engines: 2.00 samples/s, "
                        "2.00x the synchronous placement")
    assert lines[1].startswith("  roles.actor_train.device_mapping: [0,1], roles.actor_infer.device_mapping: [2,3]")
    assert "4 steps each, responses of at most 6 tokens" in lines[2]
    assert lines[3].split() == ["placement", "samples/s", "step", "s", "rollout", "s", "stale", "tokens"]
    assert all(line.endswith(" 6") for line in lines[4:8])  # 1 payload token = 16 simulated, capped at 6
    assert len(lines) == 9 and str(tmp_path / "plan.log") in lines[8]


def test_a_stop_signal_anywhere_in_the_plan_stops_ray_and_raises_interrupted(tmp_path, monkeypatch):
    """SIGTERM while a placement runs (Ray up, no run of its own handling it): `Interrupted`, once Ray is
    stopped; no later placement runs. Without the plan's own handler, the test's would raise instead."""
    calls = []
    monkeypatch.setattr(planner, "start_ray", lambda: calls.append("start_ray"))
    monkeypatch.setattr(planner, "stop_ray", lambda: calls.append("stop_ray"))
    monkeypatch.setattr(planner, "check_plan_size", lambda *args: None)

    def run(config, manage_ray=True):
        calls.append(config.name)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # interrupted at once
        calls.append("not interrupted")

    monkeypatch.setattr(planner, "run_rlvr", run)

    class TestHandler(Exception):
        pass

    def raise_test_handler(number, frame):
        raise TestHandler

    previous = signal.signal(signal.SIGTERM, raise_test_handler)
    try:
        with pytest.raises(Interrupted) as caught:
            planner.plan(QUICKSTART, [], "h800-7b", 4, tmp_path, steps=4)
        assert signal.getsignal(signal.SIGTERM) is raise_test_handler  # put back
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert caught.value.signal_name == "SIGTERM" and caught.value.exit_status == 143
    assert calls == ["start_ray", "sync_colocated_4", "stop_ray"]
