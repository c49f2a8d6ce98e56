"""`EnvThread`: one daemon thread that runs one env's calls in order. The env workers (a slot each) and the env
server (a session each) run every env on one, so envs need not be thread-safe, one slow env never blocks
another, and a hung call strands only its own thread (a daemon: it never holds up the process's exit)."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any


class EnvThread:
    """Runs the calls submitted to it, in order, on a daemon thread of its own.

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str):
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Queue `fn`; its future holds its result or its exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.calls.put((fn, future))
        return future

    def stop(self) -> None:
        """End the thread after the calls already queued."""
        self.calls.put(None)

    def _serve(self) -> None:
        while (item := self.calls.get()) is not None:
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as err:  # noqa: BLE001  (every env error goes back to its caller)
                future.set_exception(err)
