"""The sandbox's isolation levels, and which one works on this machine (probed once per process).

"bwrap" (bubblewrap: fresh network, pid, ipc, uts and cgroup namespaces and a read-only file system view),
"unshare" (util-linux `unshare` as root: namespaces, but the file system stays visible) and "rlimits" (a plain
subprocess with rlimits and a new session). `rollflow.rewards.sandbox` describes what each one gives a run.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import warnings
from typing import Literal

logger = logging.getLogger(__name__)

Isolation = Literal["bwrap", "unshare", "rlimits"]
ISOLATION_LEVELS: tuple[Isolation, ...] = ("rlimits", "unshare", "bwrap")  # weakest first

BWRAP_NAMESPACE_ARGS = (
    "--unshare-net",
    "--unshare-pid",
    "--unshare-ipc",
    "--unshare-uts",
    "--unshare-cgroup-try",
    "--die-with-parent",  # the sandbox dies with the caller
    "--new-session",  # no controlling terminal: no TIOCSTI injection into the caller's tty
)
UNSHARE_ARGS = ("--net", "--pid", "--ipc", "--uts", "--mount", "--fork", "--kill-child", "--mount-proc")


def _probe(argv: list[str]) -> bool:
    try:
        done = subprocess.run(argv, capture_output=True, timeout=20, env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@functools.lru_cache(maxsize=1)
def detect_isolation() -> Isolation:
    """The strongest isolation level that works here; warns loudly when it is not "bwrap".

    Returns:
        "bwrap", "unshare" or "rlimits".
    """
    bwrap = shutil.which("bwrap")
    if bwrap and _probe([bwrap, *BWRAP_NAMESPACE_ARGS, "--ro-bind", "/", "/", "--", "/bin/true"]):
        return "bwrap"
    unshare = shutil.which("unshare")
    if os.geteuid() == 0 and unshare and _probe([unshare, *UNSHARE_ARGS, "/bin/true"]):
        level: Isolation = "unshare"
        detail = "file system visible to the program (only the unprivileged uid protects it)"
    else:
        level = "rlimits"
        detail = "NO network, file-system or pid isolation; escaped descendants may survive"
    message = (
        f"rollflow sandbox: bubblewrap is unavailable, running model-written code with weaker isolation "
        f"({level!r}: {detail}). Install it: apt-get install -y bubblewrap"
    )
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=2)
    return level
