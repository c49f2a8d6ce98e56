"""The reaper of a local Ray: a small process that waits for the driver and, once the driver is gone (any way:
normal exit, error, signal, `kill -9`) or `stop_reaper` says so, ends every process still belonging to this
Ray session (the dashboard and runtime-env agents outlive a killed driver otherwise).

`ray_session.start_ray` starts one for the Ray it starts; a prestarted head becomes one once its Ray is up
(`prestart.run_head`). This module imports only the standard library: the reaper loads it as a plain file
(`REAPER_PROGRAM`, under `python -I -S`), without rollflow's or Ray's imports.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

REAPER_GRACE_S = 3.0  # SIGTERM, then SIGKILL after this long
DRIVER_POLL_S = 1.0  # how often the reaper checks that the driver lives (besides the end of its pipe)
# The reaper's program: load this file (not the package) as a module of its own, registered so that its
# dataclasses resolve, and wait for the driver. argv: file, driver, session. (math_verifier.HELPER_PROGRAM
# loads its file the same way; the layering keeps rewards/ from importing this one.)
REAPER_PROGRAM = ("import importlib.util, sys\n"
                  "spec = importlib.util.spec_from_file_location('rollflow_ray_reaper', sys.argv[1])\n"
                  "module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)\n"
                  "spec.loader.exec_module(module)\n"
                  "module.reap_after_driver(int(sys.argv[2]), sys.argv[3])\n")


def start_reaper(session_dir: str) -> subprocess.Popen:
    """Start the reaper of the Ray session in `session_dir`, for this process as its driver.

    It runs in a session of its own (a Ctrl-C or a signal to the driver's process group does not reach it) and
    holds the read end of a pipe only this process writes to: end of file, or this process gone, means the
    driver died; a line means `stop_reaper`.
    """
    return subprocess.Popen(reaper_command(os.getpid(), session_dir), stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def reaper_command(driver_pid: int, session_dir: str) -> list[str]:
    """The command line of a reaper of the Ray session in `session_dir` for the driver `driver_pid` (what
    `start_reaper` runs, and what a prestarted head `exec`s once its Ray is up)."""
    # -I -S: the standard library only, no site hooks: a light process that starts fast
    return [sys.executable, "-I", "-S", "-c", REAPER_PROGRAM, os.path.abspath(__file__), str(driver_pid),
            session_dir]


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


def descendants(root: int) -> list[int]:
    """The live processes under `root`: its children, theirs, and so on (parent first), from /proc now."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(int(entry))) is not None:  # None: gone meanwhile
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, parent pid, ...; field N of proc(5) is
    item N - 3), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), which tells it from a later one with the same
    pid; None when there is no such live process (a zombie counts as gone)."""
    fields = _stat_fields(pid)
    return None if fields is None or fields[0] in ("Z", "X") else int(fields[19])


def _signal(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except OSError:
        pass  # already gone
