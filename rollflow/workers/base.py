"""What every role worker shares: pinning to its placement, reporting where it runs, and the offload /
onload state of colocated roles (`rollflow.cluster.colocation`)."""

from __future__ import annotations

import time

from rollflow.cluster.placement import WorkerPlacement
from rollflow.cluster.runtime import memory_usage, pin_worker


class PlacedWorker:
    """Base of the role workers (one level of inheritance): pins the process to its devices and threads.

    Subclasses holding a backend get `offload()` / `onload()` for free (they call the backend's); they call
    `require_resident(op)` before using the model.

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

    def require_resident(self, operation: str) -> None:
        if not self.resident:
            raise RuntimeError(f"{type(self).__name__}.{operation} called while offloaded; onload() first")


def torch_device(config) -> str:
    """The torch device a worker's model lives on: "cuda" when the cluster's devices are GPUs."""
    return "cuda" if config.cluster.device == "gpu" else "cpu"


def move_report(started: float) -> dict[str, float]:
    rss, device = memory_usage()
    return {"seconds": time.perf_counter() - started, "rss_bytes": rss, "device_bytes": device}
