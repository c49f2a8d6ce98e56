"""Ctrl-C and SIGTERM in a driver: stop at once, but never in the middle of a step's update.

`StopSignals` turns SIGINT and SIGTERM into `Interrupted`, raised in the driver's main thread. Inside a
`critical()` section (a step's train + weight sync + log + checkpoint) the first signal waits for the section
to finish, so the trainer, the engines, the logs and the checkpoints all stay at the same finished step; a
second signal raises at once, even there (the way out of a hung section).

A signal that arrives while the driver waits in `ray.get` comes out of it as a plain `KeyboardInterrupt` (Ray
replaces the handler's exception); inside the `with` block catch `KeyboardInterrupt`, which covers both. What
leaves the block is always `Interrupted`, carrying the signal.

    with StopSignals() as stop:
        try:
            for step in steps:
                generate(...)               # interruptible: nothing of the step is kept yet
                with stop.critical():
                    train(...); sync(...); log(...)
        except KeyboardInterrupt:
            save(...)                       # a second signal cuts this short
            raise                           # leaves the `with` as Interrupted
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A stop signal reached the driver. A `BaseException` (through `KeyboardInterrupt`), so library code's
    `except Exception` does not swallow it.

    Attributes:
        signal_number: the signal, e.g. `signal.SIGTERM`.
        signal_name: its name, e.g. "SIGTERM".
        exit_status: what the process should exit with: 128 + the signal (130 for SIGINT, 143 for SIGTERM).
    """

    def __init__(self, signal_number: int):
        self.signal_number = signal_number
        self.signal_name = signal.Signals(signal_number).name
        self.exit_status = 128 + signal_number
        super().__init__(self.signal_name)


class StopSignals:
    """Raise `Interrupted` on SIGINT / SIGTERM while the `with` block runs; the previous handlers come back at
    its end, and a plain `KeyboardInterrupt` leaving the block after a signal becomes `Interrupted`. Installs
    nothing outside the main thread (Python delivers signals only there): there it is a no-op, and
    `critical()` too.

    Attributes:
        received: the signals received so far, in order.
    """

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS):
        self.signals = signals
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}
        self._critical_depth = 0
        self._deferred: int | None = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {number: signal.signal(number, self._handle) for number in self.signals}
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: Any) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}
        if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, Interrupted) and self.received:
            # Ray's `ray.get` turns any exception of a signal handler into a plain KeyboardInterrupt
            raise Interrupted(self.received[-1]) from exc

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        """A section the first stop signal does not cut: it raises `Interrupted` when the section ends (unless
        the section raised something else, which then goes on). Sections nest."""
        self._critical_depth += 1
        try:
            yield
        finally:
            self._critical_depth -= 1
        if self._critical_depth == 0 and self._deferred is not None:
            number, self._deferred = self._deferred, None
            raise Interrupted(number)

    def _handle(self, number: int, frame: FrameType | None) -> None:
        self.received.append(number)
        if self._critical_depth and len(self.received) == 1:
            self._deferred = number  # the step finishes first
            return
        raise Interrupted(number)
