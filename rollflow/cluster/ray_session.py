"""Starting or joining Ray (`start_ray`), and shutting it down (`stop_ray`).

A local Ray comes with a reaper (`reaper`): a small process that, once the driver is gone (any way: normal
exit, error, signal, `kill -9`) or `stop_ray` says so, ends every process still belonging to this Ray session.
It is either started here or is the process a prestarted Ray's head ran in (`prestart`), which `start_ray`
connects to when it is the Ray asked for.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from typing import Any

from rollflow.cluster import prestart
from rollflow.cluster.head_node import DriverLogMonitor, lean_head_node
from rollflow.cluster.joining import join_ray
from rollflow.cluster.pool import forget_workers
from rollflow.cluster.ray_environment import (
    RAY_ENV,
    WORKER_SETUP_HOOK,
    WORKER_SETUP_HOOK_VARIABLE,
    lean_process,
)
from rollflow.cluster.reaper import start_reaper, stop_reaper

_reaper: subprocess.Popen | None = None  # the reaper of the local Ray this process started or connected to
_log_monitor: DriverLogMonitor | None = None  # the log monitor thread of the local Ray this process started


def start_ray(address: str | None = None, num_cpus: int | None = None) -> str:
    """Start a local Ray (no dashboard, no usage stats) or join the cluster at `address`.

    A local Ray gets a reaper (see the module docstring), so none of its processes outlives this one. A SIGTERM
    handler this process installed before (e.g. `StopSignals`) is kept. A local Ray `prestart.prestart_ray`
    started with the same `num_cpus` is connected to; one with another is ended first. From then on Ray's API
    never starts a Ray by itself in this process (`_no_auto_init`): after `stop_ray` it raises.

    Returns:
        How: "running" (Ray was already up in this process), "joined" (the cluster at `address`),
        "prestarted" (connected to the local Ray `prestart_ray` started) or "started" (a new local Ray).
    """
    global _reaper, _log_monitor
    import ray

    _no_auto_init()
    if ray.is_initialized():
        return "running"
    if _log_monitor is not None:  # the previous local Ray was shut down without `stop_ray`
        _log_monitor.stop()
        _log_monitor = None
    if _reaper is not None:
        stop_reaper(_reaper)
        _reaper = None
    os.environ.update({k: v for k, v in RAY_ENV.items() if k not in os.environ})
    # Ray announces its (default-on) token auth with a warning on every start; keep the console clean.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    runtime_env = {"env_vars": dict(RAY_ENV)}
    # ray.init replaces the SIGTERM handler with its own sys.exit; a handler the driver installed (StopSignals)
    # stays. Python handles signals in the main thread only.
    main_thread = threading.current_thread() is threading.main_thread()
    sigterm_handler = signal.getsignal(signal.SIGTERM) if main_thread else None
    if address:
        prestart.discard_prestarted_ray()
        join_ray(address, runtime_env)  # one line, within seconds, when no cluster answers
        how = "joined"
    else:
        lean_process()
        joined = _join_prestarted(num_cpus)
        if joined is None:
            os.environ.setdefault(WORKER_SETUP_HOOK_VARIABLE, WORKER_SETUP_HOOK)
            # address="local": always a new local instance, never a stray cluster another process left running
            with lean_head_node() as head:
                # no runtime_env: the local raylet and its workers inherit RAY_ENV from this process, and a job
                # runtime env costs every worker start a round trip to Ray's runtime-env agent (~0.3 s)
                context = ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                                   logging_level=logging.WARNING, log_to_driver=True, configure_logging=True)
            skipped_log_monitor = head.skipped_log_monitor
            if os.path.isdir("/proc"):  # the reaper finds the session's processes there (Linux)
                _reaper = start_reaper(context.address_info["session_dir"])
            how = "started"
        else:
            context, skipped_log_monitor = joined
            how = "prestarted"
        if skipped_log_monitor:
            _log_monitor = DriverLogMonitor(context.address_info)
            _log_monitor.start()
    if callable(sigterm_handler):
        signal.signal(signal.SIGTERM, sigterm_handler)
    return how


def _no_auto_init() -> None:
    """Have Ray's API (`ray.get`, `.remote()`, ...) raise in this process once its Ray is shut down, instead of
    starting a new local Ray by itself (Ray's auto-init): a thread still spawning workers when a stop signal made
    the driver call `stop_ray` would otherwise start a Ray that no reaper ends, and that outlives the driver."""
    try:  # a private switch (Ray 2.x): where it is gone, Ray's API may start a Ray again after `stop_ray`
        from ray._private import auto_init_hook
    except ImportError:
        return
    auto_init_hook.enable_auto_connect = False


def _join_prestarted(num_cpus: int | None) -> tuple[Any, bool] | None:
    """Connect to the Ray `prestart_ray` started if it has `num_cpus`; its process becomes this driver's reaper.
    Returns (Ray's context, whether the driver forwards the workers' output), or None (a prestarted Ray that
    failed or is not the one asked for is ended)."""
    global _reaper
    import ray

    taken = prestart.take_prestarted_ray(num_cpus)
    if taken is None:
        return None
    head, reply = taken
    if reply.get("token_auth"):  # the head's mode (RAY_AUTH_MODE, if set, is the same in both processes)
        from ray._private.authentication.authentication_token_setup import enable_token_auth_by_default

        enable_token_auth_by_default()
    try:
        context = ray.init(address=reply["gcs_address"], logging_level=logging.WARNING, log_to_driver=True,
                           configure_logging=True)
    except BaseException:
        stop_reaper(head)
        raise
    _reaper = head
    return context, reply["skipped_log_monitor"]


def stop_ray() -> None:
    """Shut Ray down; for a local instance, then have its reaper end whatever of it is left (bounded wait)."""
    global _reaper, _log_monitor
    import ray

    if _log_monitor is not None:
        _log_monitor.stop()
        _log_monitor = None
    if ray.is_initialized():
        ray.shutdown()
    forget_workers()  # the workers a pool kept ended with Ray
    if _reaper is not None:
        stop_reaper(_reaper)
        _reaper = None
    prestart.discard_prestarted_ray()
