"""`actor_infer` role: an async Ray actor around an inference engine.

It receives weight versions from the trainer and verifies their checksum bucket by bucket as the buckets
arrive (`rollflow.cluster.weight_sync.WeightReceiver`); the engine only loads verified weights.
"""

from __future__ import annotations

import asyncio
import time

from rollflow.cluster.placement import WorkerPlacement
from rollflow.cluster.weight_sync import BroadcastGroup, WeightManifest, WeightReceiver, fetched_bucket
from rollflow.data.seeds import derive_seed
from rollflow.engines import create_engine
from rollflow.engines.base import Completion, GenerationRequest
from rollflow.workers.base import PlacedWorker, move_report, simulation_kwargs
from rollflow.workers.specs import EngineSpec, torch_device


class RolloutWorker(PlacedWorker):
    """Serves `generate` / `abort` concurrently (async actor) and loads synced weights.

    Args:
        placement: where this worker runs.
        spec: the engine's spec (`rollflow.workers.specs.engine_spec`).
    """

    def __init__(self, placement: WorkerPlacement, spec: EngineSpec):
        super().__init__(placement, spec.device)
        self.worker_index = placement.index
        self.device = spec.device
        self.broadcast: BroadcastGroup | None = None
        self.engine = build_engine(spec, placement)

    async def generate(self, request: GenerationRequest) -> Completion:
        return await generate_one(self.engine, request, self.worker_index)

    async def generate_batch(self, requests: list[GenerationRequest]) -> list[Completion]:
        """Every request of `requests`, queued together in this order (so they share the engine's batches
        the same way on every run: the rollout core's deterministic mode)."""
        return await generate_together(self.engine, requests, self.worker_index)

    async def abort(self, request_ids: list[str]) -> None:
        self.engine.abort(request_ids)

    async def update_weights(self, manifest: WeightManifest) -> dict[str, float]:
        """Fetch the buckets of `manifest` (from `ActorTrainWorker.weights_for_sync`), verifying each as it
        arrives, then load them into the engine. Returns the new version and the fetch / load seconds.

        Raises:
            WeightSyncError: a bucket that does not match the trainer's checksum, or a missing tensor.
        """
        started = time.perf_counter()
        receiver = WeightReceiver(manifest)
        if manifest.transport == "broadcast":  # the trainer sends while we receive
            for bucket in self.broadcast.receive(manifest.layouts):
                receiver.add(bucket)
        else:
            for ref, layout in zip(manifest.buckets, manifest.layouts):  # one bucket in flight, checked as it lands
                receiver.add(fetched_bucket(await ref, layout))
        weights = receiver.finish()
        fetched = time.perf_counter()
        self.engine.update_weights(weights, manifest.version)
        return {"version": manifest.version, "fetch_seconds": fetched - started,
                "load_seconds": time.perf_counter() - fetched}

    async def version(self) -> int:
        return self.engine.version

    async def open_broadcast(self, host: str, port: int, rank: int, world_size: int) -> None:
        """Join the weight-broadcast group (rank 0 is the trainer), see `rollflow.cluster.weight_sync`."""
        self.broadcast = BroadcastGroup(host, port, rank, world_size, torch_device(self.device))

    async def offload(self) -> dict[str, float]:
        """Put the engine to sleep (frees its weights / KV cache on GPU) while a colocated role runs."""
        started = time.perf_counter()
        self.engine.sleep()
        self.resident = False
        return move_report(started)

    async def onload(self) -> dict[str, float]:
        started = time.perf_counter()
        self.engine.wake()
        self.resident = True
        return move_report(started)

    async def close(self) -> None:
        """Shut the engine down (its threads, its GPU memory) before the actor is killed."""
        self.engine.close()


def build_engine(spec: EngineSpec, placement: WorkerPlacement):
    """The engine `spec` configures, for the engine worker placed at `placement` (its index seeds its sampling;
    on a simulated cluster its devices are its simulated GPUs)."""
    # the hf engine runs wherever torch does; vLLM / SGLang pick their GPUs themselves
    on_device = spec.engine == "hf" and "device" not in spec.engine_kwargs
    device = {"device": torch_device(spec.device)} if on_device else {}
    return create_engine(
        spec.engine, model_path=spec.model_path, dtype=spec.dtype, max_batch_size=spec.max_batch_size,
        # 32 bits: vLLM and SGLang also seed numpy's global generator, which takes only [0, 2**32)
        seed=derive_seed(spec.seed, "engine", placement.index, bits=32),
        trust_remote_code=spec.trust_remote_code, **device, **spec.engine_kwargs,
        **simulation_kwargs(spec.sim, placement),
    )


async def generate_one(engine, request: GenerationRequest, worker_index: int) -> Completion:
    """`engine.generate(request)`, its completion tagged with the engine worker that sampled it."""
    completion = await engine.generate(request)
    completion.metadata["worker"] = worker_index
    return completion


async def generate_together(engine, requests: list[GenerationRequest], worker_index: int) -> list[Completion]:
    """Every request queued on `engine` together, in this order; completions in the same order."""
    return list(await asyncio.gather(*[generate_one(engine, request, worker_index) for request in requests]))
