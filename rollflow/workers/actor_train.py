"""`actor_train` role: holds a training backend; computes logprobs, trains the objective the pipeline hands
it, exports weights."""

from __future__ import annotations

import time

import torch

from rollflow.backends import create_backend
from rollflow.cluster.placement import WorkerPlacement
from rollflow.cluster.weight_sync import BroadcastGroup, WeightManifest, publish_weights
from rollflow.config import RunConfigBase
from rollflow.data.sample import Batch
from rollflow.data.seeds import derive_seed
from rollflow.errors import NonFiniteError
from rollflow.workers.base import (
    PlacedWorker,
    nonfinite_in_role,
    sampling_temperature,
    simulation_kwargs,
    trainer_settings,
)
from rollflow.workers.objectives import OBJECTIVES, train_mini_batches


class ActorTrainWorker(PlacedWorker):
    """One data-parallel rank of the trainer. Started by `rollflow.workers.roles.start_roles`.

    Construction only pins the process and builds the objective; `init_backend` builds the model once every
    rank knows rank 0's rendezvous address (the fsdp2 backend joins a torch.distributed process group there).

    Args:
        placement: where this rank runs (its index is its rank).
        config: the run config.
        objective: an `OBJECTIVES` name, the loss `train` minimizes ("policy_gradient" for RLVR).
    """

    def __init__(self, placement: WorkerPlacement, config: RunConfigBase, objective: str = "policy_gradient"):
        super().__init__(placement, config.cluster.device)
        self.config = config
        self.rank = placement.index
        self.loss = OBJECTIVES.get(objective)(config)
        self.temperature = sampling_temperature(config)
        self.mini_batches = config.train.optimizer_steps_per_step
        self.version = 0
        self.broadcast: BroadcastGroup | None = None
        self.outgoing: list[dict[str, torch.Tensor]] = []
        self.preload(config.roles.actor_train.backend, config.model.path, config.model.trust_remote_code)

    def init_backend(self, master_addr: str, master_port: int, world_size: int) -> None:
        """Build the training backend; every rank calls this at the same time (a collective for fsdp2)."""
        self.join_ranks(master_addr, master_port, world_size)
        config = self.config
        torch.manual_seed(config.seed)
        role, train = config.roles.actor_train, config.train
        lora = role.lora.model_dump() if role.lora is not None else None
        settings = trainer_settings(config, lr=train.lr, lora=lora, total_steps=config.actor_optimizer_steps)
        self.backend = create_backend(role.backend, settings, **role.backend_kwargs,
                                      **simulation_kwargs(config, self.placement, "actor_train", role.backend))

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
        prepare = getattr(self.loss, "prepare", None)  # an objective that needs the whole batch first
        if prepare is not None:
            metrics.update(prepare(batch, self.backend))
        if "old_logprobs" in batch.extras:
            gap = (batch.extras["old_logprobs"] - batch.rollout_logprobs).abs()  # [B, T]
            gap = gap * batch.response_mask
            metrics["check/train_infer_logprob_max_gap"] = float(gap.max())
        # every rank must draw the same mini-batch split: a generator seeded by (seed, version), not the
        # global RNG (which model code may consume differently per rank)
        shuffle = torch.Generator().manual_seed(derive_seed(self.config.seed, "actor_minibatches", self.version))
        try:
            metrics.update(train_mini_batches(self.backend, batch, self.loss, self.mini_batches, shuffle))
        except NonFiniteError as err:
            raise nonfinite_in_role(err, "actor_train", "train.lr") from None
        self.version += 1
        metrics["time/train"] = time.perf_counter() - started
        return metrics

    def weights_for_sync(self, bucket_bytes: int, checksum: str = "bucket",
                         corrupt: bool = False) -> WeightManifest | None:
        """Publish the current weights for the inference engines (a collective: every rank calls it).

        Rank 0 splits them into buckets of about `bucket_bytes`, takes their checksum (`checksum`: "bucket",
        "full" or "off", `checks.weight_checksum`) and returns the manifest; with the object-store transport
        the buckets are already in the object store, with `broadcast` they wait for `send_weights`. Other
        ranks return None. `corrupt` flips one byte after the checksum is taken (the
        `checks.fault_injection_flip_sync_byte_at` test hook).
        """
        self.require_resident("weights_for_sync")
        weights = self.backend.named_weights()  # full weights on rank 0, {} elsewhere
        if self.rank != 0:
            return None
        transport = "broadcast" if self.broadcast is not None else "object_store"
        manifest, self.outgoing = publish_weights(weights, self.version, bucket_bytes, checksum=checksum,
                                                  corrupt=corrupt, transport=transport)
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

