"""A hybrid worker: `actor_train` and its `actor_infer` engine in one process (`roles.actor_infer.hybrid`).

verl calls this a hybrid engine. On a small CPU machine a separate engine process costs a Python with torch
and transformers imported (~0.5 GB), a few seconds of start-up, and a weight transfer through Ray's object
store after every step; colocated roles never run at the same time anyway. Here one Ray actor holds the
trainer (an `ActorTrainWorker`, composed, not inherited) and an `hf` engine with its own copy of the model,
and serves both roles' methods: the driver's `actor_infer` group is a second name for the same actor
(`WorkerGroups.host`). Generation and training take turns on the actor's event loop; a weight sync is an
in-process copy (`sync_engine`), checksummed like any transport (`rollflow.cluster.weight_sync`).

The engine decodes with the trainer's threads (`roles.actor_train.num_cpus`). Its method calls are spans in
the lane `actor_infer <index>` of the timeline, the trainer's in `actor_train <index>`.
"""

from __future__ import annotations

import torch

from rollflow.cluster.placement import WorkerPlacement
from rollflow.cluster.weight_sync import WeightReceiver, publish_weights
from rollflow.data.sample import Batch
from rollflow.engines.base import Completion, GenerationRequest
from rollflow.workers.actor_train import ActorTrainWorker
from rollflow.workers.base import PlacedWorker
from rollflow.workers.rollout import build_engine, generate_one, generate_together
from rollflow.workers.specs import HybridSpec

# methods of the engine role: spans in the actor_infer lane
ENGINE_METHODS = frozenset({"generate", "generate_batch", "abort", "sync_engine"})


class HybridWorker(PlacedWorker):
    """`actor_train` rank 0 with the run's one `hf` engine. Started by `rollflow.workers.roles.start_roles`
    in place of both roles' workers when `roles.actor_infer.hybrid` is set.

    Args:
        placement: actor_train's worker 0 placement (its threads serve both roles).
        spec: actor_train's spec and the engine's (`rollflow.workers.specs.HybridSpec`).
    """

    def __init__(self, placement: WorkerPlacement, spec: HybridSpec):
        super().__init__(placement, spec.trainer.device)
        self.trainer = ActorTrainWorker(placement, spec.trainer)
        self.engine = build_engine(spec.engine, placement)

    def _span_lane(self, method: str) -> str | None:
        """The timeline lane of `method`'s spans (`rollflow.spans.traced`): the engine's own lane."""
        return f"actor_infer {self.placement.index}" if method in ENGINE_METHODS else None

    # ---- actor_infer -----------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> Completion:
        return await generate_one(self.engine, request, self.placement.index)

    async def generate_batch(self, requests: list[GenerationRequest]) -> list[Completion]:
        """Every request queued together, in this order (see `RolloutWorker.generate_batch`)."""
        return await generate_together(self.engine, requests, self.placement.index)

    async def abort(self, request_ids: list[str]) -> None:
        self.engine.abort(request_ids)

    async def version(self) -> int:
        """The policy version the engine holds."""
        return self.engine.version

    def sync_engine(self, bucket_bytes: int, checksum: str = "bucket", corrupt: bool = False) -> dict[str, int]:
        """Load the trainer's current weights into the engine: split and checksummed as for any transport,
        verified bucket by bucket, then copied into the engine's model (`in_process` transport).

        Args:
            bucket_bytes, checksum, corrupt: as `ActorTrainWorker.weights_for_sync`.

        Returns:
            The new `version`, `nbytes` and `num_buckets`.

        Raises:
            WeightSyncError: a bucket that does not match its checksum (`corrupt`), or a missing tensor.
        """
        self.trainer.require_resident("sync_engine")
        manifest, buckets = publish_weights(self.trainer.backend.named_weights(), self.trainer.version,
                                            bucket_bytes, checksum=checksum, corrupt=corrupt,
                                            transport="in_process")
        receiver = WeightReceiver(manifest)
        for bucket in buckets:
            receiver.add(bucket)
        self.engine.update_weights(receiver.finish(), manifest.version)
        return {"version": manifest.version, "nbytes": manifest.nbytes, "num_buckets": manifest.num_buckets}

    # ---- actor_train -----------------------------------------------------------------------------------
    def init_backend(self, master_addr: str, master_port: int, world_size: int) -> None:
        self.trainer.init_backend(master_addr, master_port, world_size)

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        return self.trainer.compute_logprobs(batch)

    def compute_old_logprobs(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        return self.trainer.compute_old_logprobs(batch)

    def compute_reference_logprobs(self, batch: Batch) -> torch.Tensor:
        return self.trainer.compute_reference_logprobs(batch)

    def train(self, batch: Batch) -> dict[str, float]:
        return self.trainer.train(batch)

    def save(self, path: str) -> None:
        self.trainer.save(path)

    def load(self, path: str, version: int) -> None:
        self.trainer.load(path, version)

    def offload(self) -> dict[str, float]:
        """The trainer's offload (the engine stays: a CPU run moves nothing)."""
        return self.trainer.offload()

    def onload(self) -> dict[str, float]:
        return self.trainer.onload()

    def close(self) -> None:
        """Close the engine, then the trainer's backend."""
        self.engine.close()
        self.trainer.close()
