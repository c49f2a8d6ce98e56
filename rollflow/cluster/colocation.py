"""Offload / onload of colocated roles between the phases of a step (a small state machine).

Each role is either `resident` (weights, optimizer state, KV cache on its devices) or `offloaded` (moved to
host memory; an inference engine is asleep). Entering a phase onloads the roles that phase uses and first
offloads every resident role that shares a device with them and is not used by the phase. Disaggregated roles
never move. On CPU the moves are no-ops but the transitions, their order and their metrics are the same as on
GPUs, so this logic is tested on every commit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rollflow.cluster.placement import PlacementPlan


def transitions(plan: PlacementPlan, resident: dict[str, bool], uses: tuple[str, ...],
                pinned: frozenset[str] = frozenset()) -> tuple[list[str], list[str]]:
    """The roles to offload and to onload (in that order) before a phase that uses the roles `uses` runs.

    Args:
        plan: the placement plan (which roles share devices).
        resident: role -> whether it is resident now, for every started role.
        uses: the roles the phase runs (those not started are ignored).
        pinned: roles never offloaded: they work through every phase (asynchronous training's rollout roles).

    Returns:
        (offload, onload): resident roles that are idle in the phase and share a device with a role it uses;
        roles the phase uses that are offloaded.
    """
    active = [role for role in uses if role in resident]
    offload = [role for role, on in resident.items() if on and role not in active and role not in pinned
               and any(plan.colocated(role, used) for used in active)]
    onload = [role for role in active if not resident[role]]
    return offload, onload


@dataclass
class ColocationManager:
    """Applies `transitions` to the running workers and records what each move cost.

    Args:
        plan: the placement plan.
        groups: role -> `WorkerGroup` of every started role (worker methods `offload()` / `onload()` return
            {"seconds", "rss_bytes", "device_bytes"}).
        phases: phase name -> the roles it runs; the pipeline's table (e.g. "rollout": ("actor_infer",
            "reward")). A phase that moves weights between roles lists both ends.
        pinned: roles never offloaded (`transitions`). With asynchronous training the rollout runs through
            every phase, so its roles (engines, reward workers, envs) stay resident: a reward worker that
            shares the trainer's devices, offloaded for the trainer's phase, would refuse the groups still
            being scored.
    """

    plan: PlacementPlan
    groups: dict
    phases: dict[str, tuple[str, ...]]
    pinned: frozenset[str] = frozenset()
    resident: dict[str, bool] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    in_flight: list = field(default_factory=list)  # (action, role, result refs) of moves not yet waited for

    def __post_init__(self):
        # a role served by another role's workers (a hybrid engine) moves with them, never on its own
        self.resident = {role: True for role, group in self.groups.items() if group.host is None}

    def enter(self, phase: str) -> None:
        """Offload / onload what `phase` needs, all workers of a role in parallel.

        On GPUs the offloads finish before any onload starts (the memory must be free first) and both before
        the phase runs. On CPU nothing moves: the calls go out at once and are not waited for here (a worker
        runs its calls in the order they were sent, so it is onloaded before the phase's own call runs);
        their results are collected at the next `enter` or `pop_metrics`, and a failure raises there.
        """
        self._collect()
        offload, onload = transitions(self.plan, self.resident, self.phases[phase], self.pinned)
        started = time.perf_counter()
        for action, roles in (("offload", offload), ("onload", onload)):
            for role in roles:
                self.in_flight.append((action, role, self.groups[role].call_async(action)))
                self.resident[role] = action == "onload"
            if self.plan.device != "cpu":
                self._collect()
        if offload or onload:
            self.metrics[f"time/{phase}_offload_onload"] = time.perf_counter() - started

    def _collect(self) -> None:
        """Wait for the moves sent so far and record what each cost."""
        in_flight, self.in_flight = self.in_flight, []
        for action, role, refs in in_flight:
            results = self.groups[role].get(refs, action)
            self.metrics[f"{action}/{role}_seconds"] = self.metrics.get(f"{action}/{role}_seconds", 0.0) \
                + max(r["seconds"] for r in results)
            self.metrics[f"memory/{role}_rss_mb_after_{action}"] = sum(r["rss_bytes"] for r in results) / 2**20
            self.metrics[f"memory/{role}_device_mb_after_{action}"] = sum(r["device_bytes"] for r in results) / 2**20

    def pop_metrics(self) -> dict[str, float]:
        """This step's offload/onload metrics (then reset)."""
        self._collect()
        metrics, self.metrics = self.metrics, {}
        return metrics
