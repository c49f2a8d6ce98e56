"""The resource plan (ROLL's AutoDeviceMapping): which worker of which role sits on which devices and node.

Device indices in `roles.<role>.device_mapping` are global over the cluster: device `d` is local device
`d % devices_per_node` of node `d // devices_per_node`, so `[0..15]` on two 8-GPU nodes spans both. A role's
devices are split evenly and in order over its workers. Roles whose devices overlap are *colocated* and
time-share them (the pipeline offloads one before the other runs); disjoint roles are *disaggregated* and may
run at the same time. On CPU a device is a CPU slot (a core): a placed worker pins its threads and its CPU
affinity to its slots.

Without any `device_mapping` (the CPU default) nothing is placed: every worker may run on the first node,
uses `num_cpus` threads, and all roles time-share the machine.

This module is pure and names no role: it validates role specs against a cluster shape and describes the
plan; Ray placement groups are created from the plan in `rollflow.cluster.groups`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

from rollflow.errors import ConfigError

# what a device index names, per `cluster.device` ("sim": a GPU the sim engine and backend simulate)
DEVICE_UNITS = {"cpu": "CPU slots", "gpu": "GPUs", "sim": "simulated GPUs"}


class RoleSpec(Protocol):
    """What the plan reads of a role's config section (`rollflow.config.RoleConfig` has these)."""

    num_workers: int
    num_cpus: float
    device_mapping: list[int] | None


@dataclass(frozen=True)
class WorkerPlacement:
    """Where one worker runs.

    Attributes:
        role: the role name.
        index: the worker's index within its role (its data-parallel rank for actor_train).
        devices: global device indices it uses; () when the role is not placed.
        node: index of the node (placement-group bundle) it runs on; None when not placed.
        local_devices: its devices as indices on that node (CPU cores or CUDA devices).
        threads: torch / OpenMP threads it runs with.
    """

    role: str
    index: int
    devices: tuple[int, ...]
    node: int | None
    local_devices: tuple[int, ...]
    threads: int


@dataclass
class PlacementPlan:
    """The validated plan for one run (see the module docstring)."""

    device: str  # "cpu" | "gpu" | "sim"
    devices_per_node: int
    num_nodes: int
    workers: dict[str, list[WorkerPlacement]] = field(default_factory=dict)
    hosted: dict[str, str] = field(default_factory=dict)  # role -> the role whose workers serve it too

    def host(self, role: str, host: str) -> None:
        """Plan `role` inside the workers of `host` (a hybrid worker serves both): same places and threads."""
        self.workers[role] = [replace(w, role=role) for w in self.workers[host]]
        self.hosted[role] = host

    @property
    def placed(self) -> bool:
        """True when any role has a device_mapping (Ray placement groups are used)."""
        return any(w.node is not None for ws in self.workers.values() for w in ws)

    def devices_of(self, role: str) -> set[int]:
        return {d for w in self.workers.get(role, []) for d in w.devices}

    def colocated(self, role_a: str, role_b: str) -> bool:
        """Whether two roles share a device (and so must not hold it at the same time). Unplaced roles share
        the whole machine, so they count as colocated with everything."""
        if role_a not in self.workers or role_b not in self.workers:
            return False
        devices_a, devices_b = self.devices_of(role_a), self.devices_of(role_b)
        if not devices_a or not devices_b:
            return True
        return bool(devices_a & devices_b)

    def colocation_groups(self) -> list[list[str]]:
        """Roles joined by shared devices (connected components), in the plan's role order."""
        order = list(self.workers)
        groups: list[list[str]] = []
        for role in order:
            joined = [g for g in groups if any(self.colocated(role, other) for other in g)]
            merged = [role] + [r for g in joined for r in g]
            groups = [g for g in groups if g not in joined] + [sorted(merged, key=order.index)]
        return sorted(groups, key=lambda g: order.index(g[0]))

    def describe(self) -> str:
        """A human-readable table of the plan (what `rollflow train --print-plan` prints)."""
        lines = [f"cluster: {self.num_nodes} node(s) x {self.devices_per_node} {DEVICE_UNITS[self.device]}"]
        if not self.placed:
            lines.append("no device_mapping: every worker runs on node 0 and the roles time-share its devices")
        lines.append(f"{'role':<12} {'worker':>6}  {'node':>4}  {'devices':<16} {'threads':>7}")
        for role, workers in self.workers.items():
            for w in workers:
                node = "-" if w.node is None else str(w.node)
                devices = ",".join(map(str, w.devices)) or "shared"
                lines.append(f"{role:<12} {w.index:>6}  {node:>4}  {devices:<16} {w.threads:>7}")
        for role, host in self.hosted.items():
            lines.append(f"{role} runs inside the {host} worker with the same index (one process, in turn)")
        groups = self.colocation_groups()
        lines.append("colocated (time-share, offload between phases): "
                     + ("; ".join(" + ".join(g) for g in groups if len(g) > 1) or "none"))
        lines.append("disaggregated (may run concurrently): "
                     + (" | ".join(" + ".join(g) for g in groups) if len(groups) > 1 else "none"))
        return "\n".join(lines)


def plan_placement(roles: Mapping[str, RoleSpec], device: str, devices_per_node: int,
                   num_nodes: int = 1) -> PlacementPlan:
    """Validate each role's workers and devices against a cluster shape and place them.

    Which roles a run has, and what a role without a `device_mapping` shares, is the caller's business
    (`rollflow.workers.roles.plan_roles`); this function only checks and places what it is given.

    Args:
        roles: role name -> its spec (`num_workers`, `num_cpus`, `device_mapping`), in start order.
        device: "cpu", "gpu" or "sim" (what a device index names, `DEVICE_UNITS`).
        devices_per_node: CPU slots (device "cpu"), GPUs or simulated GPUs on each node.
        num_nodes: nodes in the cluster.

    Returns:
        The plan.

    Raises:
        ConfigError: one line saying which setting to change.
    """
    total = devices_per_node * num_nodes
    plan = PlacementPlan(device, devices_per_node, num_nodes)
    for role, spec in roles.items():
        plan.workers[role] = _place_role(role, spec.num_workers, spec.num_cpus, spec.device_mapping, device,
                                         devices_per_node, total)
    return plan


def _place_role(role: str, num_workers: int, num_cpus: float, mapping: list[int] | None, device: str,
                devices_per_node: int, total: int) -> list[WorkerPlacement]:
    if mapping is None:
        threads = max(1, int(num_cpus))
        return [WorkerPlacement(role, i, (), None, (), threads) for i in range(num_workers)]
    where = f"roles.{role}.device_mapping"
    if not mapping:
        raise ConfigError(f"{where} is empty; list the device indices the role uses, or remove the key")
    repeated = sorted({d for d in mapping if mapping.count(d) > 1})
    if repeated:
        raise ConfigError(f"{where} lists device(s) {repeated} more than once; a role uses each device once")
    outside = [d for d in mapping if not 0 <= d < total]
    if outside:
        raise ConfigError(
            f"{where} uses device {outside[0]}, but the cluster has {total} device(s) ({total // devices_per_node} "
            f"node(s) x {devices_per_node} {DEVICE_UNITS[device]}); use devices 0..{total - 1} or add nodes")
    if len(mapping) % num_workers:
        raise ConfigError(
            f"{where} lists {len(mapping)} devices for roles.{role}.num_workers={num_workers}; every worker gets "
            f"the same number of devices, so give a multiple of {num_workers} devices or change num_workers")
    per_worker = len(mapping) // num_workers
    workers = []
    for index in range(num_workers):
        devices = tuple(mapping[index * per_worker:(index + 1) * per_worker])
        nodes = {d // devices_per_node for d in devices}
        if len(nodes) > 1:
            raise ConfigError(
                f"{where}: worker {index} of {role} would span nodes {sorted(nodes)} (devices {list(devices)}); "
                f"a worker's devices must be on one node of {devices_per_node} devices")
        threads = len(devices) if device == "cpu" else max(1, int(num_cpus))
        workers.append(WorkerPlacement(role, index, devices, nodes.pop(),
                                       tuple(d % devices_per_node for d in devices), threads))
    return workers
