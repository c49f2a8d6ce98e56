"""Each role's workers as Ray actors, placed by the plan (`rollflow.cluster.placement`).

With a device_mapping, one Ray placement group reserves every node's devices (one bundle per node, on
distinct nodes) and each worker is scheduled into its node's bundle; rollflow itself assigns devices inside
the bundle (CPU affinity / CUDA_VISIBLE_DEVICES), so colocated roles can share a device. Workers reserve no
Ray resources of their own: the placement group holds the devices, the plan says who uses which.

Without a device_mapping (the CPU default) there is no placement group: workers reserve 0 CPUs, time-share
the machine and pin their torch threads to `num_cpus`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollflow.cluster.placement import PlacementPlan, WorkerPlacement, plan_placement
from rollflow.config import RunConfig
from rollflow.data.sample import Batch
from rollflow.errors import ConfigError


class WorkerGroup:
    """The Ray actors of one role, with the two ways the driver calls them.

    Args:
        role: the role name.
        handles: actor handles, in worker-index order.
        placements: where each worker runs.
    """

    def __init__(self, role: str, handles: list, placements: list[WorkerPlacement]):
        self.role = role
        self.handles = handles
        self.placements = placements

    def __len__(self) -> int:
        return len(self.handles)

    def call(self, method: str, *args: Any) -> Any:
        """Call `method` on every worker with the same arguments (put in the object store once) and return
        worker 0's result. For data-parallel ranks, whose results agree (global metrics, gathered tensors)."""
        return ray.get(self.call_async(method, *args))[0]

    def call_async(self, method: str, *args: Any) -> list[ray.ObjectRef]:
        """`method` on every worker, same arguments; returns the result refs in worker order."""
        if len(self.handles) > 1:
            args = tuple(ray.put(a) if isinstance(a, (Batch, torch.Tensor, dict)) else a for a in args)
        return [getattr(handle, method).remote(*args) for handle in self.handles]

    def map_rows(self, method: str, batch: Batch) -> torch.Tensor:
        """Split `batch` into contiguous row blocks, one per worker, call `method` on each block and
        concatenate the [b, T] results: plain data parallelism for workers with no collectives."""
        blocks = [rows for rows in torch.arange(batch.size).tensor_split(len(self.handles)) if rows.numel()]
        refs = [getattr(handle, method).remote(batch.select(rows))
                for handle, rows in zip(self.handles, blocks)]
        parts = ray.get(refs)
        width = max(part.shape[1] for part in parts)
        return torch.cat([torch.nn.functional.pad(part, (0, width - part.shape[1])) for part in parts])

    def nodes(self) -> list[str]:
        """The Ray node id each worker runs on."""
        return ray.get([handle.node_id.remote() for handle in self.handles])

    def kill(self) -> None:
        for handle in self.handles:
            ray.kill(handle)


@dataclass
class RoleWorkers:
    """Every role's workers for one run."""

    plan: PlacementPlan
    actor_train: WorkerGroup
    actor_infer: WorkerGroup
    reference: WorkerGroup | None = None
    critic: WorkerGroup | None = None
    placement_group: PlacementGroup | None = None

    @property
    def groups(self) -> list[WorkerGroup]:
        """The started roles' groups."""
        return [g for g in (self.actor_train, self.actor_infer, self.reference, self.critic) if g is not None]

    def shutdown(self) -> None:
        """Kill every worker and release the placement group (when the Ray session outlives the run)."""
        for group in self.groups:
            group.kill()
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)


def cluster_shape(config: RunConfig) -> tuple[int, int]:
    """(devices per node, nodes) of the running Ray cluster, as the plan counts them.

    `cluster.num_devices` overrides the per-node count (e.g. use 2 of a node's 8 cores); otherwise a node's
    CPUs (device "cpu") or GPUs (device "gpu") as Ray sees them, the smallest over the nodes that have any.
    """
    resource = "CPU" if config.cluster.device == "cpu" else "GPU"
    counts = [int(node["Resources"].get(resource, 0)) for node in ray.nodes() if node["Alive"]]
    counts = [count for count in counts if count > 0]
    if not counts:
        raise ConfigError(f"cluster.device is {config.cluster.device} but no Ray node has any {resource}")
    return config.cluster.num_devices or min(counts), len(counts)


def roles_needed(config: RunConfig) -> list[str]:
    roles = ["actor_train", "actor_infer"]
    if config.algorithm.needs_reference and config.roles.actor_train.lora is None:
        roles.append("reference")  # with LoRA the reference is the base model inside actor_train
    if config.algorithm.needs_critic:
        roles.append("critic")
    return roles


def create_role_workers(config: RunConfig) -> RoleWorkers:
    """Plan the placement, start every role's workers and wait until they are ready (construction errors
    such as a bad model path surface here, not at the first call)."""
    from rollflow.workers.actor_train import ActorTrainWorker
    from rollflow.workers.critic import CriticWorker
    from rollflow.workers.reference import ReferenceWorker
    from rollflow.workers.rollout import RolloutWorker

    devices_per_node, num_nodes = cluster_shape(config)
    plan = plan_placement(config, roles_needed(config), devices_per_node, num_nodes)
    bundles = _reserve(plan)

    def start(role: str, worker_class, *args) -> WorkerGroup:
        placements = plan.workers[role]
        remote_class = ray.remote(worker_class)
        handles = [remote_class.options(**_actor_options(bundles, p)).remote(config, p, *args)
                   for p in placements]
        return WorkerGroup(role, handles, placements)

    world_size = len(plan.workers["actor_train"])
    actor_train = start("actor_train", ActorTrainWorker, world_size)
    actor_infer = start("actor_infer", RolloutWorker)
    reference = start("reference", ReferenceWorker) if "reference" in plan.workers else None
    critic = start("critic", CriticWorker) if "critic" in plan.workers else None
    workers = RoleWorkers(plan, actor_train, actor_infer, reference, critic, bundles)
    try:
        ray.get([handle.__ray_ready__.remote() for group in workers.groups for handle in group.handles])
        # Data-parallel ranks meet at rank 0's address, then build their backends together (collective).
        master_addr, master_port = ray.get(actor_train.handles[0].rendezvous_address.remote())
        ray.get(actor_train.call_async("init_backend", master_addr, master_port))
        if config.cluster.weight_sync_transport == "broadcast":
            _open_broadcast(actor_train, actor_infer)
    except Exception:
        workers.shutdown()
        raise
    return workers


def _open_broadcast(actor_train: WorkerGroup, actor_infer: WorkerGroup) -> None:
    """Form the weight-broadcast group: trainer rank 0 hosts it, engine worker i joins as rank i + 1."""
    trainer = actor_train.handles[0]
    host, port = ray.get(trainer.rendezvous_address.remote())
    world_size = len(actor_infer) + 1
    ray.get([trainer.open_broadcast.remote(host, port, world_size),
             *[engine.open_broadcast.remote(host, port, rank + 1, world_size)
               for rank, engine in enumerate(actor_infer.handles)]])


def _reserve(plan: PlacementPlan) -> PlacementGroup | None:
    """One placement-group bundle per node holding all of its devices, each bundle on its own node."""
    if not plan.placed:
        return None
    resource = "CPU" if plan.device == "cpu" else "GPU"
    bundles = [{resource: float(plan.devices_per_node)} for _ in range(plan.num_nodes)]
    group = placement_group(bundles, strategy="STRICT_SPREAD" if plan.num_nodes > 1 else "PACK")
    try:
        ray.get(group.ready(), timeout=60)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise ConfigError(
            f"could not reserve {plan.num_nodes} node(s) x {plan.devices_per_node} {resource} for the "
            "placement plan within 60 s; free the cluster or lower cluster.num_devices") from None
    return group


def _actor_options(bundles: PlacementGroup | None, placement: WorkerPlacement) -> dict[str, Any]:
    """No Ray resources of its own; inside its node's bundle when the run is placed."""
    options: dict[str, Any] = {"num_cpus": 0}
    if bundles is not None and placement.node is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            bundles, placement_group_bundle_index=placement.node)
    return options


def reference_config(config: RunConfig) -> RunConfig:
    """The config the reference worker sees: `model.path` replaced by `roles.reference.model_path` if set."""
    teacher = config.roles.reference.model_path
    if teacher is None:
        return config
    return config.model_copy(update={"model": config.model.model_copy(update={"path": teacher})})
