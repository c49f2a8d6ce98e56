"""Per-run cgroups for the sandbox: a cap on the total task count and memory of one execution.

Each run gets its own cgroup nested under the caller's current one (so a caller that is itself caged, like
the hostile test suite, cages its runs too). Supports cgroup v1 (`pids` and `memory` hierarchies) and
cgroup v2 (when the caller's cgroup delegates both controllers). Without a writable hierarchy a run gets
no cgroup and relies on rlimits and its private uid.
"""

from __future__ import annotations

import logging
import os
import signal
import time

logger = logging.getLogger(__name__)


def _cgroup_parents() -> dict[str, str] | None:
    """Writable parent directories for per-run cgroups: {"pids": dir, "memory": dir} (v1) or {"v2": dir}.

    Looked up per run (a few microseconds), so runs nest under whatever cgroup the caller is in now.
    """
    try:
        own = dict(
            (fields[1], fields[2])
            for fields in (line.strip().split(":", 2) for line in open("/proc/self/cgroup"))
        )
    except OSError:
        return None
    parents = {}
    for controller in ("pids", "memory"):
        path = os.path.join("/sys/fs/cgroup", controller) + own.get(controller, "/").rstrip("/")
        if os.access(path, os.W_OK) and os.path.exists(os.path.join(path, "cgroup.procs")):
            parents[controller] = path
    if len(parents) == 2:
        return parents
    v2 = "/sys/fs/cgroup" + own.get("", "/").rstrip("/")
    try:
        with open(os.path.join(v2, "cgroup.subtree_control")) as f:
            enabled = f.read().split()
    except OSError:
        return None
    if {"pids", "memory"} <= set(enabled) and os.access(v2, os.W_OK):
        return {"v2": v2}
    return None


class RunCgroup:
    """The cgroup(s) of one run; `procs_files` are what the launcher writes its pid into.

    Args:
        name: the run's cgroup name (unique).
        memory_bytes: the memory cap of the run.
        max_tasks: the `pids.max` of the run (processes and threads, launcher included).
    """

    def __init__(self, name: str, memory_bytes: int, max_tasks: int):
        parents = _cgroup_parents()
        self.dirs: list[str] = []
        if parents is None:
            return
        try:
            if "v2" in parents:
                path = os.path.join(parents["v2"], name)
                os.mkdir(path)
                self.dirs.append(path)
                _write(path, "pids.max", max_tasks)
                _write(path, "memory.max", memory_bytes)
                _write(path, "memory.swap.max", 0, missing_ok=True)
            else:
                pids = os.path.join(parents["pids"], name)
                os.mkdir(pids)
                self.dirs.append(pids)
                _write(pids, "pids.max", max_tasks)
                memory = os.path.join(parents["memory"], name)
                os.mkdir(memory)
                self.dirs.append(memory)
                _write(memory, "memory.limit_in_bytes", memory_bytes)
                _write(memory, "memory.memsw.limit_in_bytes", memory_bytes, missing_ok=True)
        except OSError as error:
            logger.warning("rollflow sandbox: cannot set up a cgroup (%s); relying on rlimits", error)
            self.remove()

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(path, "cgroup.procs") for path in self.dirs]

    def kill_all(self, deadline_s: float = 5.0) -> None:
        """SIGKILL every process left in the cgroup until it is empty (or `deadline_s` passes)."""
        end = time.monotonic() + deadline_s
        for path in self.dirs:
            while time.monotonic() < end:
                try:
                    with open(os.path.join(path, "cgroup.procs")) as f:
                        pids = [int(line) for line in f if line.strip()]
                except OSError:
                    break
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.01)

    def remove(self) -> None:
        for path in self.dirs:
            for _ in range(100):  # rmdir fails while dying tasks are still being reaped
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
            else:
                logger.warning("rollflow sandbox: could not remove cgroup %s", path)
        self.dirs = []


def _write(directory: str, name: str, value: int, missing_ok: bool = False) -> None:
    try:
        with open(os.path.join(directory, name), "w") as f:
            f.write(str(value))
    except FileNotFoundError:
        if not missing_ok:
            raise
