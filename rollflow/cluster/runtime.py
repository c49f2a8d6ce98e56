"""Starting or joining Ray, and pinning a process's threads to its CPU share."""

from __future__ import annotations

import logging
import os

RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",  # no network here, and no telemetry anyway
    "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
    "TOKENIZERS_PARALLELISM": "false",
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
        ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env=runtime_env,
                 logging_level=logging.WARNING, log_to_driver=True, configure_logging=True)


def stop_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
