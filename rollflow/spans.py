"""Spans: what each process of a run spent its time on (the material of `timeline.json`).

Every process of a run (the driver, each worker) records spans — a name, a start and an end in wall-clock
seconds, the lane they belong to — into a bounded buffer of its own; nothing is sent while the run runs, so
recording costs a deque append per span. The driver gathers the workers' buffers once, when the run ends
(`WorkerGroups.gather_spans`), and `rollflow.trackers.timeline` writes them out.

Worker methods are recorded by wrapping the worker class (`traced`): every public method call is a span
named after the method, in the lane "<role> <index>". The driver records its phases with `span(...)`.
This module imports only the standard library.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

MAX_SPANS = 100_000  # per process; the oldest are dropped first (a long run keeps its last steps)
DRIVER_LANE = "driver"

# (lane, name, start, end, thread ident, args) per span, oldest first
_spans: deque[tuple[str, str, float, float, int, dict]] = deque(maxlen=MAX_SPANS)
_lane = DRIVER_LANE  # this process's lane: a worker sets its own when it starts
_calls = threading.local()  # whether a traced synchronous call runs on this thread (only the outermost is a span)


def set_lane(lane: str) -> None:
    """Name the lane this process records into (a worker: "<role> <index>")."""
    global _lane
    _lane = lane


def record(name: str, start: float, end: float, lane: str | None = None, **args: Any) -> None:
    """One span from `start` to `end` (`time.time()` seconds) in `lane` (default: this process's, as it is
    when the spans are taken: a worker's setup before its lane is set lands in the lane it is given later)."""
    _spans.append((lane, name, start, end, threading.get_ident(), args))


@contextlib.contextmanager
def span(name: str, lane: str | None = None, **args: Any) -> Iterator[None]:
    """Record the `with` block as a span named `name` (also when it raises)."""
    start = time.time()
    try:
        yield
    finally:
        record(name, start, time.time(), lane, **args)


def take() -> list[dict[str, Any]]:
    """This process's spans (oldest first), removed from its buffer."""
    taken = []
    while _spans:
        lane, name, start, end, thread, args = _spans.popleft()
        taken.append({"lane": lane or _lane, "name": name, "start": start, "end": end, "thread": thread, "args": args})
    return taken


def _outermost_call() -> bool:
    """Whether no traced call is running on this thread; if so, one is now (until `_call_done`). The nested
    functions of `traced` reach the thread-local state through module functions: Ray pickles those by
    reference, a thread-local it could not pickle at all."""
    if getattr(_calls, "active", False):
        return False
    _calls.active = True
    return True


def _call_done() -> None:
    _calls.active = False


def _method_lane(worker: Any, method: str) -> str | None:
    """The lane `worker` names for `method`'s spans, or None for the process's lane."""
    lane_of = getattr(worker, "_span_lane", None)
    return lane_of(method) if lane_of is not None else None


def traced(worker_cls: type, lane_of: Callable[..., str]) -> type:
    """A subclass of `worker_cls` whose public method calls are recorded as spans, in the lane
    `lane_of(*constructor_args)` names, with a `pop_spans()` method that hands the process's spans over (and
    empties its buffer). The constructor is a span named "start".

    Coroutine methods stay coroutines (Ray runs an actor with any as an async actor). A worker that serves
    two roles names the lane of a method's spans with `_span_lane(method) -> lane | None` (None: its own).
    """

    def wrap(name: str, method):
        if inspect.iscoroutinefunction(method):
            @functools.wraps(method)
            async def traced_coroutine(self, *args, **kwargs):
                start = time.time()
                try:
                    return await method(self, *args, **kwargs)
                finally:
                    record(name, start, time.time(), _method_lane(self, name))
            return traced_coroutine

        @functools.wraps(method)
        def traced_method(self, *args, **kwargs):
            if not _outermost_call():  # a worker method calling another: part of the outer span
                return method(self, *args, **kwargs)
            start = time.time()
            try:
                return method(self, *args, **kwargs)
            finally:
                _call_done()
                record(name, start, time.time(), _method_lane(self, name))
        return traced_method

    def __init__(self, *args, **kwargs):
        set_lane(lane_of(*args, **kwargs))
        with span("start"):
            worker_cls.__init__(self, *args, **kwargs)

    members = {"__init__": __init__, "__module__": worker_cls.__module__, "__doc__": worker_cls.__doc__}
    for name, member in inspect.getmembers(worker_cls, inspect.isfunction):
        if not name.startswith("_") and not isinstance(inspect.getattr_static(worker_cls, name), staticmethod):
            members[name] = wrap(name, member)
    is_async = any(inspect.iscoroutinefunction(m) for m in members.values())

    if is_async:
        async def pop_spans(self) -> list[dict[str, Any]]:
            return take()
    else:
        def pop_spans(self) -> list[dict[str, Any]]:
            return take()
    members["pop_spans"] = pop_spans
    return type(worker_cls.__name__, (worker_cls,), members)
