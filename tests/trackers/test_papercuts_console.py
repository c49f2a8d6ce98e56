"""The console's step line: whole when stdout is a file or a pipe (rich would wrap it at 80 columns there), an
ETA from the latest steps, the loss and last eval of the supervised pipelines; and the wall-clock time of each
`metrics.jsonl` record (issue #27)."""

from __future__ import annotations

import json

import pytest

from rollflow.config import PIPELINES
from rollflow.trackers import MetricsTracker
from rollflow.trackers.metric_names import documented_metric
from rollflow.trackers.trackers import RECENT_STEPS, StepTimer
from tests.trackers.test_trackers import FakeClock


def test_long_console_lines_are_not_wrapped_in_a_pipe(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)  # rich's width when stdout is no terminal: 80, or $COLUMNS
    tracker = MetricsTracker(tmp_path, ["console"], total_steps=100)
    message = "moved " + "/a/long/run/directory" * 8 + " aside (resume=true continues a run instead)"
    tracker.print(message)
    tracker.log(1, {"reward/mean": 0.123456, "rollout/accuracy": 0.5, "eval/accuracy": 0.25,
                    "rollout/response_length": 123.4, "actor/kl": 0.001, "rollout/tokens_per_second": 12345.0,
                    "time/step": 1.5})
    lines = capsys.readouterr().out.splitlines()
    assert len(message) > 160 and lines[0] == message
    assert len(lines) == 2 and lines[1].startswith("step 1/100") and "step_s 1.5" in lines[1]
    tracker.close()


def test_the_eta_follows_the_latest_steps_after_a_slow_patch():
    clock = FakeClock()
    timer = StepTimer(clock)
    durations = [30.0] + [60.0] * 20 + [10.0] * RECENT_STEPS  # warm-up, a slow patch, then the usual pace
    for step, seconds in enumerate(durations, start=1):
        clock.now += seconds
        timer.lap(step)
    steps_left = 120 - len(durations)  # 89
    assert timer.eta(steps_left) == pytest.approx(steps_left * 10.0)  # 14m50s
    # the mean of every step but the first (20 x 60 s + 10 x 10 s) / 30 = 43.3 s said 64m: 4.3x too long
    clock.now += 25.0  # one slower step moves the estimate by a tenth of its excess: (9 x 10 + 25) / 10
    timer.lap(len(durations) + 1)
    assert timer.eta(88) == pytest.approx(88 * 11.5)


def test_each_metrics_record_carries_its_wall_clock_time(tmp_path, capsys):
    wall = FakeClock()
    wall.now = 1_700_000_000.0
    tracker = MetricsTracker(tmp_path, ["jsonl", "console"], total_steps=2, wall_clock=wall)
    tracker.log(0, {"eval/accuracy": 0.25})
    wall.now += 12.5
    tracker.log(1, {"reward/mean": 0.5})
    tracker.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 0, "time/unix": 1_700_000_000.0, "eval/accuracy": 0.25},
                    {"step": 1, "time/unix": 1_700_000_012.5, "reward/mean": 0.5}]
    assert "1700000" not in capsys.readouterr().out  # a record's stamp, not a metric to show
    assert documented_metric("time/unix").name == "time/unix"


def _lines(tmp_path, capsys, pipeline: str, steps: list[dict[str, float]]) -> list[str]:
    tracker = MetricsTracker(tmp_path, ["console"], total_steps=len(steps) - 1, columns=PIPELINES[pipeline].step_class().columns,
                             clock=FakeClock())  # the clock stands still: an ETA of 0 s
    for step, metrics in enumerate(steps):
        tracker.log(step, metrics)
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("pipeline", ["sft", "distill"])
def test_a_supervised_line_shows_the_loss_and_the_last_eval(tmp_path, capsys, pipeline):
    lines = _lines(tmp_path, capsys, pipeline, [
        {"eval/loss": 2.5, "eval/accuracy": 0.1},
        {"loss": 2.4, "grad_norm": 3.0, "lr": 1e-3, "time/step": 0.5},
        {"loss": 2.2, "eval/loss": 2.1, "eval/accuracy": 0.3, "time/step": 0.75},
        {"loss": 2.0, "time/step": 0.5},
    ])
    assert lines == ["step 0/3  eval_loss 2.5  eval_acc 0.1",
                     "step 1/3  loss 2.4  eval_loss 2.5  eval_acc 0.1  step_s 0.5  eta 0s",  # step 0's eval
                     "step 2/3  loss 2.2  eval_loss 2.1  eval_acc 0.3  step_s 0.75  eta 0s",
                     "step 3/3  loss 2  eval_loss 2.1  eval_acc 0.3  step_s 0.5  eta 0s"]


def test_a_dpo_line_shows_the_preference_loss_not_the_surrogate(tmp_path, capsys):
    lines = _lines(tmp_path, capsys, "dpo", [
        {"eval/dpo/reward_accuracy": 0.5, "eval/accuracy": 0.35},
        {"loss": -0.01, "dpo/loss": 0.69, "dpo/reward_accuracy": 0.5, "time/step": 1.0},
    ])
    assert lines == ["step 0/1  eval_pref_acc 0.5  eval_acc 0.35",
                     "step 1/1  loss 0.69  pref_acc 0.5  eval_pref_acc 0.5  eval_acc 0.35  step_s 1  eta 0s"]


def test_an_rl_line_shows_an_eval_only_at_its_step(tmp_path, capsys):
    lines = _lines(tmp_path, capsys, "rlvr", [{"eval/accuracy": 0.354}, {"reward/mean": 0.4, "loss": 0.01}])
    assert lines == ["step 0/1  eval_acc 0.354", "step 1/1  reward 0.4  eta 0s"]


def test_every_pipeline_has_a_line_of_documented_metrics():
    for pipeline in PIPELINES:
        columns = PIPELINES[pipeline].step_class().columns
        assert [c.key for c in columns if documented_metric(c.key) is None] == [], pipeline
        assert len({c.label for c in columns}) == len(columns), pipeline
