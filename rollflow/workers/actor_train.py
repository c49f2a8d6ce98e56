"""`actor_train` role: holds a training backend; computes logprobs, trains, exports weights."""

from __future__ import annotations

import os
import time

import torch

from rollflow.backends import create_backend
from rollflow.cluster.placement import WorkerPlacement
from rollflow.cluster.runtime import free_port
from rollflow.cluster.weight_sync import BroadcastGroup, WeightManifest, publish_weights
from rollflow.config import RunConfig
from rollflow.data.sample import Batch
from rollflow.workers.actor_loss import ActorLoss
from rollflow.workers.base import PlacedWorker, torch_device


class ActorTrainWorker(PlacedWorker):
    """One data-parallel rank of the trainer. Created as a Ray actor by `rollflow.cluster.groups`.

    Construction only pins the process; `init_backend` builds the model once every rank knows rank 0's
    rendezvous address (the fsdp2 backend joins a torch.distributed process group there).
    """

    def __init__(self, config: RunConfig, placement: WorkerPlacement, world_size: int = 1):
        super().__init__(placement, config.cluster.device)
        self.config = config
        self.rank, self.world_size = placement.index, world_size
        self.backend = None
        self.loss = ActorLoss(config.algorithm, config.rollout.temperature)
        self.temperature = config.rollout.temperature
        self.mini_batches = config.train.optimizer_steps_per_step
        self.version = 0
        self.broadcast: BroadcastGroup | None = None
        self.outgoing: list[dict[str, torch.Tensor]] = []

    def rendezvous_address(self) -> tuple[str, int]:
        """(host, free port) of this worker, where rank 0 hosts the process-group rendezvous."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def init_backend(self, master_addr: str, master_port: int) -> None:
        """Build the training backend; every rank calls this at the same time (a collective for fsdp2)."""
        os.environ.update({"RANK": str(self.rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(self.world_size),
                           "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
        config = self.config
        torch.manual_seed(config.seed)
        role, train = config.roles.actor_train, config.train
        lora = {"lora": role.lora.model_dump()} if role.lora is not None else {}
        self.backend = create_backend(
            role.backend, model_path=config.model.path, dtype=config.model.dtype, lr=train.lr,
            betas=train.betas, weight_decay=train.weight_decay, warmup_steps=train.warmup_steps,
            max_grad_norm=train.max_grad_norm, micro_batch_size=train.train_micro_batch_size,
            lr_schedule=train.lr_schedule, total_steps=train.steps * train.optimizer_steps_per_step,
            trust_remote_code=config.model.trust_remote_code,
            max_response_length=config.rollout.max_new_tokens, device=torch_device(config), **lora,
            **role.backend_kwargs,
        )

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """[B, T] logprobs of the response tokens under the current weights."""
        self.require_resident("compute_logprobs")
        return self.backend.forward_logprobs(batch, self.temperature)

    def train(self, batch: Batch) -> dict[str, float]:
        """One RL step: `optimizer_steps_per_step` optimizer steps over shuffled mini-batches.

        Uses `batch.extras["old_logprobs"]` when the driver already computed them (KL in the reward, opd);
        otherwise computes them first when later mini-batches need them.
        """
        self.require_resident("train")
        started = time.perf_counter()
        metrics: dict[str, float] = {}
        if self.mini_batches > 1 and "old_logprobs" not in batch.extras:
            # later mini-batches see moved weights: ratios need the old policy
            batch.extras["old_logprobs"] = self.backend.forward_logprobs(batch, self.temperature)  # [B, T]
        if "old_logprobs" in batch.extras:
            gap = (batch.extras["old_logprobs"] - batch.rollout_logprobs).abs()  # [B, T]
            gap = gap * batch.response_mask
            metrics["check/train_infer_logprob_max_gap"] = float(gap.max())
        # every rank must draw the same mini-batch split: a generator seeded by (seed, version), not the
        # global RNG (which model code may consume differently per rank)
        shuffle = torch.Generator().manual_seed(self.config.seed * 100_003 + self.version)
        metrics.update(train_mini_batches(self.backend, batch, self.loss, self.mini_batches, shuffle))
        self.version += 1
        metrics["time/train"] = time.perf_counter() - started
        return metrics

    def weights_for_sync(self, bucket_bytes: int, corrupt: bool = False) -> WeightManifest | None:
        """Publish the current weights for the inference engines (a collective: every rank calls it).

        Rank 0 checksums them, splits them into buckets of about `bucket_bytes` and returns the manifest; with
        the object-store transport the buckets are already in the object store, with `broadcast` they wait
        for `send_weights`. Other ranks return None. `corrupt` flips one byte after the checksum is taken
        (the `checks.fault_injection_flip_sync_byte_at` test hook).
        """
        self.require_resident("weights_for_sync")
        weights = self.backend.named_weights()  # full weights on rank 0, {} elsewhere
        if self.rank != 0:
            return None
        transport = "broadcast" if self.broadcast is not None else "object_store"
        manifest, self.outgoing = publish_weights(weights, self.version, bucket_bytes, corrupt, transport)
        return manifest

    def open_broadcast(self, host: str, port: int, world_size: int) -> None:
        """Join the weight-broadcast group as its rank 0 (see `rollflow.cluster.weight_sync`)."""
        device = "cuda" if self.config.cluster.device == "gpu" else "cpu"
        self.broadcast = BroadcastGroup(host, port, 0, world_size, device)

    def send_weights(self) -> None:
        """Broadcast the buckets `weights_for_sync` prepared (no-op for the object-store transport)."""
        if self.outgoing:
            self.broadcast.send(self.outgoing)
        self.outgoing = []

    def save(self, path: str) -> None:
        self.backend.save(path)

    def load(self, path: str, version: int) -> None:
        self.backend.load(path)
        self.version = version

    def compute_reference_logprobs(self, batch: Batch) -> torch.Tensor:
        """[B, T] reference logprobs: the base model with the LoRA adapters disabled (LoRA runs need no
        reference worker)."""
        self.require_resident("compute_reference_logprobs")
        return self.backend.forward_reference_logprobs(batch, self.temperature)


def train_mini_batches(backend, batch: Batch, loss_fn, mini_batches: int,
                       generator: torch.Generator | None = None) -> dict[str, float]:
    """Shuffle `batch`, split it into `mini_batches` near-equal parts, take one optimizer step on each.

    Returns the metrics averaged over the optimizer steps. Parts are empty only when the batch has fewer
    rows than `mini_batches` (after the difficulty mask dropped groups); those are skipped.
    """
    order = torch.randperm(batch.size, generator=generator)
    parts = [part for part in order.tensor_split(mini_batches) if part.numel()]
    metrics: dict[str, float] = {}
    for part in parts:
        for key, value in backend.train_step(batch.select(part), loss_fn).items():
            metrics[key] = metrics.get(key, 0.0) + value / len(parts)
    return metrics
