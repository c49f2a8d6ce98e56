"""Pinning a process's threads (and devices) to its share of the machine, and facts about this process: its
memory use, a free port.

Ray's own start and end are elsewhere: `ray_session` (start_ray, stop_ray), `prestart` (a Ray started ahead of
time), `reaper` (no Ray process outlives its driver).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")  # what `pin_threads` sets
# the cores this process was started with, before any `pin_worker`: what a placement's core `d` indexes, and what
# a worker kept for another run (`rollflow.cluster.pool`) gets back when that run does not place it
PROCESS_CORES = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()


def pin_threads(num_cpus: float) -> int:
    """Limit torch / OpenMP / MKL threads of this process to its CPU share (at least 1).

    Oversubscribed OpenMP threads slow small ops by ~100x on a 2-core machine, so every worker calls this
    first. Returns the thread count.
    """
    import torch

    threads = max(1, int(num_cpus))
    for var in THREAD_VARIABLES:
        os.environ[var] = str(threads)
    torch.set_num_threads(threads)
    return threads


@contextlib.contextmanager
def pinned_threads(num_cpus: float) -> Iterator[int]:
    """`pin_threads(num_cpus)` for a block, or as a decorator for a call: afterwards (returned or raised) the
    caller's torch thread count and thread variables are back. A pipeline's driver runs under it, so a
    notebook that calls `run_rlvr` keeps its own threads.

    Yields:
        The thread count, as `pin_threads` returns it.
    """
    import torch

    threads, variables = torch.get_num_threads(), {var: os.environ.get(var) for var in THREAD_VARIABLES}
    try:
        yield pin_threads(num_cpus)
    finally:
        torch.set_num_threads(threads)
        for var, value in variables.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def pin_worker(threads: int, local_devices: tuple[int, ...] = (), device: str = "cpu") -> int:
    """Pin a worker process to its devices, then its threads (see `pin_threads`). Returns the thread count.

    A placed CPU worker gets CPU affinity to its slots (core `d` for local device `d`, modulo the cores this
    machine has: simulated nodes on one machine share its cores); a placed GPU worker sees only its GPUs
    (Ray is told not to set CUDA_VISIBLE_DEVICES itself, see `ray_environment.RAY_ENV`). Unplaced workers keep
    the cores the process started with (again, when a kept worker was pinned by an earlier run).
    """
    if PROCESS_CORES and hasattr(os, "sched_setaffinity"):
        cores = sorted(PROCESS_CORES)
        wanted = ({cores[d % len(cores)] for d in local_devices} if local_devices and device == "cpu"
                  else set(PROCESS_CORES))
        if wanted != os.sched_getaffinity(0):
            os.sched_setaffinity(0, wanted)
    if local_devices and device == "gpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, local_devices))
    return pin_threads(threads)


def memory_usage() -> tuple[int, int]:
    """(resident host memory of this process, accelerator memory allocated by torch) in bytes."""
    import torch

    rss = 0
    try:
        with open("/proc/self/statm") as statm:
            rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        pass  # not Linux: report 0 rather than fail a phase
    device = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    return rss, device


def free_port() -> int:
    """A TCP port that is free on this host now (for a torch.distributed rendezvous)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
