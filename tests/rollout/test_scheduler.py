"""Routing: prompt affinity, least-loaded workers and the per-worker cap on in-flight requests."""

import asyncio

import ray

from rollflow.data.prompts import EncodedPrompt
from rollflow.engines.base import Completion, CompletionOutput, SamplingParams
from rollflow.rollout.scheduler import RolloutScheduler


class _SlowEngineWorker:
    """Answers each request after `delay` seconds and records how many it held at once."""

    def __init__(self, index: int, delay: float):
        self.index, self.delay = index, delay
        self.active = self.peak = self.served = 0

    async def generate(self, request):
        self.active += 1
        self.peak = max(self.peak, self.active)
        await asyncio.sleep(self.delay)
        self.active -= 1
        self.served += 1
        outputs = [CompletionOutput([5, 6], [-0.1, -0.2], [0, 0], "stop") for _ in range(request.params.n)]
        return Completion(request.request_id, outputs, {"worker": self.index})

    async def stats(self):
        return self.peak, self.served


def _reward(completion, **row):
    return float(row["answer"]), {"answer": float(row["answer"])}


def test_groups_stay_on_one_worker_and_the_cap_holds(ray_session):
    fast, slow = (ray.remote(num_cpus=0)(_SlowEngineWorker).remote(i, d) for i, d in enumerate((0.02, 0.3)))
    scheduler = RolloutScheduler([fast, slow], _reward, decode=lambda ids: "x" * len(ids), max_in_flight=2)
    prompts = [EncodedPrompt({"answer": i % 2}, "p", [1, 2, 3]) for i in range(12)]
    result = scheduler.generate(prompts, SamplingParams(n=3))
    assert len(result.samples) == 36
    by_group = {}
    for sample in result.samples:
        by_group.setdefault(sample.group_id, set()).add(sample.metadata["worker"])
    assert len(by_group) == 12 and all(len(workers) == 1 for workers in by_group.values())  # affinity
    (fast_peak, fast_served), (slow_peak, slow_served) = ray.get([fast.stats.remote(), slow.stats.remote()])
    assert fast_peak <= 2 and slow_peak <= 2  # never more than the cap in flight
    assert fast_served > slow_served  # freed capacity goes to whichever worker finishes first
    assert fast_served + slow_served == 12
    assert sorted(s.reward for s in result.samples) == [0.0] * 18 + [1.0] * 18
    for worker in (fast, slow):
        ray.kill(worker)
