"""`RoleLaunch`: a run's workers start in a thread of the driver while the driver checks its inputs. A check
that fails stops the start (the workers are killed, even mid-constructor); a worker that fails to start is
reported when the driver comes to wait for the workers, with the constructor's own error."""

import time

import pytest
import ray

from rollflow.cluster.groups import WorkerStartError
from rollflow.config import load_config
from rollflow.workers.roles import RoleLaunch

ROLES = ["actor_train", "actor_infer"]


def _config(model_dir, *overrides):
    return load_config(None, ["roles.actor_infer.hybrid=true", f"model.path={model_dir}", *overrides])


def _actors() -> dict[str, str]:
    """Every actor of the Ray session: id -> state (ALIVE, DEAD, ...)."""
    return {actor_id: info["State"] for actor_id, info in ray._private.state.actors().items()}


def _until(condition, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_failed_check_kills_the_starting_workers(workers_not_kept, random_model_dir):
    # new workers (none adopted from the session's kept ones): their constructors import torch and transformers
    before = set(_actors())
    launch = RoleLaunch(_config(random_model_dir), ROLES, manage_ray=False)
    assert _until(lambda: set(_actors()) - before, 60), "the launch created no worker"
    with pytest.raises(ValueError, match="row 3 has no prompt"):
        with launch.cancelled_on_error():
            cancelled = time.perf_counter()
            raise ValueError("row 3 has no prompt")  # what a failed input check raises
    # at once: not after the constructors (importing torch and transformers takes longer than this anywhere,
    # and a new worker process imports them before its constructor can return)
    assert time.perf_counter() - cancelled < 5
    assert launch.groups is None
    started = set(_actors()) - before
    assert _until(lambda: all(_actors()[actor] == "DEAD" for actor in started)), _actors()


def test_workers_started_meanwhile_serve_the_run(workers_not_kept, random_model_dir):
    launch = RoleLaunch(_config(random_model_dir), ROLES, manage_ray=False)
    with launch.cancelled_on_error():
        checked = sum(range(1000))  # the driver's own work, while the workers start
    with launch.running() as groups:
        assert checked == 499500
        assert set(groups) == set(ROLES) and groups["actor_infer"].handles == groups["actor_train"].handles
        assert len(groups["actor_train"].nodes()) == 1
        handles = groups["actor_train"].handles
    assert _until(lambda: all(_actors()[handle._actor_id.hex()] == "DEAD" for handle in handles))


def test_a_worker_that_fails_to_start_is_reported_when_awaited(ray_session, tmp_path):
    broken = tmp_path / "broken_model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    launch = RoleLaunch(_config(broken), ROLES, manage_ray=False)
    with launch.cancelled_on_error():
        pass  # the checks pass (they would not read this model in a real run)
    with pytest.raises(WorkerStartError, match="actor_train: a worker failed to start"):
        with launch.running():
            pytest.fail("a launch whose worker failed must not yield")


def test_a_launch_leaves_up_a_ray_it_did_not_start(ray_session, random_model_dir):
    """`manage_ray=True` in a process whose Ray is already up (a notebook's, a test session's): the launch
    uses it and, stopped by a failed check, leaves it running."""
    launch = RoleLaunch(_config(random_model_dir), ROLES, manage_ray=True)
    with pytest.raises(ValueError, match="bad row"):
        with launch.cancelled_on_error():
            raise ValueError("bad row")
    assert ray.is_initialized() and ray.get(ray.put(1)) == 1
