"""Run model-written programs in a contained subprocess.

What one execution gets, at the strongest isolation level ("bwrap", bubblewrap):

* fresh network, pid, ipc, uts and cgroup namespaces: no network at all (not even the host's loopback), no
  view of or signal to any process outside, and when the sandbox's init dies the kernel kills everything
  inside, so nothing can outlive the run;
* a read-only view of `/usr` and the Python installation only, a private tmpfs `/tmp`, a clean
  environment, and a private working directory (bound at `/work`) that is deleted afterwards;
* a fresh unprivileged uid per run (when rollflow runs as root): the program holds no capabilities,
  and RLIMIT_NPROC binds, which it never does for root; rlimits on CPU time, address space, file size,
  open files and core dumps;
* a cgroup (v1 pids + memory, or v2) capping the total task count and memory of the whole run, when the
  cgroup hierarchy is writable;
* a wall-time limit and an output-size limit enforced by the caller, and a final sweep that SIGKILLs every
  process of the run's uid and of its cgroup.

Fallbacks, chosen once per process by `detect_isolation()` (`sandbox_isolation.py`) and announced with a
loud warning: "unshare" (util-linux `unshare` as root: network, pid, ipc, uts and mount namespaces, private
tmpfs over `/tmp` and `/dev/shm`, but the rest of the file system is visible, protected only by the
unprivileged uid) and "rlimits" (a plain subprocess with rlimits and a new session: no network or file-system
isolation, and without root no way to sweep escaped descendants). Set `require_isolation` to refuse to run
below a level instead.

The run's processes are fed, read and killed by `sandbox_processes.py`, its cgroup is `sandbox_cgroup.py`.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, TypeVar

from rollflow.errors import RollflowError
from rollflow.rewards.sandbox_cgroup import RunCgroup
from rollflow.rewards.sandbox_isolation import (
    BWRAP_NAMESPACE_ARGS,
    ISOLATION_LEVELS,
    UNSHARE_ARGS,
    Isolation,
    detect_isolation,
)
from rollflow.rewards.sandbox_processes import communicate, count_own_tasks, kill_uid

logger = logging.getLogger(__name__)

SANDBOX_UID_RANGE = (1 << 20, 1 << 30)  # fresh uids are drawn from here; no real user lives there
SANDBOX_WORKDIR = "/work"  # where the private working directory appears inside a bwrap sandbox
CGROUP_PREFIX = "rollflow-sandbox-"

T = TypeVar("T")


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one execution.

    Attributes:
        wall_time_s: the caller kills the run after this many seconds.
        cpu_time_s: RLIMIT_CPU per process (SIGXCPU, then SIGKILL one second later).
        memory_bytes: RLIMIT_AS per process and, with a cgroup, the memory cap of the whole run.
        max_processes: processes + threads the program may have at once (RLIMIT_NPROC and `pids.max`).
        max_output_bytes: stdout and stderr are each cut here, and the run is killed.
        max_file_bytes: RLIMIT_FSIZE: the largest file the program may write.
        max_open_files: RLIMIT_NOFILE.
        tmp_bytes: size of the private tmpfs `/tmp` (bwrap), counted against the memory cgroup too.
    """

    wall_time_s: float = 10.0
    cpu_time_s: float = 10.0
    memory_bytes: int = 512 << 20
    max_processes: int = 32
    max_output_bytes: int = 1 << 20
    max_file_bytes: int = 16 << 20
    max_open_files: int = 64
    tmp_bytes: int = 64 << 20


@dataclass
class SandboxResult:
    """The outcome of one execution.

    Attributes:
        returncode: the program's exit status (negative: killed by that signal); None when the caller
            killed it (wall time or output limit).
        stdout: captured standard output, at most `max_output_bytes`.
        stderr: captured standard error, at most `max_output_bytes`.
        timed_out: the wall-time limit or the CPU-time limit ended the run.
        output_limited: the program wrote more than `max_output_bytes` and was killed.
        wall_time_s: how long the run took.
        isolation: the isolation level it ran under.
        uid: the private uid the program ran as (root callers only; else the caller's uid).
    """

    returncode: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool
    output_limited: bool
    wall_time_s: float
    isolation: Isolation
    uid: int

    @property
    def ok(self) -> bool:
        """The program exited with status 0 within every limit."""
        return self.returncode == 0 and not self.timed_out and not self.output_limited


class SandboxUnavailableError(RollflowError, RuntimeError):
    """The required isolation level is not available on this machine."""


class Sandbox:
    """Runs programs under `limits`, at most `max_parallel` at a time (across all calling threads).

    Args:
        limits: default limits for each execution.
        max_parallel: executions allowed at once; further callers wait.
        isolation: "auto" (the strongest available) or a specific level.
        require_isolation: refuse to run (SandboxUnavailableError) below this level.
        python: the interpreter that `"python"` in an argv stands for.
        site_packages: let Python programs import installed packages (slower start: site is loaded).
        workdir_root: where the private working directories are made (default: the system temp dir).
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        max_parallel: int | None = None,
        isolation: Isolation | Literal["auto"] = "auto",
        require_isolation: Isolation = "rlimits",
        python: str = sys.executable,
        site_packages: bool = False,
        workdir_root: str | None = None,
    ):
        self.limits = limits or SandboxLimits()
        self.max_parallel = max_parallel or max(1, os.cpu_count() or 1)
        self.isolation: Isolation = detect_isolation() if isolation == "auto" else isolation
        if ISOLATION_LEVELS.index(self.isolation) < ISOLATION_LEVELS.index(require_isolation):
            raise SandboxUnavailableError(
                f"sandbox isolation {self.isolation!r} is weaker than the required {require_isolation!r}; "
                f"install bubblewrap (apt-get install -y bubblewrap)"
            )
        self.python = os.path.realpath(python)
        self.python_prefix = os.path.realpath(sys.base_prefix)
        self.site_packages = site_packages
        self.workdir_root = workdir_root
        self._slots = threading.BoundedSemaphore(self.max_parallel)
        self._executor = ThreadPoolExecutor(self.max_parallel, thread_name_prefix="rollflow-sandbox")
        # Run the program under a fresh unprivileged uid when we can: always under bwrap (which shows it the
        # interpreter at a readable path); at weaker levels only if other users can reach the interpreter.
        self._drop_uid = os.geteuid() == 0 and (
            self.isolation == "bwrap" or _reachable_by_others(self.python)
        )
        if os.geteuid() == 0 and not self._drop_uid:
            message = (
                f"rollflow sandbox: {self.python} is not readable by other users, so programs run as root at "
                f"isolation {self.isolation!r}; only a cgroup (if writable) bounds their process count"
            )
            logger.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    def map(self, fn: Callable[[T], SandboxResult], items: Iterable[T]) -> list[SandboxResult]:
        """Run `fn(item)` (which calls `run` once) for every item, `max_parallel` at a time, in order.

        Args:
            fn: makes one execution from an item, e.g. `lambda src: sandbox.run_python(src)`.
            items: the work.

        Returns:
            The results in the order of `items`.
        """
        return list(self._executor.map(fn, items))

    def submit(self, fn: Callable[..., SandboxResult], *args, **kwargs):
        """Schedule one execution on the sandbox's threads; returns a `concurrent.futures.Future`.

        `fn` must not itself wait on other futures of this sandbox (that could deadlock the pool).
        """
        return self._executor.submit(fn, *args, **kwargs)

    def run_python(
        self,
        source: str,
        stdin: bytes | str = b"",
        files: Mapping[str, str | bytes] | None = None,
        limits: SandboxLimits | None = None,
    ) -> SandboxResult:
        """Run Python `source` as `main.py` in a fresh working directory.

        Args:
            source: the program.
            stdin: its standard input.
            files: more files to put next to it (relative paths).
            limits: overrides the sandbox's default limits.

        Returns:
            The result.
        """
        return self.run(["python", "main.py"], {"main.py": source, **(files or {})}, stdin, limits)

    def run(
        self,
        argv: Sequence[str],
        files: Mapping[str, str | bytes] | None = None,
        stdin: bytes | str = b"",
        limits: SandboxLimits | None = None,
    ) -> SandboxResult:
        """Run `argv` in a fresh private working directory holding `files`.

        Args:
            argv: the command; a first element `"python"` stands for the sandbox's interpreter, run with
                `-E -s` (no PYTHON* variables, no user site; the script's folder stays importable) and with
                `-S` (no site-packages) unless `site_packages`.
            files: files to create in the working directory, by relative path.
            stdin: standard input.
            limits: overrides the sandbox's default limits.

        Returns:
            The result; limits being hit is reported in it, never raised.
        """
        limits = limits or self.limits
        stdin = stdin.encode() if isinstance(stdin, str) else stdin
        argv = list(argv)
        if argv and argv[0] == "python":
            argv = [self.python, "-E", "-s", *([] if self.site_packages else ["-S"]), *argv[1:]]
        with self._slots:
            return self._run(argv, files or {}, stdin, limits)

    def _run(
        self, argv: list[str], files: Mapping[str, str | bytes], stdin: bytes, limits: SandboxLimits
    ) -> SandboxResult:
        uid = secrets.randbelow(SANDBOX_UID_RANGE[1] - SANDBOX_UID_RANGE[0]) + SANDBOX_UID_RANGE[0]
        workdir = tempfile.mkdtemp(prefix="rollflow-sandbox-", dir=self.workdir_root)
        cgroup = RunCgroup(
            f"{CGROUP_PREFIX}{os.getpid()}-{uid}", limits.memory_bytes, limits.max_processes + 4
        )
        start = time.monotonic()
        try:
            _write_files(workdir, files)
            if self._drop_uid:
                _chown_tree(workdir, uid)
            command = self._command(argv, workdir, uid, limits, cgroup.procs_files)
            process = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                close_fds=True,
                start_new_session=True,  # its own process group, so we can kill the whole group
            )
            stdout, stderr, timed_out, output_limited = communicate(
                process, stdin, limits.wall_time_s, limits.max_output_bytes
            )
            returncode = None if (timed_out or output_limited) else process.returncode
            if returncode is not None and self.isolation in ("bwrap", "unshare") and returncode > 128:
                returncode = -(returncode - 128)  # bwrap and the unshare shell report signal N as 128 + N
            if returncode in (-signal.SIGXCPU, -signal.SIGKILL) and self._cpu_exhausted(limits, start):
                timed_out = True
            return SandboxResult(
                returncode,
                stdout,
                stderr,
                timed_out,
                output_limited,
                time.monotonic() - start,
                self.isolation,
                uid if self._drop_uid else os.getuid(),
            )
        finally:
            if self._drop_uid:
                kill_uid(uid)
            cgroup.kill_all()
            cgroup.remove()
            shutil.rmtree(workdir, ignore_errors=True)

    @staticmethod
    def _cpu_exhausted(limits: SandboxLimits, start: float) -> bool:
        """A SIGXCPU / SIGKILL exit after at least ~the CPU limit in wall time was the CPU limit."""
        return time.monotonic() - start >= limits.cpu_time_s * 0.9

    def _command(
        self, argv: list[str], workdir: str, uid: int, limits: SandboxLimits, procs_files: list[str]
    ) -> list[str]:
        """The launcher chain: [sh (join cgroup)] -> prlimit -> isolation -> [setpriv (drop to uid)] -> argv."""
        cpu = max(1, int(limits.cpu_time_s + 0.999))
        # RLIMIT_NPROC counts every task of the uid; the private uid has none yet, the caller's has many.
        nproc = limits.max_processes if self._drop_uid else limits.max_processes + count_own_tasks()
        rlimits = [
            "prlimit",
            f"--cpu={cpu}:{cpu + 1}",
            f"--as={limits.memory_bytes}",
            f"--nproc={nproc}",
            f"--fsize={limits.max_file_bytes}",
            f"--nofile={limits.max_open_files}",
            "--core=0",
            "--",
        ]
        drop = (
            [
                "setpriv",
                f"--reuid={uid}",
                f"--regid={uid}",
                "--clear-groups",
                "--inh-caps=-all",
                "--bounding-set=-all",
                "--no-new-privs",
                "--",
            ]
            if self._drop_uid
            else []
        )
        if self.isolation == "bwrap":
            inner = self._bwrap_args(workdir, limits) + drop + argv
        elif self.isolation == "unshare":
            # Private tmpfs over the shared writable places; the workdir is bound into the new /dev/shm
            # first, because the new /tmp hides it (and Python opens its script by absolute path).
            tmpfs = f"mount -t tmpfs -o size={limits.tmp_bytes},mode=1777 tmpfs"
            script = (
                f'{tmpfs} /dev/shm && mkdir /dev/shm/work && mount --bind "$PWD" /dev/shm/work && '
                f'{tmpfs} /tmp && cd /dev/shm/work && export PWD=/dev/shm/work && {{ "$@"; exit $?; }}'
            )
            # Not `exec`: the program would be the namespace's pid 1, which no signal without a handler reaches
            # from inside (its own `os.kill(os.getpid(), 9)` did nothing and it exited 0). The shell stays pid 1
            # and reports a child killed by signal N as 128 + N, as bwrap does (the `exit` keeps dash from
            # exec-ing a last command).
            inner = ["unshare", *UNSHARE_ARGS, "/bin/sh", "-c", script, "sh", *drop, *argv]
        else:
            inner = drop + argv
        command = rlimits + inner
        if procs_files:
            joins = " && ".join(f"echo $$ > {path}" for path in procs_files)
            command = ["/bin/sh", "-c", f'{joins} && exec "$@"', "sh", *command]
        return command

    def _bwrap_args(self, workdir: str, limits: SandboxLimits) -> list[str]:
        args = ["bwrap", *BWRAP_NAMESPACE_ARGS, "--ro-bind", "/usr", "/usr"]
        for name in ("bin", "lib", "lib64", "lib32", "sbin"):  # merged-/usr symlinks or real dirs
            path = os.path.join("/", name)
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        for bound in {self.python_prefix, os.path.dirname(os.path.dirname(self.python))}:
            if bound.startswith("/usr/") or bound == "/usr":
                continue
            parts = bound.strip("/").split("/")
            for depth in range(1, len(parts)):  # parents readable by the unprivileged uid
                args += ["--perms", "0755", "--dir", "/" + "/".join(parts[:depth])]
            args += ["--ro-bind", bound, bound]
        args += [
            "--proc", "/proc",
            "--dev", "/dev",
            "--perms", "1777", "--size", str(limits.tmp_bytes), "--tmpfs", "/tmp",
            "--bind", workdir, SANDBOX_WORKDIR,
            "--chdir", SANDBOX_WORKDIR,
            "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin",
            "--setenv", "HOME", SANDBOX_WORKDIR,
            "--setenv", "LANG", "C.UTF-8",
            "--",
        ]  # fmt: skip
        return args


def _write_files(workdir: str, files: Mapping[str, str | bytes]) -> None:
    for relative, content in files.items():
        path = os.path.normpath(os.path.join(workdir, relative))
        if not path.startswith(workdir + os.sep):
            raise ValueError(f"sandbox file path {relative!r} leaves the working directory")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)


def _chown_tree(workdir: str, uid: int) -> None:
    for root, _dirs, names in os.walk(workdir):
        os.chown(root, uid, uid)
        for name in names:
            os.chown(os.path.join(root, name), uid, uid)


def _reachable_by_others(path: str) -> bool:
    """Whether a user other than the owner can traverse to and execute `path` (mode bits only)."""
    parts = os.path.realpath(path).split("/")
    for depth in range(2, len(parts)):
        if not os.stat("/".join(parts[:depth])).st_mode & 0o001:
            return False
    return bool(os.stat(path).st_mode & 0o001)


_default: Sandbox | None = None
_default_lock = threading.Lock()


def default_sandbox() -> Sandbox:
    """The process-wide sandbox with default limits, created on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Sandbox()
        return _default
