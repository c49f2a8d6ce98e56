"""`EngineLifecycle`: the sleep / wake / close state machine the three engines share, without an engine."""

from __future__ import annotations

import pytest

from rollflow.engines.lifecycle import EngineLifecycle


def test_sleep_and_wake_are_idempotent_and_guard_generate():
    lifecycle, calls = EngineLifecycle(), []
    lifecycle.check_can_generate()  # awake: no error
    lifecycle.sleep(lambda: calls.append("release"), weights_released=True)
    lifecycle.sleep(lambda: calls.append("release again"), weights_released=True)  # already asleep
    with pytest.raises(RuntimeError, match="asleep; call wake"):
        lifecycle.check_can_generate()
    assert lifecycle.tags_to_resume() is None  # weights released: bring everything back
    lifecycle.wake(lambda: calls.append("resume"))
    lifecycle.wake(lambda: calls.append("resume again"))  # already awake
    assert calls == ["release", "resume"]
    assert not lifecycle.asleep and lifecycle.weights_resident
    lifecycle.check_can_generate()


def test_a_weight_load_while_asleep_leaves_only_the_kv_cache_to_resume():
    lifecycle = EngineLifecycle()
    lifecycle.sleep(lambda: None, weights_released=True)
    lifecycle.weights_resident = True  # what an engine's weight load does while asleep
    assert lifecycle.tags_to_resume() == ["kv_cache"]
    lifecycle.sleep(lambda: None, weights_released=False)  # still asleep: nothing changes
    assert lifecycle.weights_resident


def test_a_failing_release_leaves_the_engine_awake():
    lifecycle = EngineLifecycle()

    def release():
        raise OSError("device busy")

    with pytest.raises(OSError):
        lifecycle.sleep(release, weights_released=True)
    assert not lifecycle.asleep and lifecycle.weights_resident


def test_close_once_then_every_use_is_refused():
    lifecycle = EngineLifecycle()
    assert lifecycle.close() is True
    assert lifecycle.close() is False  # the engine's close() runs its shutdown once
    for use in (lifecycle.check_can_generate, lifecycle.check_open,
                lambda: lifecycle.sleep(lambda: None, weights_released=True),
                lambda: lifecycle.wake(lambda: None)):
        with pytest.raises(RuntimeError, match="closed"):
            use()
