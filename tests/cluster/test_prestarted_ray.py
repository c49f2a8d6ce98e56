"""A Ray the command line starts ahead of time (`prestart_ray`): a process of its own starts the head while
the driver imports, then becomes the reaper; `start_ray` connects to it if it is the Ray asked for (workers
run, their output reaches the driver, the Ray is as lean as one `start_ray` starts itself), ends it if not,
and no process of it outlives the driver, whichever way the driver ends."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rollflow.cluster.reaper import _start_time, session_processes

# every test runs a driver subprocess that starts (or is refused) a Ray of its own: 15-40 s each on 2 cores
pytestmark = pytest.mark.slow

CONNECT = """
import os, sys, time
import ray
from rollflow.cluster import prestart, ray_session

prestart.prestart_ray(int(sys.argv[1]))
head = prestart._prestarted[0]
if sys.argv[3:] == ["wait"]:  # as the command line does: the head is up before the driver imports
    print("UP", prestart.wait_for_prestarted_ray(), prestart.prestarted_ray_up(), flush=True)
ray_session.start_ray(None, int(sys.argv[2]))
session_dir = ray._private.worker._global_node.get_session_dir_path()

@ray.remote(num_cpus=0)
def hello():
    print("hello from a worker", flush=True)
    return os.getpid()

worker = ray.get(hello.remote())
print("RESULT", session_dir, head.pid, ray_session._reaper is head, ray.cluster_resources()["CPU"], worker,
      flush=True)
started = time.monotonic()
ray_session.stop_ray()
print("STOPPED", head.poll(), f"{time.monotonic() - started:.2f}", flush=True)
"""


def _run(*cpus: int, wait: bool = False, tag: str = "") -> tuple[dict, str]:
    """CONNECT with prestart_ray(cpus[0]), `wait_for_prestarted_ray()` if `wait`, and start_ray(None, cpus[1]): its
    RESULT fields, and all it printed. `tag`: see `_raylets`."""
    done = subprocess.run([sys.executable, "-c", CONNECT, *map(str, cpus), *(["wait"] if wait else [])],
                          capture_output=True, text=True, timeout=120, env=_tagged_env(tag))
    assert done.returncode == 0, done.stderr
    (result,) = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("RESULT")]
    session_dir, head, adopted, num_cpus, worker = result
    return {"session_dir": session_dir, "head": int(head), "adopted": adopted == "True",
            "num_cpus": float(num_cpus), "worker": int(worker)}, done.stdout


def _gone(pid: int, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while _start_time(pid) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _all_gone(session_dir: str, within_s: float = 15.0) -> bool:
    deadline = time.monotonic() + within_s
    while session_processes(session_dir):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return True


TAG = "ROLLFLOW_TEST_TAG"  # set in a test's driver subprocess, inherited by every process of the Ray it starts


def _tagged_env(tag: str) -> dict[str, str]:
    return {**os.environ, TAG: tag}


def _raylets(tag: str) -> set[int]:
    """The live raylets started under a driver run with `_tagged_env(tag)`: this test's, not those of another
    test process's Ray (pytest-xdist) or of anything else on the machine."""
    found = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if b"raylet" not in cmdline.read().split(b"\0")[0] or _start_time(int(entry)) is None:
                    continue
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if f"{TAG}={tag}".encode() in environ.read().split(b"\0"):
                    found.add(int(entry))
        except OSError:
            continue
    return found


def test_start_ray_connects_to_the_prestarted_head():
    result, printed = _run(2, 2)
    assert result["adopted"] and result["num_cpus"] == 2.0  # the head's process is now the reaper
    assert "hello from a worker" in printed  # workers' output reaches the driver's console
    (stopped,) = [line.split()[1:] for line in printed.splitlines() if line.startswith("STOPPED")]
    assert stopped[0] == "0"  # stop_ray: the reaper ended the session, then itself
    # without waiting out its grace period (3 s): the GCS is ended after the raylet and agents
    assert float(stopped[1]) < 2.5, stopped
    assert _all_gone(result["session_dir"])


def test_a_prestarted_head_with_other_cpus_is_ended_and_replaced():
    result, printed = _run(1, 2, wait=True, tag="replaced")  # up and waited for, but not the Ray asked for
    assert "UP True True" in printed.splitlines()
    assert not result["adopted"] and result["num_cpus"] == 2.0  # a Ray of the driver's own, then
    assert _gone(result["head"])  # the prestarted head (by then its Ray's reaper) ended it and itself
    assert _all_gone(result["session_dir"])
    deadline = time.monotonic() + 15
    while _raylets("replaced") and time.monotonic() < deadline:
        time.sleep(0.25)
    assert not _raylets("replaced"), "the prestarted Ray is still running"


ABANDON = """
import sys, time
from rollflow.cluster import prestart

prestart.prestart_ray(1)
print(prestart._prestarted[0].pid, flush=True)
if sys.argv[1] == "discard":
    prestart.discard_prestarted_ray()
    print("discarded", flush=True)
time.sleep(300)
"""


def _reaper_session(pid: int, within_s: float = 60.0) -> str:
    """The session directory of the Ray the prestarted head `pid` started, once it is that Ray's reaper."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            argv = cmdline.read().split(b"\0")
        if b"-S" in argv:  # the reaper's program runs without site-packages
            return argv[-2].decode()
        time.sleep(0.1)
    pytest.fail("the prestarted head did not become a reaper")


@pytest.mark.parametrize("how", ["discard", "kill -9"])
def test_no_prestarted_process_outlives_its_driver(how):
    """A Ray no pipeline took over ends with `discard_prestarted_ray` (a bad config: while the head may still
    be starting) or with the driver (kill -9 once the head is up)."""
    tag = how.split()[0]
    driver = subprocess.Popen([sys.executable, "-c", ABANDON, tag], stdout=subprocess.PIPE, text=True,
                              env=_tagged_env(tag))
    try:
        head = int(driver.stdout.readline())
        session_dir = _reaper_session(head) if how == "kill -9" else None
        if how == "kill -9":
            assert session_processes(session_dir, exclude={head}), "no Ray started"
            assert _raylets(tag), "its raylet does not carry the driver's environment: _raylets finds nothing"
            os.kill(driver.pid, signal.SIGKILL)
        else:
            assert driver.stdout.readline().strip() == "discarded"
        assert _gone(head), "the prestarted head is still running"
        if session_dir is not None:
            assert _all_gone(session_dir)
        assert _raylets(tag) == set(), "the prestarted Ray's raylet is still running"  # a discard: whatever its stage
    finally:
        driver.kill()
        driver.wait()


WARM = """
import json, os, sys
import ray
from rollflow.cluster import prestart, ray_session
from rollflow.workers import warm

prestart.prestart_ray(1, warm_up=warm.SETUP_HOOK, warm_up_env={warm.MODEL_VARIABLE: "tiny"})
assert prestart.wait_for_prestarted_ray()  # as the command line does
how = ray_session.start_ray(None, 1)

@ray.remote(num_cpus=0)
class Probe:
    def report(self):
        from rollflow import spans
        return {"pid": os.getpid(), "spans": [s["name"] for s in spans.take()],
                "modeling": "transformers.models.qwen2.modeling_qwen2" in sys.modules}

probes = [Probe.remote(), Probe.remote()]
print("RESULT", how, json.dumps(ray.get([probe.report.remote() for probe in probes])), flush=True)
ray_session.stop_ray()
"""


def test_the_prestarted_ray_has_one_warm_worker_for_the_first_actor():
    """`prestart_ray(warm_up=...)`: the raylet starts one idle worker with the head, which imports the worker
    classes and the model's modeling code before any job exists; an actor takes it over (the imports done),
    the next one gets a worker of its own that skipped the warm-up. `ray start`'s address file is put back."""
    from ray._common.utils import get_ray_address_file

    address_file = get_ray_address_file(None)
    before = open(address_file).read() if os.path.exists(address_file) else None
    done = subprocess.run([sys.executable, "-c", WARM], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    (result,) = [line.split(maxsplit=2)[1:] for line in done.stdout.splitlines() if line.startswith("RESULT")]
    how, reports = result[0], json.loads(result[1])
    assert how == "prestarted"
    warm, cold = sorted(reports, key=lambda report: "warm up" not in report["spans"])
    assert warm["spans"] == ["warm up"] and warm["modeling"], reports
    assert cold["spans"] == [] and not cold["modeling"], reports  # a job's worker: only lean_process
    assert warm["pid"] != cold["pid"]
    after = open(address_file).read() if os.path.exists(address_file) else None
    assert after == before  # a plain `ray.init()` elsewhere must not try to join this run's (dead) Ray
