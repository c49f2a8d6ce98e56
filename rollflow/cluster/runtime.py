"""Starting or joining Ray, and pinning a process's threads to its CPU share.

A local Ray instance comes with a reaper: a small process that waits for the driver and, once the driver is
gone (any way: normal exit, error, signal, `kill -9`) or `stop_ray` says so, ends every process still
belonging to this Ray session (the dashboard and runtime-env agents outlive a killed driver otherwise). This
module imports only the standard library at the top: the reaper loads it as a plain file, without rollflow's
or Ray's imports.

The command line starts a local Ray ahead of time (`prestart_ray`), in a process of its own, while the driver
is still importing torch and checking its config: that process starts Ray's head (`ray start`, with the head
processes a single-node run does not need left out), reports its address, then becomes the run's reaper; the
driver connects to it when the pipeline asks for Ray (`start_ray`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

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
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")  # what `pin_threads` sets


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


REAPER_GRACE_S = 3.0  # SIGTERM, then SIGKILL after this long
DRIVER_POLL_S = 1.0  # how often the reaper checks that the driver lives (besides the end of its pipe)
# The reaper's program: load this file (not the package) as a module of its own, registered so that its
# dataclasses resolve, and wait for the driver. argv: file, driver, session. (math_verifier.HELPER_PROGRAM
# loads its file the same way; the layering keeps rewards/ from importing this one.)
def _file_program(name: str, call: str) -> str:
    """A `python -c` program that loads this file (argv[1]) as module `name`, then runs `call` on it."""
    return ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location({name!r}, sys.argv[1])\n"
            "module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n"
            f"module.{call}\n")


REAPER_PROGRAM = _file_program("rollflow_ray_reaper", "reap_after_driver(int(sys.argv[2]), sys.argv[3])")

_reaper: subprocess.Popen | None = None  # the reaper of the local Ray this process started
# The process `prestart_ray` started (it becomes the reaper once Ray's head is up), its num_cpus and its reply
# once read (`_head_address`; `wait_for_prestarted_ray` reads it early); None when there is none or `start_ray`
# took it over.
_prestarted: tuple[subprocess.Popen, int | None, dict | None] | None = None
PRESTART_TIMEOUT_S = 120.0  # the longest `start_ray` waits for a prestarted head before starting its own
# The prestarted head's program (loads this file as the reaper's does). argv: file, driver pid, num_cpus ("" for
# Ray's default), idle workers to start.
HEAD_PROGRAM = _file_program("rollflow_ray_head",
                             "run_head(int(sys.argv[2]), int(sys.argv[3]) if sys.argv[3] else None, "
                             "int(sys.argv[4]))")
_log_monitor: DriverLogMonitor | None = None  # the log monitor thread of the local Ray this process started

# Ray runs the function this variable names (a module path) in each worker process before its first task (what
# `runtime_env={"worker_process_setup_hook": ...}` sets; set directly, a local Ray's workers inherit it without
# a runtime env). Ray internals: a Ray that does not know it ignores it.
WORKER_SETUP_HOOK_VARIABLE = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"
WORKER_SETUP_HOOK = "rollflow.cluster.runtime.lean_process"


def is_warm_worker() -> bool:
    """Whether this process is a worker the raylet started before any job existed (`prestart_ray`'s warm
    worker): Ray gives such a worker the nil job id, all `f`s, until a job's first task or actor takes it over."""
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


def prestart_ray(num_cpus: int | None = None, warm_up: str | None = None,
                 warm_up_env: dict[str, str] | None = None) -> None:
    """Start a local Ray with `num_cpus` in a process of its own, now, and return at once: the next
    `start_ray(None, num_cpus)` connects to it (~0.1 s once it is up) instead of starting one (~2.5 s of this process's
    time). The process starts Ray's head as `start_ray` would (same processes left out, same environment for
    the raylet and its workers), prints its address, then becomes the reaper of that Ray for this process.
    `stop_ray` (or `discard_prestarted_ray`) ends it all; so does this process's death, however it dies.

    With `warm_up` (a "module.function" path), the raylet also starts one idle worker as soon as it is up, and
    every worker of this Ray runs that function as its setup hook instead of `lean_process` (it must call
    `lean_process` itself; `is_warm_worker()` tells the idle worker, which no job owns yet, from the others),
    with `warm_up_env` in its environment. The run's first actor takes that worker over: what the function
    imported there is then already imported, on a core the driver's own imports leave free."""
    global _prestarted
    if _prestarted is not None or not os.path.isdir("/proc"):  # the reaper it becomes needs /proc (Linux)
        return
    env = {**os.environ, **{k: v for k, v in RAY_ENV.items() if k not in os.environ}}
    if warm_up is not None:
        env.update(warm_up_env or {})
        env[WORKER_SETUP_HOOK_VARIABLE] = warm_up
        env["RAY_enable_worker_prestart"] = "1"  # `_lean_head_node(warm_workers=1)` sets how many
    env.setdefault(WORKER_SETUP_HOOK_VARIABLE, WORKER_SETUP_HOOK)
    for var in THREAD_VARIABLES:  # what a pipeline's driver holds when it starts Ray (`pinned_threads(1)`)
        env.setdefault(var, "1")
    head = subprocess.Popen(
        [sys.executable, "-c", HEAD_PROGRAM, os.path.abspath(__file__), str(os.getpid()),
         "" if num_cpus is None else str(num_cpus), "1" if warm_up is not None else "0"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    _prestarted = (head, num_cpus, None)


def wait_for_prestarted_ray() -> bool:
    """Wait until the Ray `prestart_ray` started is up (its raylet has started the warm worker by then);
    whether it is. A driver that waits before its own imports leaves both cores to Ray's start, which is the
    start-up's critical path when a warm worker's imports follow it: on 2 cores the warm worker starts ~0.7 s
    sooner, and the driver's imports and checks still end before the warm worker's (bench/step_overhead.py)."""
    global _prestarted
    if _prestarted is None:
        return False
    head, num_cpus, reply = _prestarted
    if reply is None:
        reply = _head_address(head)
        if reply is None:
            discard_prestarted_ray()
            return False
        _prestarted = (head, num_cpus, reply)
    return True


def prestarted_ray_up() -> bool:
    """Whether a Ray `prestart_ray` started is known to be up (`wait_for_prestarted_ray` said so)."""
    return _prestarted is not None and _prestarted[2] is not None


def discard_prestarted_ray() -> None:
    """Have a Ray `prestart_ray` started that `start_ray` did not take over (the run stopped before it asked
    for Ray) end, with its processes; returns at once (they end within a few seconds, on their own)."""
    global _prestarted
    if _prestarted is not None:
        head = _prestarted[0]
        _prestarted = None
        stop_reaper(head, timeout_s=0)  # it ends its Ray by itself; a head still starting does so once up


def _head_address(head: subprocess.Popen, timeout_s: float = PRESTART_TIMEOUT_S) -> dict | None:
    """What a prestarted head reported (`run_head`): its address, session and whether the driver forwards the
    workers' output; None if it failed or did not answer in time."""
    import json

    ready, _, _ = select.select([head.stdout], [], [], timeout_s)
    line = head.stdout.readline() if ready else b""
    head.stdout.close()
    try:
        reply = json.loads(line)
    except ValueError:
        return None
    return reply if isinstance(reply, dict) and "gcs_address" in reply else None


def run_head(driver_pid: int, num_cpus: int | None, warm_workers: int = 0) -> None:
    """The prestarted head's main (`HEAD_PROGRAM`): `ray start --head` on a free port, without the processes
    `_lean_head_node` leaves out; one JSON line on stdout (`gcs_address`, `session_dir`,
    `skipped_log_monitor`, or `error`); then this process becomes the reaper of that Ray for `driver_pid`."""
    import contextlib as context
    import io

    head = None
    # Ray's processes inherit this one's stdin and stdout: give them /dev/null, keep the pipes to the driver
    # (the reply goes out on one, and the reaper this process becomes reads the other)
    reply_fd, command_fd = os.dup(1), os.dup(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    try:
        from ray._private.authentication.authentication_token_setup import (
            enable_token_auth_by_default,
            ensure_token_if_auth_enabled,
        )
        from ray.scripts.scripts import start

        # token authentication as ray.init sets it up for a new local Ray (on unless RAY_AUTH_MODE says
        # otherwise, a token made if there is none); `ray start` alone would only use a token already there
        token_auth = enable_token_auth_by_default()
        ensure_token_if_auth_enabled({}, create_token_if_missing=True)
        arguments = ["--head", f"--port={free_port()}", "--include-dashboard=false", "--disable-usage-stats"]
        if num_cpus is not None:
            arguments.append(f"--num-cpus={num_cpus}")
        with _lean_head_node(warm_workers) as head, context.redirect_stdout(io.StringIO()), \
                _ray_address_file_kept():
            start.main(args=arguments, standalone_mode=False)
        node = head.node
        reply = {"gcs_address": node.address, "session_dir": node.address_info["session_dir"],
                 "skipped_log_monitor": head.skipped_log_monitor, "token_auth": token_auth}
    except BaseException as err:  # noqa: BLE001 -- the driver starts Ray itself instead
        node = getattr(head, "node", None)
        if node is not None:
            with context.suppress(Exception):
                node.kill_all_processes(check_alive=False, allow_graceful=False)
        _reply(reply_fd, {"error": f"{type(err).__name__}: {err}"})
        sys.exit(1)
    _reply(reply_fd, reply)
    os.dup2(command_fd, 0)
    os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", REAPER_PROGRAM, os.path.abspath(__file__),
                              str(driver_pid), reply["session_dir"]])


@contextlib.contextmanager
def _ray_address_file_kept() -> Iterator[None]:
    """Put back the file `ray start` writes its address to (/tmp/ray/ray_current_cluster): that file makes a
    plain `ray.init()` join the cluster it names, which for a run's own Ray would be a dead one once the run
    ends. The driver connects by address."""
    try:
        from ray._common.utils import get_ray_address_file

        path = get_ray_address_file(None)
    except ImportError:  # a Ray that keeps it elsewhere: left as it is
        yield
        return
    try:
        with open(path) as previous:
            before = previous.read()
    except OSError:
        before = None
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if before is None:
                os.remove(path)
            else:
                with open(path, "w") as current:
                    current.write(before)


def _reply(fd: int, reply: dict) -> None:
    """Write the head's one line to the driver and close the pipe. A driver that no longer reads (it discarded
    this head) is no reason to stop: the head becomes the reaper all the same, and ends its Ray."""
    import json

    try:
        os.write(fd, json.dumps(reply).encode() + b"\n")
        os.close(fd)
    except OSError:
        pass


def start_ray(address: str | None = None, num_cpus: int | None = None) -> str:
    """Start a local Ray (no dashboard, no usage stats) or join the cluster at `address`.

    A local Ray gets a reaper (see the module docstring), so none of its processes outlives this one. A SIGTERM
    handler this process installed before (e.g. `StopSignals`) is kept. A local Ray `prestart_ray` started
    with the same `num_cpus` is connected to; one with another is ended first.

    Returns:
        How: "running" (Ray was already up in this process), "joined" (the cluster at `address`),
        "prestarted" (connected to the local Ray `prestart_ray` started) or "started" (a new local Ray).
    """
    global _reaper, _log_monitor
    import ray

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
        discard_prestarted_ray()
        from rollflow.cluster.joining import join_ray  # here: the reaper loads this file without rollflow

        join_ray(address, runtime_env)  # one line, within seconds, when no cluster answers
        how = "joined"
    else:
        lean_process()
        joined = _join_prestarted(num_cpus)
        if joined is None:
            os.environ.setdefault(WORKER_SETUP_HOOK_VARIABLE, WORKER_SETUP_HOOK)
            # address="local": always a new local instance, never a stray cluster another process left running
            with _lean_head_node() as head:
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


def _join_prestarted(num_cpus: int | None) -> tuple[Any, bool] | None:
    """Connect to the Ray `prestart_ray` started if it has `num_cpus`; its process becomes this driver's reaper.
    Returns (Ray's context, whether the driver forwards the workers' output), or None (a prestarted Ray that
    failed or is not the one asked for is ended)."""
    global _reaper, _prestarted
    import ray

    if _prestarted is None:
        return None
    head, prestarted_cpus, _ = _prestarted
    if prestarted_cpus != num_cpus:
        discard_prestarted_ray()
        return None
    if not wait_for_prestarted_ray():  # it ended the head
        return None
    reply = _prestarted[2]
    _prestarted = None
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


class _HeadNode:
    skipped_log_monitor = False  # its work is the driver's to do (`DriverLogMonitor`)
    node = None  # the head node it built


@contextlib.contextmanager
def _lean_head_node(warm_workers: int | None = None) -> Iterator[_HeadNode]:
    """Start a local Ray without the head processes a single-node run does not need: the autoscaler monitor
    (a fixed instance has nothing to scale), the dashboard's API server (no dashboard, job or state API is
    used), the Ray Client server (`ray start` starts one; nothing connects through it) and the log monitor
    (its work, forwarding workers' output to the console, runs as a thread of the driver instead:
    `DriverLogMonitor`). Each costs start-up CPU and 50-100 MB. `ray.init` has no option for
    any of them, so the head node is adjusted while `ray.init` builds it; with a Ray whose internals differ,
    nothing changes. With `warm_workers`, the raylet starts that many idle workers when it is up (Ray's default,
    where worker prestart is on, is one per CPU)."""
    head = _HeadNode()
    try:
        from ray._private import node, services
    except ImportError:
        yield head
        return
    try:
        from ray._private.log_monitor import LogMonitor  # noqa: F401 -- what the thread runs
    except ImportError:  # no thread to run it: keep Ray's process
        replace_log_monitor = False
    else:
        replace_log_monitor = True
    original_init, original_api_server = node.Node.__init__, node.Node.start_api_server
    original_log_monitor = node.Node.start_log_monitor
    original_start_process = services.start_ray_process

    def init(self, ray_params, *args, **kwargs):
        if hasattr(ray_params, "no_monitor"):
            ray_params.no_monitor = True
        if hasattr(ray_params, "ray_client_server_port"):  # `ray start` starts a Ray Client server: none used
            ray_params.ray_client_server_port = None
        head.node = self
        original_init(self, ray_params, *args, **kwargs)

    def start_api_server(self, *, include_dashboard, raise_on_failure):
        if include_dashboard:
            return original_api_server(self, include_dashboard=include_dashboard, raise_on_failure=raise_on_failure)
        self._webui_url = None

    def start_log_monitor(self):
        head.skipped_log_monitor = True

    def start_ray_process(command, process_type, *args, **kwargs):
        if process_type == "raylet":
            flag = "--num_prestart_python_workers="
            command = [f"{flag}{warm_workers}" if part.startswith(flag) else part for part in command]
        return original_start_process(command, process_type, *args, **kwargs)

    node.Node.__init__, node.Node.start_api_server = init, start_api_server
    if replace_log_monitor:
        node.Node.start_log_monitor = start_log_monitor
    if warm_workers is not None:
        services.start_ray_process = start_ray_process
    try:
        yield head
    finally:
        node.Node.__init__, node.Node.start_api_server = original_init, original_api_server
        node.Node.start_log_monitor = original_log_monitor
        services.start_ray_process = original_start_process


class DriverLogMonitor(threading.Thread):
    """Ray's log monitor as a thread of the driver rather than a process of its own (~80 MB of RSS saved).

    It runs Ray's own `LogMonitor` (the same files tailed, the same messages published to the driver, which
    prints them as before: `(ActorTrainWorker pid=...) ...`), polling every 0.1 s while nothing is new, and
    ends with the Ray session (`stop`)."""

    POLL_S = 0.1

    def __init__(self, address_info: dict) -> None:
        super().__init__(name="rollflow-log-monitor", daemon=True)
        self._address_info = address_info
        self._stop_event = threading.Event()

    def run(self) -> None:
        from ray._private.log_monitor import LogMonitor, is_proc_alive
        from ray._raylet import GcsClient

        info = self._address_info
        try:
            monitor = LogMonitor(info["node_ip_address"], os.path.join(info["session_dir"], "logs"),
                                 GcsClient(address=info["gcs_address"]), is_proc_alive)
            names_updated = 0.0
            while not self._stop_event.is_set():
                if monitor.should_update_filenames(names_updated):
                    monitor.update_log_filenames()
                    names_updated = time.time()
                monitor.open_closed_files()
                if not monitor.check_log_files_and_publish_updates():
                    self._stop_event.wait(self.POLL_S)
            monitor.update_log_filenames()  # what the workers wrote since the last poll
            monitor.open_closed_files()
            monitor.check_log_files_and_publish_updates()
        except Exception as error:  # workers' output stops reaching the console; the run itself is unaffected
            if not self._stop_event.is_set():
                print(f"rollflow: workers' output no longer reaches this console ({type(error).__name__}: "
                      f"{error}); it is still written under {info.get('session_dir')}/logs", file=sys.stderr)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Publish what is left of the workers' output, then end (before Ray shuts down its GCS)."""
        self._stop_event.set()
        self.join(timeout_s)


def stop_ray() -> None:
    """Shut Ray down; for a local instance, then have its reaper end whatever of it is left (bounded wait)."""
    global _reaper, _log_monitor
    import ray

    if _log_monitor is not None:
        _log_monitor.stop()
        _log_monitor = None
    if ray.is_initialized():
        ray.shutdown()
    if _reaper is not None:
        stop_reaper(_reaper)
        _reaper = None
    discard_prestarted_ray()


def start_reaper(session_dir: str) -> subprocess.Popen:
    """Start the reaper of the Ray session in `session_dir`, for this process as its driver.

    It runs in a session of its own (a Ctrl-C or a signal to the driver's process group does not reach it) and
    holds the read end of a pipe only this process writes to: end of file, or this process gone, means the
    driver died; a line means `stop_reaper`.
    """
    return subprocess.Popen(
        # -I -S: the standard library only, no site hooks: a light process that starts fast
        [sys.executable, "-I", "-S", "-c", REAPER_PROGRAM, os.path.abspath(__file__), str(os.getpid()),
         session_dir],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def stop_reaper(reaper: subprocess.Popen, timeout_s: float = REAPER_GRACE_S + 10) -> None:
    """Tell the reaper that Ray was shut down, and wait (at most `timeout_s`; 0: not at all) while it ends
    what is left."""
    try:
        reaper.stdin.write(b"stop\n")
        reaper.stdin.close()
        if timeout_s > 0:
            reaper.wait(timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        pass  # a reaper that died or hangs: nothing more to do from here; it runs on by itself


def reap_after_driver(driver_pid: int, session_dir: str) -> None:
    """The reaper's main: block until the driver says stop (a line on stdin) or is gone (end of file, or no
    such process), then end every process of the session. Writes what it ended to the session's
    `logs/rollflow_reaper.log`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the driver's end ends the reaper
    started = _start_time(driver_pid)
    while _start_time(driver_pid) == started:
        ready, _, _ = select.select([sys.stdin], [], [], DRIVER_POLL_S)
        if ready:
            sys.stdin.readline()  # "stop\n" from stop_reaper, or "" at end of file: both end the wait
            break
    ended: dict[int, str] = {}
    for _ in range(3):  # a raylet that was still starting workers may leave a last one: look again
        left = session_processes(session_dir, exclude={os.getpid(), driver_pid})
        if not left:
            break
        # the GCS last: a raylet or agent told to stop while the GCS stops too waits out the grace period
        gcs = {pid: command for pid, command in left.items() if "gcs_server" in command.split(" ", 1)[0]}
        ended.update(end_processes({pid: command for pid, command in left.items() if pid not in gcs}))
        ended.update(end_processes(gcs))
    if ended:
        with open(os.path.join(session_dir, "logs", "rollflow_reaper.log"), "a") as log:
            log.write(f"ended {len(ended)} processes of {session_dir}: {ended}\n")


def session_processes(session_dir: str, exclude: set[int] = frozenset()) -> dict[int, str]:
    """The live processes of a Ray session: {pid: command line} of each that writes to a file under
    `session_dir`. Every Ray process does (gcs_server, raylet, agents, workers: their stdout and stderr go to
    `logs/`), and so do processes a worker started; a reader (`tail -f` of a log) does not count. Processes
    we may not inspect (another user's) are skipped."""
    prefix = os.path.realpath(session_dir) + "/"  # what /proc/PID/fd links name: the path without symlinks
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude:
            continue
        pid = int(entry)
        try:
            if _start_time(pid) is not None and _writes_under(pid, prefix):  # a zombie is gone already
                with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                    found[pid] = cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def end_processes(processes: dict[int, str], grace_s: float = REAPER_GRACE_S) -> dict[int, str]:
    """SIGTERM each process, SIGKILL those still there after `grace_s`. Returns the ones it signalled."""
    started = {pid: ticks for pid in processes if (ticks := _start_time(pid)) is not None}
    for pid in started:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_start_time(pid) == ticks for pid, ticks in started.items()):
        time.sleep(0.1)
    for pid, ticks in started.items():
        if _start_time(pid) == ticks:  # the same process (not a reused pid), still alive
            _signal(pid, signal.SIGKILL)
    return {pid: processes[pid] for pid in started}


def _writes_under(pid: int, prefix: str) -> bool:
    """Whether process `pid` has a file whose path starts with `prefix` open for writing."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if not os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix):
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as info:
                flags = int(info.read().split("flags:")[1].split()[0], 8)
        except (OSError, IndexError, ValueError):  # closed meanwhile
            continue
        if flags & os.O_ACCMODE != os.O_RDONLY:
            return True
    return False


def _start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), which tells it from a later one with the same
    pid; None when there is no such live process (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _signal(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except OSError:
        pass  # already gone
