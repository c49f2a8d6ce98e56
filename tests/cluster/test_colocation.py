"""Offload / onload between phases: which roles move, in which order, and that the workers follow."""

import pytest
import ray

from rollflow.cluster.colocation import ColocationManager, transitions
from rollflow.cluster.groups import WorkerGroup
from rollflow.config import load_config
from rollflow.errors import WorkerError
from rollflow.pipelines.rl_step import PHASES
from rollflow.workers.base import PlacedWorker
from rollflow.workers.roles import plan_roles

ROLES = ["actor_train", "actor_infer", "reference"]


def _plan(*overrides):
    config = load_config(None, ["rollout.groups_per_step=8", "algorithm.kl_loss_coef=0.1", *overrides])
    return plan_roles(config, ROLES, devices_per_node=2)


def test_colocated_roles_swap_between_phases():
    plan = _plan()  # no device_mapping: everything shares the machine
    resident = dict.fromkeys(ROLES, True)
    assert transitions(plan, resident, PHASES["rollout"]) == (["actor_train", "reference"], [])
    resident.update(actor_train=False, reference=False)
    assert transitions(plan, resident, PHASES["reference"]) == (["actor_infer"], ["reference"])
    resident.update(actor_infer=False, reference=True)
    assert transitions(plan, resident, PHASES["actor_train"]) == (["reference"], ["actor_train"])
    resident.update(reference=False, actor_train=True)
    # weight sync needs both ends: the engine comes back, nothing is offloaded
    assert transitions(plan, resident, PHASES["weight_sync"]) == ([], ["actor_infer"])


def test_disaggregated_roles_never_move():
    plan = _plan("roles.actor_train.device_mapping=[0]", "roles.actor_infer.device_mapping=[1]")
    resident = dict.fromkeys(ROLES, True)  # reference follows actor_train onto device 0
    assert transitions(plan, resident, PHASES["rollout"]) == ([], [])
    assert transitions(plan, resident, PHASES["reference"]) == (["actor_train"], [])
    resident["actor_train"] = False
    assert transitions(plan, resident, PHASES["actor_train"]) == (["reference"], ["actor_train"])


def test_pinned_roles_stay_resident_through_every_phase():
    """Asynchronous training: the rollout's roles work while the trainer trains, so they are never offloaded,
    whatever shares their devices (a reward worker on the trainer's devices scored nothing once offloaded)."""
    plan = _plan()
    resident = dict.fromkeys(ROLES, True)
    pinned = frozenset(PHASES["rollout"])
    for phase in ("reference", "old_logprobs", "actor_train", "weight_sync", "checkpoint"):
        offload, _ = transitions(plan, resident, PHASES[phase], pinned)
        assert "actor_infer" not in offload, phase
    assert transitions(plan, resident, PHASES["actor_train"], pinned) == (["reference"], [])
    assert transitions(plan, resident, PHASES["actor_train"]) == (["actor_infer", "reference"], [])


class _RecordingBackend:
    def __init__(self):
        self.moves = []

    def offload(self):
        self.moves.append("offload")

    def onload(self):
        self.moves.append("onload")


class _Worker(PlacedWorker):
    """A real PlacedWorker whose backend records the moves it is asked to make."""

    def __init__(self, placement):
        super().__init__(placement)
        self.backend = _RecordingBackend()

    def moves(self):
        return self.backend.moves

    def work(self):
        self.require_resident("work")
        return "done"


@pytest.mark.slow  # three worker processes, each importing torch (~10 s on 2 cores); the plans above stay fast
def test_manager_moves_workers_and_guards_offloaded_use(ray_session):
    plan = _plan()
    groups = {}
    for role in ROLES:
        placements = plan.workers[role]
        handles = [ray.remote(num_cpus=0)(_Worker).remote(p) for p in placements]
        groups[role] = WorkerGroup(role, handles, placements)
    manager = ColocationManager(plan, groups, PHASES)
    manager.enter("rollout")
    manager.enter("reference")
    manager.enter("actor_train")
    assert groups["actor_train"].call("moves") == ["offload", "onload"]
    assert groups["reference"].call("moves") == ["offload", "onload", "offload"]
    assert manager.resident == {"actor_train": True, "actor_infer": False, "reference": False}
    with pytest.raises(WorkerError, match="reference worker 0 failed in work: .*called while offloaded"):
        groups["reference"].call("work")
    assert groups["actor_train"].call("work") == "done"
    metrics = manager.pop_metrics()
    assert metrics["offload/actor_infer_seconds"] >= 0
    assert metrics["memory/actor_train_rss_mb_after_onload"] > 10  # a live Python process
    assert "time/rollout_offload_onload" in metrics and manager.pop_metrics() == {}
    for group in groups.values():
        group.close()
