"""Starting or joining Ray, and pinning a process's threads to its CPU share."""

from __future__ import annotations

import logging
import os

RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",  # no network here, and no telemetry anyway
    "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # rollflow assigns devices to workers itself (placement plan); Ray must not hide GPUs from 0-GPU actors.
    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
}


def pin_threads(num_cpus: float) -> int:
    """Limit torch / OpenMP / MKL threads of this process to its CPU share (at least 1).

    Oversubscribed OpenMP threads slow small ops by ~100x on a 2-core machine, so every worker calls this
    first. Returns the thread count.
    """
    import torch

    threads = max(1, int(num_cpus))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    torch.set_num_threads(threads)
    return threads


def pin_worker(threads: int, local_devices: tuple[int, ...] = (), device: str = "cpu") -> int:
    """Pin a worker process to its devices, then its threads (see `pin_threads`). Returns the thread count.

    A placed CPU worker gets CPU affinity to its slots (core `d` for local device `d`, modulo the cores this
    machine has: simulated nodes on one machine share its cores); a placed GPU worker sees only its GPUs
    (Ray is told not to set CUDA_VISIBLE_DEVICES itself, see RAY_ENV). Unplaced workers keep the machine.
    """
    if local_devices and device == "cpu" and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[d % len(cores)] for d in local_devices})
    elif local_devices and device == "gpu":
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


def start_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Start a local Ray (no dashboard, no usage stats) or join the cluster at `address`."""
    import ray

    if ray.is_initialized():
        return
    os.environ.update({k: v for k, v in RAY_ENV.items() if k not in os.environ})
    # Ray announces its (default-on) token auth with a warning on every start; keep the console clean.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    runtime_env = {"env_vars": dict(RAY_ENV)}
    if address:
        ray.init(address=address, runtime_env=runtime_env, logging_level=logging.WARNING, log_to_driver=True)
    else:
        # address="local": always a new local instance, never a stray cluster another process left running
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, runtime_env=runtime_env,
                 logging_level=logging.WARNING, log_to_driver=True, configure_logging=True)


def stop_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
