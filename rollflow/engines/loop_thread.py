"""`LoopThread`: an object built on a private thread that drives its event loop (for loop-bound libraries).

vLLM's `AsyncLLM` binds to the event loop it is created on; `sglang.Engine` makes its own loop and its
synchronous methods call `loop.run_until_complete(...)` on it. Either way the engine protocol's synchronous
methods (`abort`, `update_weights`, `sleep`, `wake`) are called from inside a Ray async actor's running
loop, where neither library can be used directly. So the library object lives on a thread of its own, and
every call reaches it through this class:

- `submit(coroutine)` / `run(coroutine)` run a coroutine on the object's loop, and `run_async(coroutine)`
  awaits one from another event loop;
- `call_soon(callback, *args)` schedules a plain callback inside the running loop;
- `call(function)` runs a synchronous function on the thread *between* runs of the loop, so a library
  method that does `loop.run_until_complete(...)` works, and coroutines already on the loop keep running
  inside that call.

The thread runs the loop with `run_until_complete(wakeup.wait())` and stops it only when `call` hands over a
function, then runs the loop again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any

logger = logging.getLogger(__name__)

# How often a wait without a time limit checks that the thread is still alive.
LIVENESS_POLL_S = 1.0
# At close, how long coroutines still on the loop get to finish after being cancelled.
CANCEL_GRACE_S = 5.0
_STOP = object()  # close()'s marker in the call queue


class LoopThread:
    """Builds an object on a private thread and runs its event loop there.

    Waits without a time limit (`timeout_s=None`, the default) check every `LIVENESS_POLL_S` that the thread
    is alive, so a crashed thread surfaces as an error instead of a hang; they have no default bound
    because starting a GPU engine or loading a model's weights takes minutes that grow with the model.

    Args:
        factory: builds the object, called on the new thread with no event loop running. Either an async
            function (or any callable returning a coroutine): the thread makes a fresh loop, sets it as the
            thread's current loop and runs the coroutine on it, for objects that bind to the running loop
            (vLLM's `AsyncLLM`); or a plain function whose result carries the loop it made as `.loop`
            (`sglang.Engine`).
        name: the thread's name.
        start_timeout_s: most seconds to wait for `factory`; None waits while the thread is alive.

    Raises:
        Whatever `factory` raised; TypeError when a plain factory's result has no `.loop`.
    """

    def __init__(self, factory: Callable[[], Any], name: str = "rollflow-loop",
                 start_timeout_s: float | None = None):
        self.name = name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = asyncio.Event()  # binds to the thread's loop on its first wait (Python >= 3.10)
        self._lock = threading.Lock()  # orders submit/call/call_soon against the shutdown sweep
        self._closed = False
        self._crash: BaseException | None = None  # why the thread ended, when it was not close()
        self._submitted: set[Future] = set()  # futures of coroutines still on the loop
        ready: Future = Future()
        self.thread = threading.Thread(target=self._main, args=(factory, ready), name=name, daemon=True)
        self.thread.start()
        built = self._wait(ready, start_timeout_s, "building the object")
        self.instance: Any = built[0]  # what `factory` built
        self.loop: asyncio.AbstractEventLoop = built[1]

    @property
    def crash(self) -> BaseException | None:
        """Why the thread died; None while it runs or after a clean `close()`."""
        return self._crash

    # ---- callers' side -------------------------------------------------------------------------------
    def submit(self, coroutine: Coroutine) -> Future:
        """Schedule `coroutine` on the thread's loop (from any thread).

        Returns:
            Its future: the coroutine's result or exception; cancelled, or failed with RuntimeError, when the
            thread closes or dies before the coroutine finishes.
        """
        with self._lock:
            if self._closed:
                coroutine.close()  # never awaited: silence "coroutine was never awaited"
                self._raise_closed()
            future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
            self._submitted.add(future)
        future.add_done_callback(self._forget)
        return future

    def run(self, coroutine: Coroutine, timeout_s: float | None = None) -> Any:
        """Run `coroutine` on the thread's loop and wait for its result; not from the thread itself.

        Raises:
            The coroutine's exception; TimeoutError after `timeout_s` (the coroutine is then cancelled);
            RuntimeError when the thread is closed or dies.
        """
        self._refuse_own_thread("run", coroutine)
        future = self.submit(coroutine)
        try:
            return self._wait(future, timeout_s, "the coroutine")
        except TimeoutError:
            future.cancel()
            raise

    async def run_async(self, coroutine: Coroutine) -> Any:
        """Run `coroutine` on the thread's loop and await its result from another event loop.

        Raises:
            The coroutine's exception; RuntimeError when the thread dies or closes before it finishes (its
            clean-up cancels what is left on the loop: the caller learns why, not just "cancelled").
        """
        future = self.submit(coroutine)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            cancelling = getattr(task, "cancelling", lambda: 0)()  # Python >= 3.11: our caller cancels us
            if not (future.cancelled() and self._closed and not cancelling):
                raise
            if self._crash is not None:
                raise RuntimeError(f"{self.name}: the loop thread died") from self._crash
            raise RuntimeError(f"{self.name}: the loop thread closed before the coroutine finished") from None

    def call_soon(self, callback: Callable[..., Any], *args: Any) -> Future:
        """Schedule `callback(*args)` inside the running loop (thread-safe); returns without waiting.

        Returns:
            A future of the callback's result or exception, for callers that want it; an exception nobody
            collects is also logged.
        """
        future: Future = Future()

        def run_callback() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(callback(*args))
            except BaseException as err:  # fire-and-forget callers never look at the future: log it too
                logger.exception("%s: %r failed", self.name, callback)
                future.set_exception(err)

        with self._lock:
            if self._closed:
                self._raise_closed()
            self.loop.call_soon_threadsafe(run_callback)
        return future

    def call(self, function: Callable[[], Any], timeout_s: float | None = None) -> Any:
        """Run a synchronous `function` on the thread, outside the running loop, and wait for its result.

        Coroutines on the loop pause until `function` runs the loop itself (`loop.run_until_complete`) or
        returns. Not from the thread itself.

        Raises:
            The function's exception; TimeoutError after `timeout_s` (a function already running is not
            interrupted; one still queued is dropped); RuntimeError when the thread is closed or dies.
        """
        self._refuse_own_thread("call")
        future: Future = Future()
        with self._lock:
            if self._closed:
                self._raise_closed()
            self._calls.put((function, future))
            self.loop.call_soon_threadsafe(self._wakeup.set)
        try:
            return self._wait(future, timeout_s, "the call")
        except TimeoutError:
            future.cancel()
            raise

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the loop and end the thread (idempotent).

        Calls queued before this one still run. Coroutines still on the loop are cancelled, given
        `CANCEL_GRACE_S` to finish, and any left after that fail with RuntimeError, so no caller waits
        forever. A loop the thread made for an async factory is closed; a loop the object brought is left
        open (it belongs to the object).

        Raises:
            TimeoutError when the thread has not ended within `timeout_s` (it is a daemon thread, so it does
            not keep the process alive).
        """
        stopped: Future | None = None
        with self._lock:
            if not self._closed:
                self._closed = True
                stopped = Future()
                self._calls.put((_STOP, stopped))
                self.loop.call_soon_threadsafe(self._wakeup.set)
        deadline = time.monotonic() + timeout_s
        if stopped is not None and self.thread.is_alive():
            try:
                stopped.result(timeout=timeout_s)
            except concurrent.futures.TimeoutError:
                pass  # reported below, with the join
        self.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive():
            raise TimeoutError(f"{self.name}: the loop thread did not end within {timeout_s} s")

    # ---- the thread ----------------------------------------------------------------------------------
    def _main(self, factory: Callable[[], Any], ready: Future) -> None:
        try:
            instance, loop, owns_loop = _build(factory)
        except BaseException as err:  # hand the failure to the constructor's thread
            ready.set_exception(err)
            return
        ready.set_result((instance, loop))
        stopped: Future | None = None
        try:
            stopped = self._serve(loop)
        except BaseException as err:  # kept for the callers' errors (see `_wait`), not re-raised here
            self._crash = err
            logger.exception("%s: the loop thread died", self.name)
        finally:
            self._shut_down(loop, owns_loop)
            if stopped is not None:
                stopped.set_result(None)

    def _serve(self, loop: asyncio.AbstractEventLoop) -> Future:
        """Run the loop until a call arrives, make the queued calls, repeat; returns close()'s future."""
        while True:
            loop.run_until_complete(self._wakeup.wait())
            self._wakeup.clear()  # before draining: a call queued from now on sets it again
            while True:
                try:
                    function, future = self._calls.get_nowait()
                except queue.Empty:
                    break
                if function is _STOP:
                    return future
                if not future.set_running_or_notify_cancel():  # the caller gave up (timeout)
                    continue
                try:
                    future.set_result(function())
                except BaseException as err:
                    future.set_exception(err)

    def _shut_down(self, loop: asyncio.AbstractEventLoop, owns_loop: bool) -> None:
        """Resolve everything still waiting on this thread, then close the loop if the thread made it."""
        with self._lock:
            self._closed = True
        try:
            if not loop.is_closed() and not loop.is_running():
                tasks = [task for task in asyncio.all_tasks(loop) if not task.done()]
                for task in tasks:
                    task.cancel()
                if tasks:  # let them see the cancellation (cleanup code, vLLM's abort-on-cancel)
                    loop.run_until_complete(asyncio.wait(tasks, timeout=CANCEL_GRACE_S))
        except BaseException:
            logger.exception("%s: cancelling the coroutines left on the loop failed", self.name)
        finally:
            error = RuntimeError(f"{self.name}: the loop thread ended before this finished")
            with self._lock:
                left = list(self._submitted)
            for future in left:  # outside the lock: their done callbacks (`_forget`) take it
                if not future.done():
                    future.set_exception(error)
            while True:
                try:
                    function, future = self._calls.get_nowait()
                except queue.Empty:
                    break
                if function is _STOP:  # close() raced with a crash: it only waits for the thread to end
                    future.set_result(None)
                elif future.set_running_or_notify_cancel():
                    future.set_exception(error)
            if owns_loop and not loop.is_closed():
                loop.close()

    # ---- helpers -------------------------------------------------------------------------------------
    def _wait(self, future: Future, timeout_s: float | None, what: str) -> Any:
        """`future.result()`, bounded by `timeout_s` and, without one, by the thread staying alive."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = LIVENESS_POLL_S if deadline is None else min(LIVENESS_POLL_S,
                                                                    deadline - time.monotonic())
            if remaining <= 0:
                raise TimeoutError(f"{self.name}: {what} did not finish within {timeout_s} s")
            try:
                return future.result(timeout=remaining)
            except concurrent.futures.TimeoutError:
                if not self.thread.is_alive() and not future.done():
                    raise RuntimeError(f"{self.name}: the loop thread ended before {what} finished"
                                       ) from self._crash

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._submitted.discard(future)

    def _raise_closed(self) -> None:
        if self._crash is not None:
            raise RuntimeError(f"{self.name}: the loop thread died") from self._crash
        raise RuntimeError(f"{self.name}: the loop thread is closed")

    def _refuse_own_thread(self, method: str, coroutine: Coroutine | None = None) -> None:
        if threading.current_thread() is self.thread:  # it would wait for itself forever
            if coroutine is not None:
                coroutine.close()  # never awaited: silence "coroutine was never awaited"
            raise RuntimeError(f"{self.name}: {method}() from the loop thread itself would deadlock")


def _build(factory: Callable[[], Any]) -> tuple[Any, asyncio.AbstractEventLoop, bool]:
    """Call `factory` on this thread. Returns (object, its loop, whether this thread made the loop)."""
    made = factory()
    if inspect.iscoroutine(made):
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            return loop.run_until_complete(made), loop, True
        except BaseException:
            loop.close()
            raise
    loop = getattr(made, "loop", None)
    if not isinstance(loop, asyncio.AbstractEventLoop):
        raise TypeError(f"LoopThread's factory built a {type(made).__name__} without a `.loop` event loop; "
                        "pass an async factory to create the object on a loop the thread makes")
    return made, loop, False
