"""`actor_train` role: holds a training backend; computes logprobs, trains the objective the pipeline hands
it, exports weights."""

from __future__ import annotations

import time

import torch

from rollflow.cluster.placement import WorkerPlacement
from rollflow.cluster.weight_sync import BroadcastGroup, WeightManifest, publish_weights
from rollflow.data.sample import Batch
from rollflow.data.seeds import derive_seed
from rollflow.errors import NonFiniteError
from rollflow.workers.base import PlacedWorker, build_backend, nonfinite_in_role
from rollflow.workers.objectives import train_mini_batches
from rollflow.workers.old_logprobs import VersionSnapshots, exact_old_logprobs
from rollflow.workers.specs import TrainerSpec, torch_device


class ActorTrainWorker(PlacedWorker):
    """One data-parallel rank of the trainer. Started by `rollflow.workers.roles.start_roles`.

    Construction only pins the process; `init_backend` builds the model once every rank knows rank 0's
    rendezvous address (the fsdp2 backend joins a torch.distributed process group there).

    Args:
        placement: where this rank runs (its index is its rank).
        spec: actor_train's spec (`rollflow.workers.specs.trainer_spec`): its backend, and the objective `train`
            minimizes (`spec.loss`).
    """

    def __init__(self, placement: WorkerPlacement, spec: TrainerSpec):
        super().__init__(placement, spec.device)
        self.spec = spec
        self.rank = placement.index
        self.loss = spec.loss
        self.temperature = spec.temperature
        self.mini_batches = spec.mini_batches
        self.version = 0
        self.broadcast: BroadcastGroup | None = None
        self.outgoing: list[dict[str, torch.Tensor]] = []
        # `algorithm.old_logprobs: exact`: the weights of the versions whose tokens may still be trained
        self.snapshots = VersionSnapshots(spec.kept_versions) if spec.old_logprobs == "exact" else None
        self.preload(spec.backend, spec.settings.model_path, spec.settings.trust_remote_code)

    def init_backend(self, master_addr: str, master_port: int, world_size: int) -> None:
        """Build the training backend; every rank calls this at the same time (a collective for fsdp2)."""
        self.join_ranks(master_addr, master_port, world_size)
        self.backend = build_backend(self.spec, self.placement)
        self._snapshot()

    def _snapshot(self) -> None:
        """Keep the current version's weights (`algorithm.old_logprobs: exact`)."""
        if self.snapshots is not None:
            self.snapshots.take(self.version, self.backend.model)

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """[B, T] logprobs of the response tokens under the current weights."""
        self.require_resident("compute_logprobs")
        return self.backend.forward_logprobs(batch, self.temperature)

    def compute_old_logprobs(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """[B, T] logprobs of each response token under the weights of the version that sampled it, and the
        share of stale tokens (`rollflow.workers.old_logprobs.exact_old_logprobs`)."""
        self.require_resident("compute_old_logprobs")
        return exact_old_logprobs(self.backend, self.snapshots, batch, self.version, self.temperature)

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
        shuffle = torch.Generator().manual_seed(derive_seed(self.spec.seed, "actor_minibatches", self.version))
        try:
            metrics.update(train_mini_batches(self.backend, batch, self.loss, self.mini_batches, shuffle))
        except NonFiniteError as err:
            raise nonfinite_in_role(err, "actor_train", "train.lr") from None
        self.version += 1
        self._snapshot()
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
        self.broadcast = BroadcastGroup(host, port, 0, world_size, torch_device(self.spec.device))

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
        if self.snapshots is not None:  # a resumed run regenerates what was in flight: only this version's tokens
            self.snapshots.clear()
            self._snapshot()

    def compute_reference_logprobs(self, batch: Batch) -> torch.Tensor:
        """[B, T] reference logprobs: the base model with the LoRA adapters disabled (LoRA runs need no
        reference worker)."""
        self.require_resident("compute_reference_logprobs")
        return self.backend.forward_reference_logprobs(batch, self.temperature)

