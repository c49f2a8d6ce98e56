"""`LoopThread` on CPU, with two stand-ins for the libraries it serves: one created inside a coroutine and
bound to the loop running it (as vLLM's `AsyncLLM` is), one that makes its own loop in its constructor and
runs it from synchronous methods (as `sglang.Engine` does)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

import rollflow.engines.loop_thread as loop_thread_module
from rollflow.engines.loop_thread import LoopThread


class _BoundToRunningLoop:
    """Like vLLM's `AsyncLLM`: built inside a coroutine, bound to the loop that runs it."""

    def __init__(self):
        self.bound_loop = asyncio.get_running_loop()  # RuntimeError when built outside a running loop
        self.thread = threading.current_thread()
        self.gate = asyncio.Event()

    async def echo(self, value):
        if asyncio.get_running_loop() is not self.bound_loop:
            raise RuntimeError("called on another loop")
        return value, threading.current_thread() is self.thread

    async def wait_for_gate(self, value):
        await self.gate.wait()
        return value

    async def fail(self):
        raise ValueError("bad request")

    async def abort_on_cancel(self):
        """Like the vllm engine's `_generate`: a cancellation ends the request with what it had."""
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return "aborted"

    async def stop_loop_and_hang(self):
        asyncio.get_running_loop().stop()  # the loop's owner can no longer run it: the thread dies
        await asyncio.Event().wait()


async def _build_bound():
    return _BoundToRunningLoop()


class _LoopOwner:
    """Uses its event loop the way sglang.Engine does: created (and set current) in the constructor's
    thread when none is running; sync methods call `loop.run_until_complete`; async ones run on it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.gate = asyncio.Event()
        self.thread = threading.current_thread()
        self.ticks = 0
        self.ticking = True

    async def wait_for_gate(self, value):
        await self.gate.wait()
        return value, threading.current_thread() is self.thread

    def open_gate(self):
        async def run():
            self.gate.set()
            await asyncio.sleep(0.01)  # the waiting coroutine finishes inside this run_until_complete
            return "opened"

        return self.loop.run_until_complete(run())

    async def tick(self):
        while self.ticking:
            self.ticks += 1
            await asyncio.sleep(0.001)
        return self.ticks

    def busy(self):
        """A synchronous method that runs the loop for a while; returns how far `tick` got meanwhile."""
        before = self.ticks
        self.loop.run_until_complete(asyncio.sleep(0.05))
        return self.ticks - before

    def stop_ticking(self):
        self.ticking = False


def _no_running_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return True
    return False


# ---- an object that brings its own loop (sglang.Engine) ------------------------------------------------
def test_loop_thread_keeps_coroutines_running_across_synchronous_calls():
    driver = LoopThread(_LoopOwner)
    try:
        pending = driver.submit(driver.instance.wait_for_gate("done"))
        assert not pending.done()
        assert driver.call(driver.instance.open_gate) == "opened"  # a sync method, from another thread
        assert pending.result(timeout=5) == ("done", True)  # ran on the engine's own thread and loop
        assert driver.call(lambda: 42) == 42  # later calls still served
        with pytest.raises(ZeroDivisionError):
            driver.call(lambda: 1 / 0)
    finally:
        driver.close()
    assert not driver.thread.is_alive()
    driver.instance.loop.close()  # the object's own loop, left to it by close()


def test_an_in_flight_coroutine_advances_inside_a_synchronous_call_and_finishes_after_it():
    driver = LoopThread(_LoopOwner, name="owner")
    owner = driver.instance
    try:
        assert driver.loop is owner.loop
        ticker = driver.submit(owner.tick())
        assert driver.call(owner.busy) > 0  # ticked while the sync method ran the loop
        assert driver.call(_no_running_loop)  # calls run between runs of the loop, on the object's thread
        assert driver.call(threading.current_thread) is owner.thread is driver.thread
        driver.call_soon(owner.stop_ticking).result(timeout=5)
        assert ticker.result(timeout=5) == owner.ticks > 0
    finally:
        driver.close()
    assert not driver.thread.is_alive()
    assert not owner.loop.is_closed()  # the object's own loop is left to it
    owner.loop.close()


def test_loop_thread_reports_a_failing_constructor():
    def broken():
        raise OSError("no GPU")

    with pytest.raises(OSError, match="no GPU"):
        LoopThread(broken)


def test_a_plain_factory_must_bring_its_loop():
    with pytest.raises(TypeError, match=r"\.loop"):
        LoopThread(object)


# ---- an object created inside a coroutine (vLLM's AsyncLLM) ------------------------------------------
def test_async_factory_builds_the_object_on_the_loop_the_thread_runs():
    driver = LoopThread(_build_bound, name="bound")
    bound = driver.instance
    try:
        assert bound.bound_loop is driver.loop and bound.thread is driver.thread
        assert driver.run(bound.echo("x")) == ("x", True)
        waiting = driver.submit(bound.wait_for_gate("opened"))
        assert not waiting.done()
        driver.call_soon(bound.gate.set)  # thread-safe, inside the running loop
        assert waiting.result(timeout=5) == "opened"
        assert driver.call(_no_running_loop)
        with pytest.raises(ValueError, match="bad request"):  # the coroutine's exception reaches run()
            driver.run(bound.fail())
        with pytest.raises(ZeroDivisionError):  # a callback's exception lands on its future
            driver.call_soon(lambda: 1 / 0).result(timeout=5)
    finally:
        driver.close()
    assert not driver.thread.is_alive()
    assert driver.loop.is_closed()  # the thread made this loop, so it closes it
    with pytest.raises(RuntimeError, match="closed"):
        driver.submit(bound.echo("late"))
    with pytest.raises(RuntimeError, match="closed"):
        driver.call(lambda: 1)
    with pytest.raises(RuntimeError, match="closed"):
        driver.call_soon(print)
    driver.close()  # idempotent


def test_an_async_factory_failure_reaches_the_constructor():
    async def broken():
        raise OSError("no GPU")

    with pytest.raises(OSError, match="no GPU"):
        LoopThread(broken)


def test_close_resolves_the_coroutines_still_on_the_loop():
    driver = LoopThread(_build_bound)
    hanging = driver.submit(driver.instance.wait_for_gate("never"))
    aborting = driver.submit(driver.instance.abort_on_cancel())
    driver.close()
    with pytest.raises(concurrent.futures.CancelledError):
        hanging.result(timeout=5)
    assert aborting.result(timeout=5) == "aborted"


def test_waits_are_bounded_and_the_thread_cannot_wait_for_itself():
    driver = LoopThread(_build_bound)
    try:
        hanging = driver.instance.wait_for_gate("never")
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            driver.run(hanging, timeout_s=0.1)
        with pytest.raises(TimeoutError):
            driver.call(lambda: time.sleep(0.5), timeout_s=0.1)
        assert time.monotonic() - started < 10  # ~0.2 s: a hang guard (the gate never opens)
        with pytest.raises(RuntimeError, match="deadlock"):
            driver.call(lambda: driver.run(driver.instance.echo("x")))
        with pytest.raises(RuntimeError, match="deadlock"):
            driver.call(lambda: driver.call(lambda: 1))
        assert driver.run(driver.instance.echo("still served"), timeout_s=5) == ("still served", True)
    finally:
        driver.close()


def test_a_dead_loop_thread_fails_its_waiters_and_refuses_new_work():
    driver = LoopThread(_build_bound)
    pending = driver.submit(driver.instance.wait_for_gate("never"))
    driver.submit(driver.instance.stop_loop_and_hang())
    driver.thread.join(timeout=10)
    assert not driver.thread.is_alive()
    with pytest.raises(concurrent.futures.CancelledError):  # cancelled on the way out, not left hanging
        pending.result(timeout=5)
    with pytest.raises(RuntimeError, match="died") as raised:
        driver.call(lambda: 1)
    assert "stopped" in str(raised.value.__cause__)  # the crash: the loop stopped under run_until_complete
    driver.close()


def test_a_waiter_notices_a_thread_that_ended_without_resolving_it(monkeypatch):
    """The liveness check behind every unbounded wait, with the clean-up on the way out switched off."""
    monkeypatch.setattr(loop_thread_module, "LIVENESS_POLL_S", 0.05)
    monkeypatch.setattr(LoopThread, "_shut_down", lambda self, loop, owns_loop: None)
    driver = LoopThread(_build_bound)
    with pytest.raises(RuntimeError, match="ended before the coroutine finished"):
        driver.run(driver.instance.stop_loop_and_hang())
    tasks = asyncio.all_tasks(driver.loop)  # the clean-up the test switched off, so the loop closes quietly
    for task in tasks:
        task.cancel()
    driver.loop.run_until_complete(asyncio.wait(tasks))
    driver.loop.close()


def test_run_async_reports_a_dying_thread_instead_of_a_bare_cancellation():
    """A waiter on another loop (a Ray actor's) learns that the thread died or closed under it; its own
    cancellation still reaches it as one."""
    driver = LoopThread(_build_bound)

    async def caller():
        assert await driver.run_async(driver.instance.echo("x")) == ("x", True)
        with pytest.raises(ValueError, match="bad request"):
            await driver.run_async(driver.instance.fail())
        own = asyncio.ensure_future(driver.run_async(driver.instance.wait_for_gate("never")))
        await asyncio.sleep(0.05)
        own.cancel()
        with pytest.raises(asyncio.CancelledError):
            await own
        pending = asyncio.ensure_future(driver.run_async(driver.instance.wait_for_gate("never")))
        await asyncio.sleep(0.05)
        driver.submit(driver.instance.stop_loop_and_hang())
        with pytest.raises(RuntimeError, match="died") as raised:
            await asyncio.wait_for(pending, timeout=10)
        assert "stopped" in str(raised.value.__cause__)

    asyncio.run(caller())
    driver.close()

    closing = LoopThread(_build_bound)

    async def closed_under_it():
        pending = asyncio.ensure_future(closing.run_async(closing.instance.wait_for_gate("never")))
        await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, closing.close)
        with pytest.raises(RuntimeError, match="closed before"):
            await asyncio.wait_for(pending, timeout=10)

    asyncio.run(closed_under_it())
