"""Worker groups: the Ray actors of one role, spawned from a worker class and the plan's placements.

Nothing here names a role or a worker class: `spawn_group` is handed the class it starts, and the caller
(`rollflow.workers.roles`) decides which roles a run has, their classes and their start order.

With a device_mapping, one Ray placement group reserves every node's devices (one bundle per node, on
distinct nodes, `reserve_bundles`) and each worker is scheduled into its node's bundle (on a cluster of one
node the bundle only reserves the devices, and the workers are scheduled without it: `WorkerGroups.spawn`);
rollflow itself assigns devices inside the bundle (CPU affinity / CUDA_VISIBLE_DEVICES), so colocated roles
can share a device. Workers reserve no Ray resources of their own: the placement group holds the devices,
the plan says who uses which. Without a device_mapping (the CPU default) there is no placement group: workers reserve 0
CPUs, time-share the machine and pin their torch threads to their share.
"""

from __future__ import annotations

import gc
import inspect
import re
import threading
import time
import traceback
from collections.abc import Hashable, Iterator, Mapping
from typing import Any

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollflow.cluster import calls
from rollflow.cluster.placement import PlacementPlan, WorkerPlacement
from rollflow.cluster.pool import worker_pool
from rollflow.data.sample import Batch
from rollflow.errors import ConfigError, RollflowError
from rollflow.spans import take as take_spans
from rollflow.spans import traced

START_TIMEOUT_S = 1800.0  # a worker that has not built its model by then is stuck (big models load for minutes)
CLOSE_TIMEOUT_S = 30.0  # how long shutdown waits for a worker's close() before killing it anyway
CANCEL_POLL_S = 0.2  # how often a cancellable wait for starting workers looks whether it was cancelled
SPANS_TIMEOUT_S = 10.0  # how long the end of a run waits for a worker's timeline spans


class WorkerStartError(RollflowError):
    """A worker's constructor failed (bad model path, missing API key, ...) or it never became ready.

    `details` holds the constructor's traceback when its error was not a RollflowError, for a file in the run
    directory (the message is one line)."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


class StartCancelled(Exception):
    """Raised by a wait for workers to start once its caller cancelled the start (`wait_ready(cancelled=...)`)."""


class WorkerGroup:
    """The Ray actors of one role, with the two ways the driver calls them.

    Every wait on a result is bounded by `timeout_s` and fails in one line naming the role, the worker and
    the method (`rollflow.cluster.calls`).

    Args:
        role: the role name.
        handles: actor handles, in worker-index order.
        placements: where each worker runs.
        timeout_s: most seconds a wait on this group's calls goes without any result (`cluster.watchdog_s`).
        host: the role whose workers also serve this role (`WorkerGroups.host`); None for workers of its own.
    """

    def __init__(self, role: str, handles: list, placements: list[WorkerPlacement],
                 timeout_s: float = calls.DEFAULT_WATCHDOG_S, host: str | None = None,
                 pool_keys: list[Hashable] | None = None):
        self.role = role
        self.handles = handles
        self.placements = placements
        self.timeout_s = timeout_s
        self.host = host  # the role whose workers serve this one too (a hybrid worker), or None
        # each worker's key in the worker pool (`rollflow.cluster.pool`); None: its workers are never kept
        self.pool_keys = pool_keys
        self.rebuilt: dict[int, ray.ObjectRef] = {}  # worker index -> its rebuild's `start_error`, if adopted

    def __len__(self) -> int:
        return len(self.handles)

    def call(self, method: str, *args: Any) -> Any:
        """Call `method` on every worker with the same arguments (put in the object store once) and return
        worker 0's result. For data-parallel ranks, whose results agree (global metrics, gathered tensors)."""
        return self.get(self.call_async(method, *args), method)[0]

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """`method` on every worker, same arguments; returns every worker's result, in worker order."""
        return self.get(self.call_async(method, *args), method)

    def call_async(self, method: str, *args: Any) -> list[ray.ObjectRef]:
        """`method` on every worker, same arguments; returns the result refs in worker order (wait on them
        with `get`)."""
        if len(self.handles) > 1:
            args = tuple(ray.put(a) if isinstance(a, (Batch, torch.Tensor, dict)) else a for a in args)
        return [getattr(handle, method).remote(*args) for handle in self.handles]

    def get(self, refs: list[ray.ObjectRef], method: str, indices: list[int] | None = None) -> list[Any]:
        """The results of `refs` (`method` on workers `indices`, default every worker in order), bounded by
        `timeout_s`; a failure raises one line (`rollflow.cluster.calls.get`)."""
        return calls.get(refs, self.role, method, indices, self.timeout_s)

    def map_rows(self, method: str, batch: Batch, *args: Any) -> torch.Tensor:
        """Split `batch` into contiguous row blocks, one per worker, call `method(block, *args)` on each and
        concatenate the [b, T, ...] results: plain data parallelism for workers with no collectives."""
        blocks = [rows for rows in torch.arange(batch.size).tensor_split(len(self.handles)) if rows.numel()]
        refs = [getattr(handle, method).remote(batch.select(rows), *args)
                for handle, rows in zip(self.handles, blocks)]
        parts = self.get(refs, method, list(range(len(refs))))
        width = max(part.shape[1] for part in parts)
        return torch.cat([torch.nn.functional.pad(part, (0, 0) * (part.dim() - 2) + (0, width - part.shape[1]))
                          for part in parts])

    def nodes(self) -> list[str]:
        """The Ray node id each worker runs on."""
        return self.get([handle.node_id.remote() for handle in self.handles], "node_id")

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S, cancelled: threading.Event | None = None) -> None:
        """Block until every worker's constructor has run; the first constructor to fail raises at once.

        Args:
            cancelled: when set (checked every `CANCEL_POLL_S`), stop waiting and raise `StartCancelled`.

        Raises:
            WorkerStartError: one line with the constructor's own error (not Ray's traceback; the worker's
                traceback of a non-rollflow error in `details`), or a timeout.
        """
        # answered once constructed; an adopted worker's rebuild answers for it (a call without arguments could
        # run before the rebuild, whose arguments may still be on their way)
        pending = {self.rebuilt.get(index) or handle.start_error.remote(): handle
                   for index, handle in enumerate(self.handles)}
        deadline = time.monotonic() + timeout_s
        try:
            while pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WorkerStartError(f"{self.role} workers did not start within {timeout_s:.0f} s")
                ready, _ = ray.wait(list(pending), num_returns=1,
                                    timeout=min(remaining, CANCEL_POLL_S) if cancelled else remaining)
                for ref in ready:
                    handle = pending.pop(ref)
                    failure = ray.get(ref)
                    if failure is not None:
                        ray.kill(handle)  # constructed only in part: of no use, and its close() might not cope
                        message, details = failure
                        raise WorkerStartError(f"{self.role}: a worker failed to start: {message}", details)
                if cancelled is not None and cancelled.is_set():
                    raise StartCancelled
        except ray.exceptions.RayError as error:  # the constructor ended its process (SystemExit, a crash)
            raise WorkerStartError(f"{self.role}: a worker failed to start: {root_cause(error)}") from None

    def gather_spans(self, timeout_s: float = SPANS_TIMEOUT_S) -> list[dict[str, Any]]:
        """Every worker's recorded spans (`rollflow.spans`); a worker that is dead or does not answer
        within `timeout_s` contributes none."""
        gathered = []
        for handle in self.handles:
            try:
                gathered += ray.get(handle.pop_spans.remote(), timeout=timeout_s)
            except (ray.exceptions.RayError, AttributeError):
                continue
        return gathered

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Ask every worker to `close()` (engines and backends release what they hold), then kill them; or,
        when this process keeps workers (`rollflow.cluster.pool.keep_workers`) and every worker closed, park
        them for the next run."""
        pool = worker_pool()
        parking = pool is not None and self.pool_keys is not None
        try:  # a worker to be kept also lets go of what it built (its model, its engine): it waits emptied
            ray.get([(handle.park_worker if parking else handle.close).remote() for handle in self.handles],
                    timeout=timeout_s)
            closed = True
        except (ray.exceptions.RayError, AttributeError):
            closed = False  # a dead or stuck worker is killed below all the same
        if closed and parking:
            for key, handle in zip(self.pool_keys, self.handles):
                pool.park(key, handle)
            return
        for handle in self.handles:
            ray.kill(handle)

    def abandon(self) -> None:
        """Stop a start that was cancelled (a bad input found while the workers started): kill the workers
        still in their constructors, at once. An adopted worker (`rollflow.cluster.pool`) rebuilds in ~1 s in a
        process that has its imports already: it is let finish and parked again, not killed (a new process for
        the next run would cost ~7 CPU-s of imports)."""
        pool = worker_pool()
        for index, handle in enumerate(self.handles):
            rebuild = self.rebuilt.get(index)
            if pool is not None and self.pool_keys is not None and rebuild is not None:
                try:
                    if ray.get(rebuild, timeout=CLOSE_TIMEOUT_S) is None:  # rebuilt without an error
                        ray.get(handle.park_worker.remote(), timeout=CLOSE_TIMEOUT_S)
                        pool.park(self.pool_keys[index], handle)
                        continue
                except ray.exceptions.RayError:
                    pass  # dead or stuck: killed below
            ray.kill(handle)


def spawn_group(role: str, worker_cls: type, placements: list[WorkerPlacement],
                bundles: PlacementGroup | None = None, *args: Any,
                timeout_s: float = calls.DEFAULT_WATCHDOG_S, keyed_devices: bool = False) -> WorkerGroup:
    """Start one Ray actor of `worker_cls` per placement: `worker_cls(placement, *args)`.

    Returns at once; the constructors run in the background (`WorkerGroup.wait_ready` waits for them).

    Args:
        role: the role name (for messages and metrics).
        worker_cls: the worker class (a plain class; it is wrapped with `ray.remote` here).
        placements: one per worker, from the plan.
        bundles: the placement group the workers are scheduled into (`reserve_bundles`), or None: they are
            scheduled without one (nothing is placed, or the plan's one node is the cluster's only node).
        *args: the rest of each worker's constructor arguments.
        timeout_s: the group's bound on waiting for a result (`cluster.watchdog_s`).
        keyed_devices: a kept worker serves only a placement with the same local devices (GPUs: a process
            cannot change the devices it sees once CUDA started); CPU workers re-pin their cores.
    """
    # once per group, not per worker; each call of a worker method is a span of the run's timeline
    remote_class = ray.remote(keeping_start_error(traced(worker_cls,
                                                         lambda placement, *_: f"{role} {placement.index}")))
    pool = worker_pool()
    # a placement group's actors end with it: only workers scheduled without one are kept
    # not the worker's index: a rebuild takes its placement (and its lane's name) from the new arguments
    keys = ([(f"{worker_cls.__module__}:{worker_cls.__qualname__}", role,
              placement.local_devices if keyed_devices else ())
             for placement in placements] if bundles is None else None)
    handles, rebuilt = [], {}
    for index, placement in enumerate(placements):
        handle = pool.take(keys[index]) if pool is not None and keys is not None else None
        if handle is None:
            handle = remote_class.options(**_actor_options(bundles, placement)).remote(placement, *args)
        else:  # a kept worker of the same shape: its constructor runs again, in its process
            rebuilt[index] = handle.rebuild_worker.remote(placement, *args)
        handles.append(handle)
    group = WorkerGroup(role, handles, placements, timeout_s, pool_keys=keys)
    group.rebuilt = rebuilt
    return group


def keeping_start_error(worker_cls: type) -> type:
    """`worker_cls` whose constructor keeps the exception it raised instead of raising it, for the driver to ask
    for (`start_error()`: None, or (`Type: first line`, the traceback for a non-rollflow error, else "")).

    An exception out of an actor's constructor makes Ray print the worker's traceback on the driver's console
    (it forwards the worker's stderr), ahead of the one line the driver prints. A constructor that returns
    prints nothing; `WorkerGroup.wait_ready` kills the worker and raises its error as one line.

    It also has what a worker kept between runs needs (`rollflow.cluster.pool`): `park_worker()` (close, then
    drop what the constructor built) and `rebuild_worker(*args)` (the constructor again, in this process).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._start_error = None
        try:
            worker_cls.__init__(self, *args, **kwargs)
        except Exception as err:  # noqa: BLE001 -- reported to the driver by `start_error`
            if isinstance(err, RollflowError):  # its message already says what is wrong, in one line
                self._start_error = (str(err).strip().splitlines()[0] if str(err).strip() else calls.one_line(err), "")
            else:
                self._start_error = (calls.one_line(err), traceback.format_exc())

    def let_go(self) -> None:
        """Drop everything the constructor built, once `close()` ran: a worker kept for a later run
        (`rollflow.cluster.pool`) holds no model or engine while it waits."""
        take_spans()  # recorded after the run took its timeline
        self.__dict__.clear()
        gc.collect()

    def rebuild(self, *args: Any, **kwargs: Any) -> tuple[str, str] | None:
        """Construct again, in this process, as a new worker would be (a kept worker adopted by the next run:
        `rollflow.cluster.pool`). Returns what `start_error()` would."""
        self.__dict__.clear()
        __init__(self, *args, **kwargs)
        return self._start_error

    # a coroutine in an async actor (one with any coroutine method), as `rollflow.spans.traced`'s `pop_spans`
    if any(inspect.iscoroutinefunction(member) for _, member in inspect.getmembers(worker_cls)):
        async def start_error(self) -> tuple[str, str] | None:
            return self._start_error

        async def rebuild_worker(self, *args: Any, **kwargs: Any) -> tuple[str, str] | None:
            return rebuild(self, *args, **kwargs)

        async def park_worker(self) -> None:
            """`close()`, then `let_go`."""
            try:
                close = self.close()
                if inspect.isawaitable(close):  # an async actor's close may be either
                    await close
            finally:
                let_go(self)
    else:
        def start_error(self) -> tuple[str, str] | None:
            return self._start_error

        def park_worker(self) -> None:
            """`close()`, then `let_go`."""
            try:
                self.close()
            finally:
                let_go(self)

        rebuild_worker = rebuild
    members = {"__init__": __init__, "start_error": start_error, "rebuild_worker": rebuild_worker,
               "park_worker": park_worker, "__module__": worker_cls.__module__, "__doc__": worker_cls.__doc__}
    return type(worker_cls.__name__, (worker_cls,), members)


class WorkerGroups(Mapping[str, WorkerGroup]):
    """Every started role's group for one run, by role name, in start order.

    Args:
        plan: the placement plan they were started from.
        bundles: the placement group reserved for the plan (None when nothing is placed).
        timeout_s: every group's bound on waiting for a result (`cluster.watchdog_s`).
    """

    def __init__(self, plan: PlacementPlan, bundles: PlacementGroup | None = None,
                 timeout_s: float = calls.DEFAULT_WATCHDOG_S):
        self.plan = plan
        self.bundles = bundles
        self.timeout_s = timeout_s
        self.groups: dict[str, WorkerGroup] = {}
        # the plan's node is the cluster's only one: workers need not be scheduled into the bundle to land there
        self.on_one_node = bundles is not None and plan.num_nodes == 1 and _alive_nodes() == 1

    def spawn(self, role: str, worker_cls: type, *args: Any) -> WorkerGroup:
        """`spawn_group` for `role` with the plan's placements; the group joins this mapping.

        On a cluster of one node the placement group only reserves the devices and the workers are scheduled
        without it (on that node all the same): a process that keeps workers between runs
        (`rollflow.cluster.pool`) keeps these too, where the placement group's end would take them with it."""
        self.groups[role] = spawn_group(role, worker_cls, self.plan.workers[role],
                                        None if self.on_one_node else self.bundles, *args,
                                        timeout_s=self.timeout_s, keyed_devices=self.plan.device == "gpu")
        return self.groups[role]

    def host(self, role: str) -> WorkerGroup:
        """Make `role` a second name for the workers of the role the plan hosts it in (`PlacementPlan.host`:
        hybrid workers that serve both roles): calls on either group reach the same actors, which start,
        report spans and shut down once, as the host."""
        host = self.plan.hosted[role]
        self.groups[role] = WorkerGroup(role, self.groups[host].handles, self.plan.workers[role], self.timeout_s,
                                        host=host)
        return self.groups[role]

    def own(self) -> list[WorkerGroup]:
        """The groups of workers of their own (not hosted by another role's)."""
        return [group for group in self.groups.values() if group.host is None]

    def wait_ready(self, cancelled: threading.Event | None = None) -> None:
        """Wait for every group's workers (all constructors run concurrently); the first failure raises.
        `cancelled`: see `WorkerGroup.wait_ready`."""
        for group in self.own():
            group.wait_ready(cancelled=cancelled)

    def gather_spans(self) -> list[dict[str, Any]]:
        """Every worker's timeline spans, all roles (see `WorkerGroup.gather_spans`)."""
        return [span for group in self.own() for span in group.gather_spans()]

    def shutdown(self, close: bool = True) -> None:
        """Close and kill every worker, then release the placement group (the Ray session may outlive the
        run). `close=False` kills without asking them to close first (a close waits for a constructor still
        running: a cancelled start does not; `WorkerGroup.abandon`)."""
        for group in self.own():
            if close:
                group.close()
            else:
                group.abandon()
        if self.bundles is not None:
            remove_placement_group(self.bundles)
            self.bundles = None

    def __getitem__(self, role: str) -> WorkerGroup:
        return self.groups[role]

    def __iter__(self) -> Iterator[str]:
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)


def cluster_shape(device: str, num_devices: int | None = None) -> tuple[int, int]:
    """(devices per node, nodes) of the running Ray cluster, as the plan counts them.

    Args:
        device: "cpu", "gpu" or "sim" (`cluster.device`; "sim": `num_devices` simulated GPUs on one node).
        num_devices: overrides the per-node count (e.g. use 2 of a node's 8 cores); otherwise a node's CPUs
            or GPUs as Ray sees them, the smallest over the nodes that have any.
    """
    if device == "sim":  # simulated GPUs: as many as the config says, on one node, no Ray resources
        if not num_devices:
            raise ConfigError("cluster.device sim needs cluster.num_devices: the simulated GPUs of the cluster")
        return num_devices, 1
    resource = "CPU" if device == "cpu" else "GPU"
    counts = [int(node["Resources"].get(resource, 0)) for node in ray.nodes() if node["Alive"]]
    counts = [count for count in counts if count > 0]
    if not counts:
        raise ConfigError(f"cluster.device is {device} but no Ray node has any {resource}")
    return num_devices or min(counts), len(counts)


def reserve_bundles(plan: PlacementPlan) -> PlacementGroup | None:
    """One placement-group bundle per node holding all of its devices, each bundle on its own node; None when
    the plan places nothing or its devices are simulated."""
    if not plan.placed or plan.device == "sim":  # simulated GPUs hold no Ray resources
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


def _alive_nodes() -> int:
    """How many nodes the running Ray cluster has."""
    return sum(1 for node in ray.nodes() if node["Alive"])


def _actor_options(bundles: PlacementGroup | None, placement: WorkerPlacement) -> dict[str, Any]:
    """No Ray resources of its own; inside its node's bundle when the run is placed."""
    options: dict[str, Any] = {"num_cpus": 0}
    if bundles is not None and placement.node is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            bundles, placement_group_bundle_index=placement.node)
    return options


def root_cause(error: BaseException) -> str:
    """The exception a failed actor constructor raised, as `Type: first line of its message`.

    Ray reports it as text: a traceback whose first unindented line after the last `File "..."` frame is
    the original `module.Type: message`.
    """
    lines = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).splitlines()
    frames = [i for i, line in enumerate(lines) if line.lstrip().startswith('File "')]
    for line in lines[frames[-1] + 1:] if frames else []:
        if line and not line[0].isspace():
            return re.sub(r"^[\w.]+\.(?=\w+: )", "", line)  # drop the module path of the type
    return lines[0] if lines else type(error).__name__
