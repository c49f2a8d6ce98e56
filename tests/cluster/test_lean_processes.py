"""A local Ray's processes import only what a run uses: Ray's Arrow serializers would import pyarrow (~40 MB of
RSS) into the driver and every worker whenever it is installed; `lean_process` leaves them to processes that
imported pyarrow themselves, in workers through Ray's worker setup hook."""

import os
import sys

import pytest
import ray

from rollflow.cluster.runtime import WORKER_SETUP_HOOK, WORKER_SETUP_HOOK_VARIABLE


@ray.remote(num_cpus=0)
class Probe:
    def loaded(self) -> list[str]:
        return sorted({name.split(".")[0] for name in sys.modules} & {"pyarrow", "rollflow"})


def test_a_worker_of_a_local_ray_does_not_import_pyarrow(ray_session):
    pytest.importorskip("pyarrow")  # installed with the `data` extra: only then is there anything to avoid
    assert os.environ[WORKER_SETUP_HOOK_VARIABLE] == WORKER_SETUP_HOOK
    probe = Probe.remote()  # a fresh process: an actor never reuses a task's worker
    try:
        assert ray.get(probe.loaded.remote(), timeout=60) == ["rollflow"]  # the hook ran, pyarrow stayed out
    finally:
        ray.kill(probe)
