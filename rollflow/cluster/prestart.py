"""A local Ray started ahead of time, in a process of its own (`prestart_ray`).

The command line starts it while the driver is still importing torch and checking its config: that process
starts Ray's head (`ray start`, with the head processes a single-node run does not need left out:
`head_node.lean_head_node`), reports its address, then becomes the run's reaper (`reaper`); the driver
connects to it when the pipeline asks for Ray (`ray_session.start_ray`, through `take_prestarted_ray`).

At the top it imports only the standard library and modules of this package that do the same: the head's
process imports it before Ray.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
from collections.abc import Iterator

from rollflow.cluster.head_node import lean_head_node
from rollflow.cluster.ray_environment import RAY_ENV, WORKER_SETUP_HOOK, WORKER_SETUP_HOOK_VARIABLE
from rollflow.cluster.reaper import reaper_command, stop_reaper
from rollflow.cluster.runtime import THREAD_VARIABLES, free_port

PRESTART_TIMEOUT_S = 120.0  # the longest `start_ray` waits for a prestarted head before starting its own
# The directory that holds this rollflow package: the head's process imports `run_head` from it, so it runs
# the driver's own rollflow whatever its sys.path would find.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The prestarted head's program. argv: PACKAGE_ROOT, driver pid, num_cpus ("" for Ray's default), idle workers
# to start.
HEAD_PROGRAM = ("import sys\n"
                "sys.path.insert(0, sys.argv[1])\n"
                "from rollflow.cluster.prestart import run_head\n"
                "run_head(int(sys.argv[2]), int(sys.argv[3]) if sys.argv[3] else None, int(sys.argv[4]))\n")

# The process `prestart_ray` started (it becomes the reaper once Ray's head is up), its num_cpus and its reply
# once read (`_head_address`; `wait_for_prestarted_ray` reads it early); None when there is none or
# `take_prestarted_ray` handed it over.
_prestarted: tuple[subprocess.Popen, int | None, dict | None] | None = None


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
        env["RAY_enable_worker_prestart"] = "1"  # `lean_head_node(warm_workers=1)` sets how many
    env.setdefault(WORKER_SETUP_HOOK_VARIABLE, WORKER_SETUP_HOOK)
    for var in THREAD_VARIABLES:  # what a pipeline's driver holds when it starts Ray (`pinned_threads(1)`)
        env.setdefault(var, "1")
    head = subprocess.Popen(
        [sys.executable, "-c", HEAD_PROGRAM, PACKAGE_ROOT, str(os.getpid()),
         "" if num_cpus is None else str(num_cpus), "1" if warm_up is not None else "0"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    _prestarted = (head, num_cpus, None)


def wait_for_prestarted_ray() -> bool:
    """Wait until the Ray `prestart_ray` started is up (its raylet has started the warm worker by then);
    whether it is. `take_prestarted_ray` waits here once the pipeline asks for Ray: the driver's imports and
    config checks run beside Ray's start, so a config they refuse ends the run without waiting for Ray
    (`discard_prestarted_ray`)."""
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


def take_prestarted_ray(num_cpus: int | None) -> tuple[subprocess.Popen, dict] | None:
    """The Ray `prestart_ray` started, for a driver to connect to, if it has `num_cpus` and is up: (its
    process, from now on the driver's reaper; its reply, see `run_head`), no longer `discard_prestarted_ray`'s
    to end. None when there is none; one that failed or is not the one asked for is ended."""
    global _prestarted
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
    return head, reply


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
    `lean_head_node` leaves out; one JSON line on stdout (`gcs_address`, `session_dir`,
    `skipped_log_monitor`, or `error`); then this process becomes the reaper of that Ray for `driver_pid`."""
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
        with lean_head_node(warm_workers) as head, contextlib.redirect_stdout(io.StringIO()), \
                _ray_address_file_kept():
            start.main(args=arguments, standalone_mode=False)
        node = head.node
        reply = {"gcs_address": node.address, "session_dir": node.address_info["session_dir"],
                 "skipped_log_monitor": head.skipped_log_monitor, "token_auth": token_auth}
    except BaseException as err:  # noqa: BLE001 -- the driver starts Ray itself instead
        node = getattr(head, "node", None)
        if node is not None:
            with contextlib.suppress(Exception):
                node.kill_all_processes(check_alive=False, allow_graceful=False)
        _reply(reply_fd, {"error": f"{type(err).__name__}: {err}"})
        sys.exit(1)
    _reply(reply_fd, reply)
    os.dup2(command_fd, 0)
    os.execv(sys.executable, reaper_command(driver_pid, reply["session_dir"]))


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
