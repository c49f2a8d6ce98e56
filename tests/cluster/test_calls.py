"""Bounded waits on worker calls and their one-line errors, with tiny Ray actors: one that returns, one that
raises, one that is killed, one that sleeps past the watchdog."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import ray
import ray.cloudpickle

from rollflow.cluster import calls
from rollflow.cluster.groups import WorkerGroup
from rollflow.errors import ConfigError, RollflowError, StalledError, WorkerDiedError, WorkerError

# Actors of this module's classes get them by value: their processes then skip this module's imports (torch
# among them, ~3 s of CPU on 2 cores), which importing the class from here would cost each of them.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Worker:
    def __init__(self, index: int):
        self.index = index

    def echo(self, value):
        return value, self.index

    def fail(self):
        raise ValueError("bad value\nsecond line of the message")

    def fail_clearly(self):
        raise ConfigError("one clear line")

    def sleep(self, seconds: float, started_file: str | None = None) -> float:
        if started_file:  # tells the test that the call is running
            Path(started_file).touch()
        time.sleep(seconds)
        return seconds

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def double_rows(self, rows):
        return rows * 2


RemoteWorker = ray.remote(num_cpus=0)(Worker)


@pytest.fixture(scope="module")
def workers(ray_session):
    handles = [RemoteWorker.remote(index) for index in range(2)]
    ray.get([handle.__ray_ready__.remote() for handle in handles])
    yield handles
    for handle in handles:
        ray.kill(handle)


def _one_off_worker():
    handle = RemoteWorker.remote(0)
    ray.get(handle.__ray_ready__.remote())
    return handle


def test_results_come_back_in_order_through_the_group(workers):
    group = WorkerGroup("trainer", workers, placements=[None, None], timeout_s=60)
    assert group.call("echo", "x") == ("x", 0)
    assert group.call_all("echo", "y") == [("y", 0), ("y", 1)]
    refs = [workers[1].echo.remote("b"), workers[0].echo.remote("a")]
    assert calls.get(refs, "trainer", "echo", indices=[1, 0], timeout_s=60) == [("b", 1), ("a", 0)]
    assert calls.get([], "trainer", "echo") == []
    assert len(set(group.nodes())) == 1


def test_a_worker_exception_is_one_line_with_the_traceback_in_details(workers):
    refs = [workers[0].echo.remote(1), workers[1].fail.remote()]
    with pytest.raises(WorkerError) as raised:
        calls.get(refs, "actor_train", "train", timeout_s=60)
    error = raised.value
    assert str(error) == "actor_train worker 1 failed in train: ValueError: bad value"
    assert error.details.startswith("ray::Worker.fail()")  # the worker's process, then its traceback
    assert 'raise ValueError("bad value' in error.details and "second line of the message" in error.details
    assert error.exit_code == 1 and RollflowError.exit_code == 2


def test_a_rollflow_error_from_a_worker_is_raised_as_it_is(workers):
    with pytest.raises(ConfigError) as raised:
        calls.get([workers[0].fail_clearly.remote()], "reward", "score", timeout_s=60)
    assert type(raised.value) is ConfigError and str(raised.value) == "one clear line"


def test_the_first_failure_raises_without_waiting_for_slower_workers(workers):
    slow = _one_off_worker()
    try:
        started = time.monotonic()
        with pytest.raises(WorkerError, match="worker 1 failed in step"):
            calls.get([slow.sleep.remote(60), workers[1].fail.remote()], "critic", "step", timeout_s=120)
        assert time.monotonic() - started < 30
    finally:
        ray.kill(slow)


def test_a_killed_worker_is_reported_dead_by_role_index_and_method(ray_session, tmp_path):
    victim = _one_off_worker()
    running = victim.sleep.remote(60, str(tmp_path / "started"))
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists():  # the call is running when the process goes
        assert time.monotonic() < deadline, "the call never started"
        time.sleep(0.01)
    started = time.monotonic()
    ray.kill(victim)
    with pytest.raises(WorkerDiedError) as raised:
        calls.get([running], "actor_infer", "generate", indices=[3], timeout_s=120)
    assert time.monotonic() - started < 30
    assert str(raised.value) == "actor_infer worker 3 died during generate (killed, or out of memory?)"
    assert raised.value.details  # Ray's account of the death, for the run directory
    with pytest.raises(WorkerDiedError, match="worker 0 died during echo"):  # later calls, too
        calls.get([victim.echo.remote(1)], "actor_infer", "echo", timeout_s=60)


def test_a_worker_that_never_returns_stalls_the_wait_after_the_watchdog(workers):
    sleeper = _one_off_worker()
    try:
        started = time.monotonic()
        with pytest.raises(StalledError) as raised:
            calls.get([workers[0].echo.remote(1), sleeper.sleep.remote(60)], "actor_train", "train",
                      indices=[0, 1], timeout_s=1)
        assert time.monotonic() - started < 30  # ~2 s: a hang guard (the sleeper returns after 60 s)
        assert str(raised.value) == "no progress for 1 s: actor_train worker 1 has not returned from train"
    finally:
        ray.kill(sleeper)


def test_map_ray_error_handles_what_a_wait_loop_catches():
    clear = ConfigError("as it is")
    assert calls.map_ray_error(clear, "reward", 0, "score") is clear
    local = calls.map_ray_error(KeyError("missing"), "actor_infer", 2, "generate")
    assert isinstance(local, WorkerError) and str(local) == "actor_infer worker 2 failed in generate: KeyError: 'missing'"
    assert str(calls.stalled_error(900, "actor_infer", [2, 0], "generate")) == (
        "no progress for 900 s: actor_infer workers 0, 2 have not returned from generate")
