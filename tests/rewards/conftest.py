"""Fixtures for the reward tests: a cgroup cage for the test process itself, for the hostile suite."""

from __future__ import annotations

import os

import pytest

TEST_PIDS_MAX = 2048  # the test process, its threads, math helpers and every sandbox run together
TEST_MEMORY_BYTES = 6 << 30


def _own_cgroup(controller: str) -> str | None:
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.strip().split(":", 2)
            if controller in names.split(","):
                return os.path.join("/sys/fs/cgroup", controller) + path.rstrip("/")
    return None


@pytest.fixture(scope="module")
def caged_test_process():
    """Move this test process into pids- and memory-limited cgroups (v1) for the module's duration.

    Sandbox runs create their cgroups under the caller's, so even a sandbox failure (a fork bomb or a
    memory bomb that escapes its own limits) stays inside this cage and cannot take the machine down.
    Skips when the cgroup v1 pids and memory hierarchies are not writable.
    """
    made: list[tuple[str, str]] = []  # (new cgroup dir, original cgroup dir)
    try:
        for controller, limit_file, limit in (
            ("pids", "pids.max", TEST_PIDS_MAX),
            ("memory", "memory.limit_in_bytes", TEST_MEMORY_BYTES),
        ):
            original = _own_cgroup(controller)
            if original is None or not os.access(original, os.W_OK):
                pytest.skip(f"cgroup v1 {controller} hierarchy not writable; the hostile suite needs a cage")
            cage = os.path.join(original, f"rollflow-tests-{os.getpid()}")
            os.makedirs(cage, exist_ok=True)
            made.append((cage, original))
            with open(os.path.join(cage, limit_file), "w") as f:
                f.write(str(limit))
            with open(os.path.join(cage, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        yield
    finally:
        for cage, original in reversed(made):
            try:
                with open(os.path.join(original, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))
                os.rmdir(cage)
            except OSError:
                pass
