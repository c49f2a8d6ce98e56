"""What every role worker shares: pinning to its placement, reporting where it runs, the offload / onload
state of colocated roles (`rollflow.cluster.colocation`), the rendezvous of data-parallel ranks, and
`close()` at shutdown."""

from __future__ import annotations

import os
import time

from rollflow.cluster.placement import WorkerPlacement
from rollflow.cluster.runtime import free_port, memory_usage, pin_worker
from rollflow.errors import NonFiniteError


class PlacedWorker:
    """Base of the role workers (one level of inheritance): pins the process to its devices and threads.

    Subclasses holding a backend get `offload()` / `onload()` and `close()` for free (they call the
    backend's); workers holding an engine or scorers override them. They call `require_resident(op)` before
    using the model.

    Args:
        placement: where this worker runs (from the placement plan).
        device: "cpu" or "gpu" (`cluster.device`).
    """

    backend = None

    def __init__(self, placement: WorkerPlacement, device: str = "cpu"):
        self.placement = placement
        self.threads = pin_worker(placement.threads, placement.local_devices, device)
        self.resident = True

    def node_id(self) -> str:
        """The Ray node this worker runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def offload(self) -> dict[str, float]:
        """Move weights and optimizer state off the device (a no-op move on CPU); report time and memory."""
        started = time.perf_counter()
        if self.resident and self.backend is not None:
            self.backend.offload()
        self.resident = False
        return move_report(started)

    def onload(self) -> dict[str, float]:
        """Bring weights and optimizer state back; report time and memory."""
        started = time.perf_counter()
        if not self.resident and self.backend is not None:
            self.backend.onload()
        self.resident = True
        return move_report(started)

    @staticmethod
    def preload(backend: str, model_path: str, trust_remote_code: bool = False) -> None:
        """Import a trainer's backend and modeling code in its constructor, where all workers start
        concurrently, rather than in `init_backend`, which runs after the ranks meet (see
        `rollflow.models.preload_model_code`)."""
        from rollflow.backends import backend_class
        from rollflow.models import preload_model_code

        backend_class(backend)
        preload_model_code(model_path, trust_remote_code)

    def require_resident(self, operation: str) -> None:
        if not self.resident:
            raise RuntimeError(f"{type(self).__name__}.{operation} called while offloaded; onload() first")

    def rendezvous_address(self) -> tuple[str, int]:
        """(host, free port) of this worker, where rank 0 of a data-parallel role hosts the process-group
        rendezvous."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def join_ranks(self, master_addr: str, master_port: int, world_size: int) -> None:
        """Describe this worker's process group torchrun-style (rank = worker index), for a backend that
        joins one (fsdp2)."""
        os.environ.update({"RANK": str(self.placement.index), "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size),
                           "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})

    def close(self) -> None:
        """Release what the backend holds (its process group, ...); called at shutdown before the kill."""
        if self.backend is not None:
            self.backend.close()


def build_backend(spec, placement: WorkerPlacement):
    """The training backend a trainer role's spec (`rollflow.workers.specs.TrainerSpec`) configures, for the
    worker placed at `placement`, its init seeded by the run's seed."""
    import torch

    from rollflow.backends import create_backend

    torch.manual_seed(spec.seed)
    return create_backend(spec.backend, spec.settings, **spec.backend_kwargs,
                          **simulation_kwargs(spec.sim, placement))


def nonfinite_in_role(error: NonFiniteError, role: str, lr_key: str) -> NonFiniteError:
    """A backend's NonFiniteError as the run reports it: which role, and which config key to change.

    Args:
        error: what the backend raised (`weights_updated` picks the advice).
        role: the role that trained ("actor_train", "critic").
        lr_key: the config key of that role's learning rate ("train.lr", "train.critic_lr").
    """
    advice = (f" ({lr_key} too high?)" if error.weights_updated
              else f". Lower {lr_key}, or set train.on_nonfinite: skip_step")
    return NonFiniteError(f"{role}: {error}{advice}", error.weights_updated)


def simulation_kwargs(sim, placement: WorkerPlacement) -> dict:
    """The `simulation` keyword of a `sim` engine or backend: `sim` (`cluster.sim`, from the role's spec) with
    this worker's simulated GPUs; {} when the cluster is not simulated (`sim` is None)."""
    return {} if sim is None else {"simulation": vars(sim.settings(max(1, len(placement.devices))))}


def move_report(started: float) -> dict[str, float]:
    rss, device = memory_usage()
    return {"seconds": time.perf_counter() - started, "rss_bytes": rss, "device_bytes": device}
