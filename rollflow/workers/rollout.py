"""`actor_infer` role: an async Ray actor around an inference engine."""

from __future__ import annotations

import torch

from rollflow.cluster.runtime import pin_threads
from rollflow.config import RunConfig
from rollflow.engines import create_engine
from rollflow.engines.base import Completion, GenerationRequest


class RolloutWorker:
    """Serves `generate` / `abort` concurrently (async actor) and loads synced weights."""

    def __init__(self, config: RunConfig, num_cpus: float, worker_index: int = 0):
        self.threads = pin_threads(num_cpus)
        role = config.roles.actor_infer
        self.worker_index = worker_index
        self.engine = create_engine(
            role.engine, model_path=config.model.path, dtype=config.model.dtype,
            max_batch_size=role.max_batch_size, seed=config.seed * 1000 + worker_index,
            trust_remote_code=config.model.trust_remote_code, **role.engine_kwargs,
        )

    async def generate(self, request: GenerationRequest) -> Completion:
        completion = await self.engine.generate(request)
        completion.metadata["worker"] = self.worker_index
        return completion

    async def abort(self, request_ids: list[str]) -> None:
        self.engine.abort(request_ids)

    async def update_weights(self, payload: tuple[dict[str, torch.Tensor], int, str, int]) -> int:
        """Load `(weights, version, checksum, nbytes)` from `ActorTrainWorker.weights_for_sync`."""
        weights, version, checksum, _ = payload
        self.engine.update_weights(weights, version, checksum)
        return version

    async def version(self) -> int:
        return self.engine.version

    async def sleep(self) -> None:
        self.engine.sleep()

    async def wake(self) -> None:
        self.engine.wake()
