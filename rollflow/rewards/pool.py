"""Plain reward functions run off the caller's thread, each call with a time limit.

A user's reward function is arbitrary Python: it may loop forever on one odd completion. `RewardPool` runs
calls on a few daemon threads; a call that runs past `timeout_s` resolves its future with
`RewardTimeoutError` at once, and its thread is abandoned (Python cannot stop a thread) and replaced, so
the pool keeps its size and a hung call costs one sample, never the step. Abandoned threads are daemons:
they never keep the process alive at exit.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class RewardTimeoutError(TimeoutError):
    """A reward call ran past `reward.timeout_s`; its sample is marked failed."""


class RewardPool:
    """Daemon threads that run reward calls with a per-call time limit.

    Args:
        num_threads: calls that run at once (`reward.num_threads`).
        timeout_s: the limit of one call (`reward.timeout_s`), counted from when it starts running.
    """

    def __init__(self, num_threads: int = 4, timeout_s: float = 60.0):
        self.num_threads = num_threads
        self.timeout_s = timeout_s
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running: dict[int, tuple[Future, str, float]] = {}  # thread ident -> (future, label, started)
        self._abandoned: set[int] = set()
        self._closed = threading.Event()
        self.timeouts = 0
        for _ in range(num_threads):
            self._start_thread()
        threading.Thread(target=self._watch, name="rollflow-reward-watch", daemon=True).start()

    def submit(self, label: str, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Future:
        """Run `fn(*args, **kwargs)` on a pool thread. `label` names the call in a timeout's message.
        (Arguments are passed as a tuple and a dict, so a dataset column may be called anything.)"""
        future: Future = Future()
        self._calls.put((future, label, fn, args, kwargs or {}))
        return future

    def close(self) -> None:
        """Stop the threads after their current call (queued calls are cancelled). Closing again does nothing
        (combinations of a multi-domain run share one pool)."""
        if self._closed.is_set():
            return
        self._closed.set()
        while True:
            try:
                future, *_ = self._calls.get_nowait()
            except queue.Empty:
                break
            future.cancel()
        for _ in range(self.num_threads):
            self._calls.put(None)

    def _start_thread(self) -> None:
        threading.Thread(target=self._serve, name="rollflow-reward", daemon=True).start()

    def _serve(self) -> None:
        me = threading.get_ident()
        while True:
            call = self._calls.get()
            if call is None or self._closed.is_set():
                return
            future, label, fn, args, kwargs = call
            if not future.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._running[me] = (future, label, time.monotonic())
            try:
                result, error = fn(*args, **kwargs), None
            except BaseException as raised:  # noqa: BLE001 - a reward's failure belongs to its sample
                result, error = None, raised
            with self._lock:
                self._running.pop(me, None)
                if me in self._abandoned:  # timed out meanwhile: the future is settled, a new thread serves
                    self._abandoned.discard(me)
                    return
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

    def _watch(self) -> None:
        """Fail calls that ran past the limit and replace their threads."""
        interval = min(0.05, self.timeout_s / 10)
        while not self._closed.wait(interval):
            now = time.monotonic()
            with self._lock:
                late = [(ident, future, label) for ident, (future, label, started) in self._running.items()
                        if now - started > self.timeout_s]
                for ident, _, _ in late:
                    self._running.pop(ident)
                    self._abandoned.add(ident)
            for _, future, label in late:
                self.timeouts += 1
                future.set_exception(RewardTimeoutError(
                    f"reward {label!r} timed out after {self.timeout_s:g} s (reward.timeout_s)"))
                self._start_thread()
