"""MetricsTracker: the console's ETA (with a fake clock), the Weights & Biases tracker (with a stand-in
`wandb` module), and the missing-package error at config load."""

from __future__ import annotations

import importlib.machinery
import math
import sys
import types

import pytest

from rollflow.config import dump_config, load_config
from rollflow.errors import ConfigError
from rollflow.trackers import MetricsTracker
from rollflow.trackers.trackers import StepTimer, format_duration
from rollflow.trackers.wandb_run import WANDB_ID_FILE


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_format_duration():
    assert [format_duration(s) for s in (0, 44.6, 59.4, 60, 72, 3599, 3600, 7500)] == \
        ["0s", "45s", "59s", "1m00s", "1m12s", "59m59s", "1h00m", "2h05m"]


def test_eta_leaves_out_the_first_step_once_there_are_two():
    clock = FakeClock()
    timer = StepTimer(clock)
    assert timer.eta(10) is None  # no step yet
    clock.now += 50.0  # step 0: the eval before training is not a step
    timer.lap(0)
    assert timer.eta(10) is None
    clock.now += 30.0  # step 1 (warm-up): the only step so far, so it is the estimate
    timer.lap(1)
    assert timer.eta(9) == pytest.approx(9 * 30.0)
    clock.now += 10.0
    timer.lap(2)
    assert timer.eta(8) == pytest.approx(8 * 10.0)  # step 1 left out
    clock.now += 16.0  # an eval step counts like any other
    timer.lap(3)
    assert timer.eta(7) == pytest.approx(7 * (10.0 + 16.0) / 2)
    assert timer.eta(0) == 0.0


def test_the_console_line_ends_with_the_eta(tmp_path, capsys):
    clock = FakeClock()
    tracker = MetricsTracker(tmp_path, ["console"], total_steps=5, clock=clock)
    clock.now += 40.0
    tracker.log(0, {"eval/accuracy": 0.25})
    clock.now += 100.0  # step 1: warm-up
    tracker.log(1, {"reward/mean": 0.5, "time/step": 100.0})
    clock.now += 24.0
    tracker.log(2, {"reward/mean": 0.6, "time/step": 24.0})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "step 0/5  eval_acc 0.25"  # before any step: no estimate
    assert lines[1] == "step 1/5  reward 0.5  step_s 100  eta 6m40s"  # 4 steps x 100 s
    assert lines[2] == "step 2/5  reward 0.6  step_s 24  eta 1m12s"  # 3 steps x 24 s: step 1 left out


def test_a_resumed_process_times_its_own_steps(tmp_path, capsys):
    clock = FakeClock()
    tracker = MetricsTracker(tmp_path, ["console"], total_steps=10, resumed_at=6, clock=clock)
    clock.now += 90.0  # step 7 includes loading the checkpoint
    tracker.log(7, {})
    clock.now += 5.0
    tracker.log(8, {})
    assert capsys.readouterr().out.splitlines() == ["step 7/10  eta 4m30s", "step 8/10  eta 10s"]


class FakeWandb:
    """What rollflow calls of `wandb`: `init(...)` -> a run with `log(data, step=)` and `finish()`."""

    def __init__(self):
        self.calls: list[tuple] = []

    def module(self) -> types.ModuleType:
        module = types.ModuleType("wandb")
        module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # find_spec sees it installed
        module.init = self.init
        return module

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        return types.SimpleNamespace(log=lambda data, step: self.calls.append(("log", data, step)),
                                     finish=lambda: self.calls.append(("finish",)))


@pytest.fixture
def fake_wandb(monkeypatch) -> FakeWandb:
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake.module())
    return fake


def _run_dir(tmp_path, *overrides: str):
    """A run directory as `prepare_run_dir` leaves it: the resolved config.yaml of a wandb run."""
    config = load_config(None, [f"output.dir={tmp_path}", "name=demo", "output.trackers=[jsonl,wandb]",
                                *overrides])
    config.run_dir.mkdir(parents=True)
    (config.run_dir / "config.yaml").write_text(dump_config(config))
    return config


def test_wandb_logs_each_steps_finite_metrics_and_finishes(tmp_path, fake_wandb):
    config = _run_dir(tmp_path, "output.wandb_project=maths")
    tracker = MetricsTracker(config.run_dir, config.output.trackers, total_steps=2)
    tracker.log(0, {"eval/accuracy": 0.25})
    tracker.log(1, {"reward/mean": 0.5, "actor/kl": math.nan, "sync/version": 1, "note": "not a number"})
    tracker.close()
    tracker.close()  # finishes once
    init, *rest = fake_wandb.calls
    options = init[1]
    assert options["project"] == "maths" and options["name"] == "demo" and options["resume"] == "allow"
    assert options["config"]["name"] == "demo" and options["config"]["output"]["wandb_project"] == "maths"
    assert options["config"]["rollout"] == config.rollout.model_dump(mode="json")  # the whole config
    assert options["dir"] == str(config.run_dir)
    assert options["id"] == (config.run_dir / WANDB_ID_FILE).read_text().strip()
    assert rest == [("log", {"eval/accuracy": 0.25}, 0),
                    ("log", {"reward/mean": 0.5, "sync/version": 1.0}, 1),  # NaN and text left out
                    ("finish",)]


def test_a_resumed_run_logs_into_the_same_wandb_run(tmp_path, fake_wandb):
    config = _run_dir(tmp_path)
    first = MetricsTracker(config.run_dir, ["wandb"], total_steps=4)
    first.log(1, {"reward/mean": 0.5})
    first.close()
    resumed = MetricsTracker(config.run_dir, ["wandb"], total_steps=4, resumed_at=1)
    resumed.log(2, {"reward/mean": 0.6})
    resumed.close()
    inits = [call[1] for call in fake_wandb.calls if call[0] == "init"]
    assert len(inits) == 2 and inits[0]["id"] == inits[1]["id"] and inits[1]["resume"] == "allow"
    assert len(inits[0]["id"]) == 8
    other = _run_dir(tmp_path / "other")  # another run gets its own id
    MetricsTracker(other.run_dir, ["wandb"], total_steps=1).close()
    assert fake_wandb.calls[-2][1]["id"] != inits[0]["id"]


def test_wandb_without_the_package_is_one_config_error_at_load(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: importing it fails
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["output.trackers=[console,wandb]"])
    assert str(caught.value) == \
        'output.trackers has wandb but the wandb package is not installed: pip install "rollflow[wandb]"'
    assert load_config(None, ["output.trackers=[console,jsonl]"]).output.trackers == ["console", "jsonl"]
