"""What every process of a rollflow Ray is given: the environment of the driver, the raylet and its workers
(`RAY_ENV`), and the worker setup hook that keeps each process lean (`lean_process`).

Imports only the standard library at the top (Ray inside `lean_process`): a prestarted head imports it before
Ray.
"""

from __future__ import annotations

import os
import sys

RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",  # no network here, and no telemetry anyway
    "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # rollflow assigns devices to workers itself (placement plan); Ray must not hide GPUs from 0-GPU actors.
    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
    # No idle Python workers started ahead of demand: Ray starts one per CPU, more than a run has actors on a
    # big machine, and each costs start-up CPU and ~80 MB (an actor can take one over, but is started at once
    # after Ray anyway).
    "RAY_num_prestart_python_workers": "0",
    "RAY_prestart_worker_first_driver": "0",
    # Ray starts its workers at nice 15 (to keep its own services responsive on a busy machine), so a worker
    # got a small share of a core whenever the driver or Ray's agents ran beside it: the driver checking
    # inputs while a worker imports torch, the driver scoring rewards while the trainer trains.
    "RAY_worker_niceness": "0",
    # glibc's default of 8 malloc arenas per core grows a many-threaded worker's memory for nothing (~15 MB)
    "MALLOC_ARENA_MAX": "2",
}

# Ray runs the function this variable names (a module path) in each worker process before its first task (what
# `runtime_env={"worker_process_setup_hook": ...}` sets; set directly, a local Ray's workers inherit it without
# a runtime env). Ray internals: a Ray that does not know it ignores it.
WORKER_SETUP_HOOK_VARIABLE = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"
WORKER_SETUP_HOOK = "rollflow.cluster.ray_environment.lean_process"


def is_warm_worker() -> bool:
    """Whether this process is a worker the raylet started before any job existed (`prestart.prestart_ray`'s
    warm worker): Ray gives such a worker the nil job id, all `f`s, until a job's first task or actor takes it
    over."""
    job = os.environ.get("RAY_JOB_ID", "")
    return bool(job) and set(job) == {"f"}


def lean_process() -> None:
    """Keep Ray from importing pyarrow into this process (~40 MB of RSS in each of the driver and every worker).

    Ray registers serializers for Arrow data in every process, importing pyarrow to do so whenever it is
    installed (the `data` extra's `datasets` installs it). Workers never pass Arrow objects between each other,
    so registration is left to processes that imported pyarrow themselves. Called in the driver before Ray
    starts and, as Ray's worker setup hook, in every worker of a local Ray."""
    try:
        from ray._private import arrow_serialization
    except ImportError:
        return
    register = arrow_serialization._register_custom_datasets_serializers
    if getattr(register, "only_when_loaded", False):
        return

    def register_when_loaded(context) -> None:
        if "pyarrow" in sys.modules:  # an Arrow object can only exist once pyarrow is imported
            register(context)

    register_when_loaded.only_when_loaded = True
    arrow_serialization._register_custom_datasets_serializers = register_when_loaded
