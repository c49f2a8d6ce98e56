"""The sandbox's ordinary behaviour: I/O, limits reported as flags, the bounded pool, fallback levels."""

from __future__ import annotations

import dataclasses
import os
import threading

import pytest

from rollflow.rewards.sandbox import Sandbox, SandboxLimits, SandboxUnavailableError
from rollflow.rewards.sandbox_isolation import detect_isolation
from rollflow.rewards.sandbox_processes import processes_of_uid

FAST = SandboxLimits(wall_time_s=2.0, cpu_time_s=2.0, memory_bytes=256 << 20, max_output_bytes=4096)
LOOP = dataclasses.replace(FAST, wall_time_s=0.5)  # an endless loop is stopped at any limit: a short one is cheap


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(FAST, max_parallel=4)


def test_stdin_stdout_exit_code_and_files(sandbox):
    result = sandbox.run_python(
        "import sys, helper\nprint(helper.greet(input()))\nsys.stderr.write('note')\nsys.exit(3)",
        stdin="world\n",
        files={"helper.py": "def greet(name):\n    return 'hello ' + name\n"},
    )
    assert result.returncode == 3 and not result.ok
    assert result.stdout == b"hello world\n" and result.stderr == b"note"
    assert not result.timed_out and not result.output_limited


def test_clean_environment_and_private_workdir(sandbox, monkeypatch):
    monkeypatch.setenv("ROLLFLOW_SANDBOX_TEST_TOKEN", "do-not-leak")
    result = sandbox.run_python("import os\nprint(sorted(os.environ))\nprint(os.listdir('.'))")
    assert result.ok, result.stderr
    assert b"ROLLFLOW_SANDBOX_TEST_TOKEN" not in result.stdout
    assert result.stdout.splitlines()[1] == b"['main.py']"


def test_limits_are_reported_not_raised(sandbox):
    looping = sandbox.run_python("while True:\n    pass", limits=LOOP)
    assert looping.timed_out and looping.returncode is None and looping.wall_time_s < LOOP.wall_time_s + 2
    flooding = sandbox.run_python("while True:\n    print('x' * 100)")
    assert flooding.output_limited and len(flooding.stdout) == FAST.max_output_bytes
    memory = sandbox.run_python("x = bytearray(1 << 30)")
    assert memory.returncode == 1 and b"MemoryError" in memory.stderr
    crash = sandbox.run_python("import os\nos.kill(os.getpid(), 9)")
    assert crash.returncode == -9 and not crash.timed_out


def test_file_paths_must_stay_in_the_workdir(sandbox):
    with pytest.raises(ValueError, match="leaves the working directory"):
        sandbox.run_python("pass", files={"../escape.py": "x"})


def test_pool_runs_in_parallel(monkeypatch):
    """8 runs, 4 at a time: each run's process, once started, waits until 4 are started (one at a time, the
    first would wait forever), and never more than 4 are."""
    from rollflow.rewards import sandbox as sandbox_module

    together, lock, running, peak = threading.Barrier(4, timeout=60), threading.Lock(), [0], [0]
    real_communicate = sandbox_module.communicate

    def communicate_once_four_run(process, *args):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        together.wait()
        try:
            return real_communicate(process, *args)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(sandbox_module, "communicate", communicate_once_four_run)
    sandbox = Sandbox(FAST, max_parallel=4)
    results = sandbox.map(sandbox.run_python, ["print('done')"] * 8)
    assert all(r.ok and r.stdout == b"done\n" for r in results)
    assert peak[0] == 4


def test_required_isolation_is_enforced():
    with pytest.raises(SandboxUnavailableError, match="weaker than the required 'bwrap'"):
        Sandbox(isolation="rlimits", require_isolation="bwrap")


@pytest.mark.skipif(os.geteuid() != 0, reason="the unshare fallback needs root")
@pytest.mark.parametrize("level", ["unshare", "rlimits"])
def test_weaker_levels_still_enforce_limits_and_clean_up(level):
    with pytest.warns(RuntimeWarning, match="run as root"):
        sandbox = Sandbox(FAST, isolation=level)
    honest = sandbox.run_python("print(sum(map(int, input().split())))", stdin="2 3")
    assert honest.ok and honest.stdout == b"5\n" and honest.isolation == level
    detached = sandbox.run_python(
        "import subprocess\nsubprocess.Popen(['sleep', '1000'], start_new_session=True, stdout=subprocess.DEVNULL)"
    )
    assert detached.ok
    assert sandbox.run_python("while True:\n    pass", limits=LOOP).timed_out
    assert sandbox.run_python("print('x' * 10**6)").output_limited
    # A program that kills itself is reported as killed (under unshare it is not the namespace's pid 1,
    # which would be immune to its own SIGKILL and exit 0), and an exit status is its own.
    assert sandbox.run_python("import os\nos.kill(os.getpid(), 9)").returncode == -9
    assert sandbox.run_python("import sys\nsys.exit(7)").returncode == 7
    assert not any(_cmdline_has(pid, b"sleep\x001000") for pid in _all_pids())


@pytest.mark.skipif(detect_isolation() != "bwrap", reason="needs bubblewrap")
def test_bwrap_runs_as_a_fresh_unprivileged_uid(sandbox):
    result = sandbox.run_python("import os\nprint(os.getuid(), os.getpid())")
    uid, pid = map(int, result.stdout.split())
    if os.geteuid() == 0:
        assert uid == result.uid and uid >= 1 << 20
    assert pid <= 3  # a fresh pid namespace
    assert processes_of_uid(result.uid) == [] or os.geteuid() != 0


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _cmdline_has(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return needle in f.read()
    except OSError:
        return False
