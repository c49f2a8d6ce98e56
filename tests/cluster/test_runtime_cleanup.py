"""No Ray process of a run outlives its driver: kill -9, or SIGTERM through `StopSignals` and `stop_ray`."""

import os
import signal
import subprocess
import sys
import time

import pytest

from rollflow.cluster.reaper import _start_time, descendants, session_processes

DRIVER = """
import os, time
import ray
from rollflow.cluster.ray_session import start_ray, stop_ray
from rollflow.pipelines.interrupts import Interrupted, StopSignals

@ray.remote(num_cpus=0)
class Sleeper:
    def sleep(self, seconds):
        time.sleep(seconds)
        return os.getpid()

try:
    with StopSignals():
        try:
            start_ray(num_cpus=1)
            sleeper = Sleeper.remote()
            actor_pid = ray.get(sleeper.sleep.remote(0))
            print(ray._private.worker._global_node.get_session_dir_path(), actor_pid, flush=True)
            ray.get(sleeper.sleep.remote(300))  # a driver waiting on its workers
        finally:
            stop_ray()
            print("stopped", flush=True)
except Interrupted as interrupted:
    print(f"interrupted by {interrupted.signal_name}", flush=True)
"""


def _start_driver():
    """The driver, its Ray session directory, and the session's processes: {pid: start time}."""
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True)
    session_dir, actor_pid = driver.stdout.readline().split()
    processes = session_processes(session_dir, exclude={driver.pid})
    commands = " ".join(processes.values())
    assert int(actor_pid) in processes and "raylet" in commands and "gcs_server" in commands, processes
    return driver, session_dir, {pid: _start_time(pid) for pid in processes}


def _assert_all_gone(session_dir, started, within_s=15.0):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = {pid for pid, ticks in started.items() if _start_time(pid) == ticks}
        left = session_processes(session_dir)
        if not alive and not left:
            return
        time.sleep(0.25)
    pytest.fail(f"still running {within_s}s after the driver ended: {alive} {left}")


@pytest.mark.slow  # a driver subprocess that starts Ray: ~20 s on 2 cores
def test_kill_9_of_the_driver_leaves_no_ray_process():
    driver, session_dir, started = _start_driver()
    driver.kill()  # SIGKILL: no finally, no atexit; only the reaper is left to clean up
    driver.wait(10)
    _assert_all_gone(session_dir, started)


@pytest.mark.slow  # a driver subprocess that starts Ray: ~20 s on 2 cores
def test_sigterm_stops_ray_through_stop_signals():
    driver, session_dir, started = _start_driver()
    os.kill(driver.pid, signal.SIGTERM)  # StopSignals' handler wins over the one ray.init installs
    out, _ = driver.communicate(timeout=60)
    assert out.splitlines() == ["stopped", "interrupted by SIGTERM"]
    assert driver.returncode == 0
    _assert_all_gone(session_dir, started, within_s=1.0)  # stop_ray returned only once all were gone


AFTER_STOP = """
import ray
from rollflow.cluster import ray_session
ray_session.start_ray(num_cpus=1)
ray_session.stop_ray()
try:
    ray.put(1)  # what a thread still spawning workers does once a stop signal made the driver stop Ray
    print("put", flush=True)
except Exception as error:
    print("refused", type(error).__name__, flush=True)
print("initialized", ray.is_initialized(), flush=True)
ray.shutdown()
"""


@pytest.mark.slow  # a subprocess that starts and stops its own Ray
def test_no_ray_starts_by_itself_after_stop_ray():
    """Ray's API after `stop_ray` raises: it does not start a new local Ray (Ray's auto-init), which no reaper
    would end (`rollflow plan` stopped by SIGTERM while its workers were still being spawned left one)."""
    done = subprocess.run([sys.executable, "-c", AFTER_STOP], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("refused") and lines[1] == "initialized False", done.stdout


HOLD_FILE = "import sys, time; log = open(sys.argv[1], sys.argv[2]); print('ready', flush=True); time.sleep(60)"
IGNORE_SIGTERM = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
                  "time.sleep(60)")


def _spawn(*args):
    process = subprocess.Popen([sys.executable, "-c", *args], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "ready\n"
    return process


def test_a_session_process_is_one_writing_under_the_session_dir(tmp_path):
    (tmp_path / "logs").mkdir()
    log = tmp_path / "logs" / "worker.out"
    writer, reader = _spawn(HOLD_FILE, str(log), "a"), _spawn(HOLD_FILE, str(log), "r")  # reader: `tail -f`
    try:
        assert set(session_processes(str(tmp_path))) == {writer.pid}
    finally:
        for process in (writer, reader):
            process.kill()
            process.wait()


def test_descendants_are_the_children_and_theirs():
    # a child that starts two grandchildren and prints their pids once both run
    parent = _spawn("import subprocess, time\n"
                    "kids = [subprocess.Popen(['sleep', '60']) for _ in range(2)]\n"
                    "print('ready', flush=True)\n"
                    "print(*(kid.pid for kid in kids), flush=True)\n"
                    "time.sleep(300)")
    try:
        grandchildren = set(map(int, parent.stdout.readline().split()))
        assert set(descendants(parent.pid)) == grandchildren
        assert {parent.pid, *grandchildren} <= set(descendants(os.getpid()))
        assert descendants(max(grandchildren)) == []
    finally:
        for pid in (*grandchildren, parent.pid):
            os.kill(pid, signal.SIGKILL)
        parent.wait()


def test_end_processes_kills_what_ignores_sigterm():
    from rollflow.cluster.reaper import end_processes

    stubborn = _spawn(IGNORE_SIGTERM)
    started = time.monotonic()
    assert end_processes({stubborn.pid: "stubborn"}, grace_s=0.5) == {stubborn.pid: "stubborn"}
    assert stubborn.wait(5) == -signal.SIGKILL
    assert time.monotonic() - started < 10  # its 0.5 s grace (a hang guard: a loaded machine adds some)
