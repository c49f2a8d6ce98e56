"""Role wiring: which worker class serves each role, how roles without devices of their own are placed, the
order roles start in, the rendezvous of data-parallel ranks and the weight-broadcast group.

`rollflow.cluster` places and spawns worker groups given a worker class and names no role; this module is
where role names meet worker classes. A pipeline says which roles it needs (`PIPELINES[name].roles`) and
starts them with `start_roles`.

Every role worker is constructed as `cls(placement, spec)`, its spec the typed part of the run config its role
reads (`rollflow.workers.specs.worker_specs`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import ray
import torch

from rollflow.cluster import calls
from rollflow.cluster.groups import (
    START_TIMEOUT_S,
    StartCancelled,
    WorkerGroup,
    WorkerGroups,
    cluster_shape,
    reserve_bundles,
)
from rollflow.cluster.placement import PlacementPlan, plan_placement
from rollflow.cluster.prestart import prestarted_ray_up
from rollflow.cluster.ray_session import start_ray, stop_ray
from rollflow.config import RoleConfig, RunConfigBase
from rollflow.data.sample import Batch
from rollflow.errors import ConfigError
from rollflow.registry import Registry, import_object
from rollflow.spans import record, span
from rollflow.workers.specs import TRAINER_ROLES, HybridSpec, worker_specs

# role -> "module:Class" of its worker; the module is imported when the role starts.
ROLE_WORKERS: Registry[str] = Registry("role")
ROLE_WORKERS.register("actor_train")("rollflow.workers.actor_train:ActorTrainWorker")
ROLE_WORKERS.register("actor_infer")("rollflow.workers.rollout:RolloutWorker")
ROLE_WORKERS.register("reference")("rollflow.workers.reference:ReferenceWorker")
ROLE_WORKERS.register("critic")("rollflow.workers.critic:CriticWorker")
ROLE_WORKERS.register("reward")("rollflow.workers.reward:RewardWorker")
ROLE_WORKERS.register("env")("rollflow.workers.env:EnvWorker")

# The worker that serves actor_train and actor_infer in one process (`roles.actor_infer.hybrid`).
HYBRID_WORKER = "rollflow.workers.hybrid:HybridWorker"

# Roles that must say where they run once any role has a device_mapping.
CORE_ROLES = ("actor_train", "actor_infer")
# Roles that follow actor_train's devices when they have no device_mapping of their own (ROLL colocates the
# reference and the critic with the trainer by default).
FOLLOWS_ACTOR_TRAIN = ("reference", "critic")


def role_specs(config: RunConfigBase, roles: Sequence[str]) -> dict[str, RoleConfig]:
    """Each role's config section, with the defaults the plan applies: once any role has a device_mapping,
    actor_train and actor_infer need one, and the reference and critic follow actor_train's devices unless
    they have their own. A role without a mapping then shares the machine (the CPU default).

    Raises:
        ConfigError: a core role without a mapping in a placed run, or a GPU run with no mapping at all.
    """
    for role in roles:
        ROLE_WORKERS.get(role)  # an unknown role is a bug in the pipeline, named here
    specs = {role: config.roles.of(role) for role in roles}
    if any(spec.device_mapping is not None for spec in specs.values()):
        for core in CORE_ROLES:
            if core in specs and specs[core].device_mapping is None:
                raise ConfigError(f"roles.{core}.device_mapping is missing: once any role has a device_mapping, "
                                  "actor_train and actor_infer need one too")
        for role in FOLLOWS_ACTOR_TRAIN:
            if role in specs and specs[role].device_mapping is None:
                mapping = specs["actor_train"].device_mapping
                specs[role] = specs[role].model_copy(update={"device_mapping": mapping})
    elif config.cluster.device == "gpu":
        raise ConfigError("cluster.device is gpu but no role has a device_mapping; give actor_train and "
                          "actor_infer one (e.g. device_mapping: [0, 1, 2, 3])")
    return specs


def plan_roles(config: RunConfigBase, roles: Sequence[str], devices_per_node: int,
               num_nodes: int = 1) -> PlacementPlan:
    """The validated placement plan of `roles` on a cluster of `num_nodes` x `devices_per_node` devices. A
    hybrid engine is planned inside actor_train's worker."""
    hybrid = is_hybrid(config, roles)
    specs = {role: spec for role, spec in role_specs(config, roles).items() if not (hybrid and role == "actor_infer")}
    plan = plan_placement(specs, config.cluster.device, devices_per_node, num_nodes)
    if hybrid:
        plan.host("actor_infer", "actor_train")
    return plan


def is_hybrid(config: RunConfigBase, roles: Sequence[str]) -> bool:
    """Whether actor_train's worker serves actor_infer too (`roles.actor_infer.hybrid`, both roles run)."""
    return config.roles.actor_infer.hybrid and "actor_train" in roles and "actor_infer" in roles


def describe_plan(config: RunConfigBase, roles: Sequence[str]) -> str:
    """The placement plan as `rollflow train --print-plan` prints it. Joins the Ray cluster when
    `cluster.address` is set (to count its nodes); otherwise plans for this machine without Ray."""
    if config.cluster.address:
        start_ray(config.cluster.address)
        try:
            devices_per_node, num_nodes = cluster_shape(config.cluster.device, config.cluster.num_devices)
        finally:
            stop_ray()
    else:
        if config.cluster.device == "sim":
            devices_per_node, num_nodes = cluster_shape("sim", config.cluster.num_devices)
        else:
            local = len(os.sched_getaffinity(0)) if config.cluster.device == "cpu" else torch.cuda.device_count()
            devices_per_node, num_nodes = config.cluster.num_devices or config.cluster.num_cpus or local, 1
    return plan_roles(config, roles, devices_per_node, num_nodes).describe()


def start_roles(config: RunConfigBase, roles: Sequence[str], specs: Mapping[str, Any] | None = None,
                cancelled: threading.Event | None = None) -> WorkerGroups:
    """Plan, place and start every role's workers, wait until they are ready, build the trainers' backends
    (data-parallel ranks meet first) and open the weight-broadcast group if the run uses one.

    Args:
        config: the run config.
        roles: the roles to start, in start order (all start concurrently; the order is the plan's).
        specs: each role's worker spec (`worker_specs`; by default from `config`, actor_train training the
            policy gradient).
        cancelled: when set while the workers start, kill them and raise `StartCancelled`.

    Returns:
        The started groups. The caller shuts them down (`running_roles` does).

    Raises:
        ConfigError: a plan the cluster cannot hold. WorkerStartError: a worker that failed to start.
        StartCancelled: `cancelled` was set.
    """
    specs = specs if specs is not None else worker_specs(config, roles)
    devices_per_node, num_nodes = cluster_shape(config.cluster.device, config.cluster.num_devices)
    plan = plan_roles(config, roles, devices_per_node, num_nodes)
    groups = WorkerGroups(plan, reserve_bundles(plan), timeout_s=config.cluster.watchdog_s)
    try:
        for role in roles:
            if role in plan.hosted:  # served by its host's workers
                continue
            if role in plan.hosted.values():  # one worker for both roles
                guest = next(hosted for hosted, host in plan.hosted.items() if host == role)
                groups.spawn(role, import_object(HYBRID_WORKER), HybridSpec(specs[role], specs[guest]))
            else:
                groups.spawn(role, import_object(ROLE_WORKERS[role]), specs[role])
        for role in plan.hosted:
            groups.host(role)
        groups.wait_ready(cancelled)
        _init_backends([groups[role] for role in TRAINER_ROLES if role in groups])
        if config.cluster.weight_sync_transport == "broadcast":
            _open_broadcast(groups["actor_train"], groups["actor_infer"])
    except BaseException as err:
        groups.shutdown(close=not isinstance(err, StartCancelled))  # a close waits for a running constructor
        raise
    return groups


class RoleLaunch:
    """A run's roles, started in a thread of the driver from the moment it is made, so that what the driver
    does meanwhile (reading and encoding every prompt, ~2-3 s) overlaps the workers' start (their imports of
    torch and transformers, ~7 s, in processes of their own). Ray (if managed) starts first, on the caller's
    thread: Ray's start is mostly Python in this process, which a thread would only share the GIL with. A bad
    input still stops the run before any step: the driver checks under `cancelled_on_error`, which stops
    whatever was started (workers killed mid-constructor, Ray shut down) and re-raises. Says on stdout what it
    starts, and when it is ready.

        launch = RoleLaunch(config, roles, specs, manage_ray)   # returns once Ray is up
        with launch.cancelled_on_error():
            inputs = load_prompt_sets(config, roles)     # meanwhile, the workers start
        with launch.running(before_stop) as groups:      # waits for them; stops them on the way out
            ...

    Args:
        specs: each role's worker spec (`worker_specs`), built before Ray starts (a config error a spec finds
            comes first); None builds them from `config`.
        manage_ray: start Ray (per `config.cluster`) and shut it down at the end (a Ray this process had
            started already is used and left up). False runs in the caller's Ray session and leaves it up
            (tests run many short runs in one session).
    """

    def __init__(self, config: RunConfigBase, roles: Sequence[str], specs: Mapping[str, Any] | None = None,
                 manage_ray: bool = True):
        self.config, self.roles = config, list(roles)
        self.specs = specs if specs is not None else worker_specs(config, self.roles)
        self.groups: WorkerGroups | None = None
        self.error: BaseException | None = None  # what the start raised, re-raised by `running`
        self._stops_ray = manage_ray and not ray.is_initialized()  # only a Ray it started
        if manage_ray:
            if config.cluster.address:
                _say(f"joining Ray at {config.cluster.address} ...")
            elif not prestarted_ray_up():  # a prestarted Ray already waited for was said by whoever waited
                _say("starting Ray ...")
            started = time.time()
            how = start_ray(config.cluster.address, config.cluster.num_cpus)
            record("start ray", started, time.time(), how=how)  # how: see `start_ray`
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._start, name="rollflow-launch", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        try:
            started = time.perf_counter()
            _say(f"starting workers: {describe_roles(self.config, self.roles)} ...")
            with span("start workers"):
                self.groups = start_roles(self.config, self.roles, self.specs, self._cancelled)
            _say(f"workers ready in {time.perf_counter() - started:.1f} s")
        except StartCancelled:
            pass
        except BaseException as err:  # noqa: BLE001 -- the driver's thread raises it (`running`)
            self.error = err

    def cancel(self) -> None:
        """Stop the start and whatever it started; returns once all of it is stopped (workers still in their
        constructors are killed at once)."""
        self._cancelled.set()
        self._thread.join()
        groups, self.groups = self.groups, None
        self._stop(groups)

    def _stop(self, groups: WorkerGroups | None) -> None:
        """Shut `groups` down, then Ray if this launch started it (once)."""
        try:
            if groups is not None:
                groups.shutdown()
        finally:
            if self._stops_ray:
                self._stops_ray = False
                stop_ray()

    @contextlib.contextmanager
    def cancelled_on_error(self) -> Iterator[None]:
        """A block the start runs alongside; if the block raises (a bad input, Ctrl-C), `cancel`, then
        re-raise."""
        try:
            yield
        except BaseException:
            self.cancel()
            raise

    @contextlib.contextmanager
    def running(self, before_stop: Callable[[WorkerGroups], None] | None = None) -> Iterator[WorkerGroups]:
        """Wait for the start to finish (raising what it raised), yield the started groups; on the way out,
        normal or not, stop them all (and Ray, if managed).

        Args:
            before_stop: called with the started workers just before they stop (e.g. to take their
                timeline spans).
        """
        with self.cancelled_on_error():  # a signal while waiting
            while self._thread.is_alive():
                self._thread.join(0.1)
        groups = self.groups
        try:
            if self.error is not None:
                raise self.error
            try:
                yield groups
            finally:
                if before_stop is not None:
                    before_stop(groups)
        finally:
            self._stop(groups)


@contextlib.contextmanager
def running_roles(config: RunConfigBase, roles: Sequence[str], specs: Mapping[str, Any] | None = None,
                  manage_ray: bool = True, before_stop: Callable[[WorkerGroups], None] | None = None
                  ) -> Iterator[WorkerGroups]:
    """Start Ray (if managed) and `roles` now and wait for them (`RoleLaunch` with nothing to overlap); on the
    way out, normal or not, stop them all."""
    with RoleLaunch(config, roles, specs, manage_ray).running(before_stop) as groups:
        yield groups


def describe_roles(config: RunConfigBase, roles: Sequence[str]) -> str:
    """`actor_train x1 (torch), actor_infer x1 (hf), ...`: each role, its worker count and what it runs."""
    parts = []
    for role in roles:
        spec = config.roles.of(role)
        what = spec.backend if role in TRAINER_ROLES else spec.engine if role == "actor_infer" else None
        if role == "actor_infer" and is_hybrid(config, roles):
            what += ", inside actor_train"
        parts.append(f"{role} x{spec.num_workers}" + (f" ({what})" if what else ""))
    return ", ".join(parts)


def _say(message: str) -> None:
    """A start-up line on stdout, at once (a long silence at start-up looks like a hang)."""
    print(message, flush=True)


def _init_backends(trainers: list[WorkerGroup]) -> None:
    """Every worker of each trainer role builds its backend, all roles at once; the ranks of a role meet at
    worker 0's address (fsdp2 joins a process group there; the torch backend, one process per model, ignores
    it). Building a model is bounded like a constructor (`START_TIMEOUT_S`), or longer with a longer
    watchdog."""
    started = []
    for group in trainers:
        master_addr, master_port = group.get([group.handles[0].rendezvous_address.remote()],
                                             "rendezvous_address")[0]
        started.append((group, group.call_async("init_backend", master_addr, master_port, len(group))))
    for group, refs in started:
        calls.get(refs, group.role, "init_backend", timeout_s=max(group.timeout_s, START_TIMEOUT_S))


def _open_broadcast(actor_train: WorkerGroup, actor_infer: WorkerGroup) -> None:
    """Form the weight-broadcast group: trainer rank 0 hosts it, engine worker i joins as rank i + 1."""
    trainer = actor_train.handles[0]
    host, port = actor_train.get([trainer.rendezvous_address.remote()], "rendezvous_address")[0]
    world_size = len(actor_infer) + 1
    hosting = trainer.open_broadcast.remote(host, port, world_size)  # both sides start before either wait
    joining = [engine.open_broadcast.remote(host, port, rank + 1, world_size)
               for rank, engine in enumerate(actor_infer.handles)]
    actor_infer.get(joining, "open_broadcast")
    actor_train.get([hosting], "open_broadcast")


def forward_rows(group: WorkerGroup, backend: str, method: str, batch: Batch, *args: Any) -> torch.Tensor:
    """A frozen forward (`method(batch, *args)` returns [b, T, ...]) over a trainer role's workers: fsdp2 ranks
    each take the whole batch (a collective; they shard it themselves), torch replicas each take a block of
    rows."""
    if backend == "fsdp2":
        return group.call(method, batch, *args)
    return group.map_rows(method, batch, *args)
