"""A local Ray's processes import only what a run uses: Ray's Arrow serializers would import pyarrow (~40 MB of
RSS) into the driver and every worker whenever it is installed; `lean_process` leaves them to processes that
imported pyarrow themselves, in workers through Ray's worker setup hook. And a local Ray has no log monitor
process: the driver forwards its workers' output itself."""

import os
import re
import subprocess
import sys

import pytest
import ray

from rollflow.cluster.ray_environment import WORKER_SETUP_HOOK, WORKER_SETUP_HOOK_VARIABLE
from rollflow.cluster.reaper import session_processes


@ray.remote(num_cpus=0)
class Probe:
    def loaded(self) -> list[str]:
        return sorted({name.split(".")[0] for name in sys.modules} & {"pyarrow", "rollflow"})


def test_a_worker_of_a_local_ray_does_not_import_pyarrow(ray_session):
    pytest.importorskip("pyarrow")  # installed with the `data` extra: only then is there anything to avoid
    assert os.environ[WORKER_SETUP_HOOK_VARIABLE] == WORKER_SETUP_HOOK
    probe = Probe.remote()  # a worker process of this session: every one runs the hook when it starts
    try:
        assert ray.get(probe.loaded.remote(), timeout=60) == ["rollflow"]  # the hook ran, pyarrow stayed out
    finally:
        ray.kill(probe)


def test_a_local_ray_runs_no_log_monitor_process(ray_session):
    session_dir = ray._private.worker._global_node.get_session_dir_path()
    commands = session_processes(session_dir, exclude={os.getpid()}).values()
    assert any("raylet" in command for command in commands), commands  # the session's processes are visible
    assert not [command for command in commands if "log_monitor" in command]


PRINTING_DRIVER = """
import sys, ray
from rollflow.cluster.ray_session import start_ray, stop_ray

@ray.remote(num_cpus=0)
class Printer:
    def say(self, text):
        print(text, flush=True)
        print(text + " on stderr", file=sys.stderr, flush=True)

start_ray(num_cpus=1)
printer = Printer.remote()
ray.get(printer.say.remote("early line"))
import time; time.sleep(1.0)  # the monitor thread polls every 0.1 s
ray.get(printer.say.remote("last line"))  # written just before Ray stops: the final poll forwards it
stop_ray()
"""


@pytest.mark.slow  # a driver subprocess that starts Ray: ~15 s on 2 cores
def test_workers_output_still_reaches_the_drivers_console():
    """The log monitor's work runs as a thread of the driver: a worker's prints show up with Ray's prefix."""
    done = subprocess.run([sys.executable, "-c", PRINTING_DRIVER], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout + done.stderr
    for line in ("early line", "early line on stderr", "last line", "last line on stderr"):
        assert re.search(rf"\(Printer pid=\d+\).* {line}$", out, re.MULTILINE), out[-2000:]
