"""What every role worker shares: pinning to its placement, reporting where it runs, the offload / onload
state of colocated roles (`rollflow.cluster.colocation`), the rendezvous of data-parallel ranks, and
`close()` at shutdown."""

from __future__ import annotations

import os
import time

from rollflow.backends.base import TrainerSettings
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


def trainer_settings(config, **overrides) -> TrainerSettings:
    """The backend settings every trainer role shares, from the run config; `overrides` are the role's own
    (the critic's LR, the reference's frozen weights and model path, ...)."""
    train = config.train
    rollout = getattr(config, "rollout", None)  # the generation limit, for seq_mean_token_sum_norm
    settings = dict(
        model_path=config.model.path, dtype=config.model.dtype, trust_remote_code=config.model.trust_remote_code,
        lr=train.lr, betas=tuple(train.betas), weight_decay=train.weight_decay, warmup_steps=train.warmup_steps,
        lr_schedule=train.lr_schedule, total_steps=train.steps * train.optimizer_steps_per_step,
        max_grad_norm=train.max_grad_norm, micro_batch_size=train.train_micro_batch_size,
        max_response_length=rollout.max_new_tokens if rollout is not None else None,
        device=torch_device(config), on_nonfinite=train.on_nonfinite,
        freeze_vision_tower=getattr(config.model, "freeze_vision_tower", False),
    )
    return TrainerSettings(**{**settings, **overrides})


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


def sampling_temperature(config) -> float:
    """The temperature the engines sampled at, which logprobs are taken at (1 for a pipeline without
    a rollout section, which samples nothing)."""
    rollout = getattr(config, "rollout", None)
    return rollout.temperature if rollout is not None else 1.0


def simulation_kwargs(config, placement: WorkerPlacement, role: str, component: str) -> dict:
    """The `simulation` keyword of a `sim` engine or backend on a simulated cluster (`cluster.device: sim`): the
    run's `cluster.sim`, with this worker's simulated GPUs; {} on a real cluster.

    Args:
        config: the run config.
        placement: the worker's (its devices are its simulated GPUs).
        role: the role, for the error.
        component: the engine or backend name the role configures.

    Raises:
        ConfigError: a role that would run real model math on a simulated cluster.
    """
    if config.cluster.device != "sim":
        return {}
    if component != "sim":
        from rollflow.errors import ConfigError

        kind = "engine" if role == "actor_infer" else "backend"
        raise ConfigError(f"cluster.device sim: roles.{role}.{kind} is {component}; set it to sim (a simulated "
                          "cluster runs no model)")
    return {"simulation": vars(config.cluster.sim.settings(max(1, len(placement.devices))))}


def torch_device(config) -> str:
    """The torch device a worker's model lives on: "cuda" when the cluster's devices are GPUs."""
    return "cuda" if config.cluster.device == "gpu" else "cpu"


def move_report(started: float) -> dict[str, float]:
    rss, device = memory_usage()
    return {"seconds": time.perf_counter() - started, "rss_bytes": rss, "device_bytes": device}
