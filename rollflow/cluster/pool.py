"""Role workers kept running between the runs of one process, and adopted by the next run that needs the same
worker (`keep_workers`).

Starting a role worker costs its process's imports (torch, transformers: ~7-10 s of CPU on a small machine)
before it builds anything; a run of a few steps on a tiny model costs less than that. A process that runs many
short runs in one Ray session (a test session, a sweep from a notebook) can keep the workers a run is done
with: at the end of a run each worker still alive is `close()`d as usual, then parked here instead of being
killed, and the next run's worker of the same shape (same worker class and role) rebuilds itself
in that process (`rebuild_worker`: its constructor again, on an emptied object) instead of a new process
starting. What a constructor sets is set again; what the process imported stays imported.

Only workers scheduled without a placement group are kept: unplaced ones (the CPU default), simulated GPUs,
and placed ones on a cluster of one node, where the run's placement group only reserves the devices
(`WorkerGroups.spawn`). On several nodes the placement group schedules the workers, and they go with it. A
kept CPU worker is pinned to the cores of its new placement (`rollflow.cluster.runtime.pin_worker`); a GPU
worker serves only a placement on the same local GPUs (the devices are part of its key). At most `max_idle`
workers wait at a time (each holds a process with torch imported, ~0.5 GiB); the one idle longest is killed
to make room. Ray's end (`rollflow.cluster.ray_session.stop_ray`) forgets them all.
"""

from __future__ import annotations

import contextlib
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterator
from typing import Any

DEFAULT_MAX_IDLE = 6

_pool: WorkerPool | None = None


class WorkerPool:
    """Idle workers by key, the longest idle first; counts what it handed out.

    Attributes:
        adopted: how many workers a run took from here instead of starting one.
        started: how many workers a run started because none here fitted.
        started_keys: those starts by key (worker class, role, devices): which shapes cost a process.
        evicted: how many idle workers were killed to make room (`max_idle`).
        parked: how many workers a run left here.
    """

    def __init__(self, max_idle: int = DEFAULT_MAX_IDLE):
        if max_idle < 1:
            raise ValueError(f"max_idle must be at least 1, got {max_idle}")
        self.max_idle = max_idle
        self.idle: OrderedDict[int, tuple[Hashable, Any]] = OrderedDict()  # ticket -> (key, actor handle)
        self._tickets = 0
        self.adopted = 0
        self.started = 0
        self.started_keys: Counter[Hashable] = Counter()
        self.parked = 0
        self.evicted = 0

    def take(self, key: Hashable) -> Any | None:
        """An idle worker of `key` (no longer idle), or None (counted in `started`: the caller starts one)."""
        for ticket, (held_key, handle) in self.idle.items():
            if held_key == key:
                del self.idle[ticket]
                self.adopted += 1
                return handle
        self.started += 1
        self.started_keys[key] += 1
        return None

    def park(self, key: Hashable, handle: Any) -> None:
        """Keep `handle` (a closed worker) for the next run that needs a worker of `key`; kill the longest idle
        beyond `max_idle`."""
        import ray

        self._tickets += 1
        self.idle[self._tickets] = (key, handle)
        self.parked += 1
        while len(self.idle) > self.max_idle:
            _, (_, oldest) = self.idle.popitem(last=False)
            ray.kill(oldest)
            self.evicted += 1

    def clear(self, kill: bool = True) -> None:
        """Kill every idle worker (`kill=False`: only forget them, Ray has ended)."""
        idle, self.idle = list(self.idle.values()), OrderedDict()
        if kill:
            import ray

            for _, handle in idle:
                with contextlib.suppress(Exception):
                    ray.kill(handle)


def worker_pool() -> WorkerPool | None:
    """The pool runs of this process park their workers in, or None when they are killed at the end."""
    return _pool


@contextlib.contextmanager
def keep_workers(max_idle: int = DEFAULT_MAX_IDLE) -> Iterator[WorkerPool]:
    """Within the block, runs keep their workers for the next run of the same shape (module docstring); on the
    way out the idle ones are killed. For many short runs in one Ray session (`manage_ray=False`):

        with keep_workers():
            for lr in (1e-4, 3e-4):
                run_rlvr(load_config("examples/quickstart.yaml", [f"train.lr={lr}"]), manage_ray=False)
    """
    global _pool
    if _pool is not None:  # nested: the outer block's pool
        yield _pool
        return
    _pool = WorkerPool(max_idle)
    try:
        yield _pool
    finally:
        pool, _pool = _pool, None
        pool.clear()


def forget_workers() -> None:
    """Drop the idle workers without killing them: Ray has ended, and they with it."""
    if _pool is not None:
        _pool.clear(kill=False)
