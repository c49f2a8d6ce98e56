"""The run's warnings about itself (`rollflow.pipelines.run_health`)."""

from __future__ import annotations

from rollflow.pipelines.run_health import NO_SIGNAL_KEY, NoSignalWatch


def test_three_steps_in_a_row_without_a_signal_warn_once():
    watch = NoSignalWatch(steps=3)
    flat = {NO_SIGNAL_KEY: 1.0, "reward/mean": 0.0}
    assert watch.check(1, flat) is None
    assert watch.check(2, flat) is None
    warning = watch.check(3, flat)
    assert warning is not None and warning.startswith("steps 1-3: every group's samples got the same reward")
    assert "reward/mean 0, 0, 0" in warning
    assert watch.check(4, flat) is None  # once a run


def test_a_step_with_a_signal_starts_the_count_again():
    watch = NoSignalWatch(steps=3)
    for step, share in enumerate([1.0, 1.0, 0.75, 1.0, 1.0], start=1):
        assert watch.check(step, {NO_SIGNAL_KEY: share}) is None
    assert watch.check(6, {NO_SIGNAL_KEY: 1.0}).startswith("steps 4-6:")


def test_runs_without_the_metric_never_warn():
    watch = NoSignalWatch(steps=1)
    assert watch.check(1, {"loss": 0.3}) is None  # SFT, or an estimator without groups
