"""A worker whose constructor raises is one line on the driver, with its traceback in `details` (for
`runs/NAME/error.log`), and nothing of it printed by Ray: the constructor keeps its error
(`keeping_start_error`) instead of failing Ray's creation task, whose traceback Ray forwards to the console."""

from __future__ import annotations

import sys
import time

import pytest
import ray
import ray.cloudpickle

from rollflow.cluster.groups import WorkerStartError, spawn_group
from rollflow.cluster.placement import WorkerPlacement
from rollflow.errors import ModelLoadError

# Actors of this module's classes get them by value: their processes then skip this module's imports (torch
# among them, ~3 s of CPU on 2 cores), which importing the class from here would cost each of them.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

PLACEMENTS = [WorkerPlacement("trainer", index, (), None, (), threads=1) for index in range(2)]


class BrokenWorker:
    """Worker 1's constructor fails with a library error; worker 0 starts."""

    def __init__(self, placement, error: str):
        if placement.index == 1:
            if error == "rollflow":
                raise ModelLoadError("cannot load model from 'm': header too short")
            raise ValueError("shape mismatch\nsecond line of the message")

    def ping(self) -> str:
        return "pong"


class AsyncBrokenWorker(BrokenWorker):
    async def ping_later(self) -> str:  # one coroutine method: Ray runs it as an async actor
        return "pong"


def _dead(handle, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("worker_cls", [BrokenWorker, AsyncBrokenWorker])
def test_a_constructor_error_is_one_line_with_the_traceback_in_details(ray_session, capfd, worker_cls):
    group = spawn_group("trainer", worker_cls, PLACEMENTS, None, "library")
    try:
        with pytest.raises(WorkerStartError) as error:
            group.wait_ready()
        assert str(error.value) == "trainer: a worker failed to start: ValueError: shape mismatch"
        assert "Traceback" in error.value.details and "ValueError: shape mismatch" in error.value.details
        assert _dead(group.handles[1])  # killed at once: it was constructed only in part
        assert ray.get(group.handles[0].ping.remote()) == "pong"
    finally:
        group.close()
    time.sleep(1.5)  # Ray forwards a worker's output to the driver within about a second
    assert "Exception raised in creation task" not in capfd.readouterr().err  # Ray printed none of it


def test_a_rollflow_error_needs_no_details(ray_session):
    group = spawn_group("trainer", BrokenWorker, PLACEMENTS, None, "rollflow")
    try:
        with pytest.raises(WorkerStartError) as error:
            group.wait_ready()
    finally:
        group.close()
    # a rollflow error already says what is wrong: its message alone, without its type
    assert str(error.value) == "trainer: a worker failed to start: cannot load model from 'm': header too short"
    assert error.value.details == ""
