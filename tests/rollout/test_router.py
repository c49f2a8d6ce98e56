"""The router of the rollout core, through its eval path (a fixed key list): prompt affinity, least-loaded
workers and the per-worker cap on in-flight requests, deterministic rounds, the watchdog, a dead worker."""

import asyncio
import sys
import threading
import time

import pytest
import ray
import ray.cloudpickle

from rollflow.data.prompts import EncodedPrompt
from rollflow.engines.base import Completion, CompletionOutput, SamplingParams
from rollflow.rollout.core import RolloutCore
from rollflow.rollout.prompt_groups import PromptGroups
from rollflow.rollout.settings import CoreSettings

# Actors of this module's classes get them by value: their processes then skip this module's imports (torch
# among them, ~3 s of CPU on 2 cores), which importing the class from here would cost each of them.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _evaluate(workers, reward, prompts, params, decode=str, seed_key=(), **settings):
    """Every prompt's group generated and scored by a core over `workers`: its samples, in prompt order."""
    core = RolloutCore(workers, None, None, CoreSettings(groups_per_step=1, **settings))
    try:
        return core.evaluate(prompts, PromptGroups(reward, decode, params, tag="eval"), seed_key)
    finally:
        core.close()


class _EngineWorker:
    """Answers each request at once and records how many it held at once and how many it served."""

    def __init__(self, index: int):
        self.index = index
        self.active = self.peak = self.served = 0

    async def generate(self, request):
        self.active += 1
        self.peak = max(self.peak, self.active)
        await self.hold()
        self.active -= 1
        self.served += 1
        outputs = [CompletionOutput([5, 6], [-0.1, -0.2], [0, 0], "stop") for _ in range(request.params.n)]
        return Completion(request.request_id, outputs, {"worker": self.index})

    async def hold(self):
        await asyncio.sleep(0)

    async def stats(self):
        return self.peak, self.served


class _HeldEngineWorker(_EngineWorker):
    """A worker slower than `other` whatever the machine's speed: it answers none of its requests until
    `other` has served every request of the `total` that did not come here."""

    def __init__(self, index: int, other, total: int):
        super().__init__(index)
        self.other, self.total = other, total

    async def hold(self):
        deadline = time.monotonic() + 60  # a hang guard: the other worker serves the rest in under a second
        while (await self.other.stats.remote())[1] + self.active + self.served < self.total:
            assert time.monotonic() < deadline, "the other worker never served the rest"
            await asyncio.sleep(0.01)


def _reward(completion, **row):
    return float(row["answer"]), {"answer": float(row["answer"])}


def test_groups_stay_on_one_worker_and_the_cap_holds(ray_session):
    fast = ray.remote(num_cpus=0)(_EngineWorker).remote(0)
    slow = ray.remote(num_cpus=0)(_HeldEngineWorker).remote(1, fast, 12)
    prompts = [EncodedPrompt({"answer": i % 2}, "p", [1, 2, 3]) for i in range(12)]
    samples = _evaluate([fast, slow], _reward, prompts, SamplingParams(n=3), decode=lambda ids: "x" * len(ids),
                        max_in_flight=2)
    assert len(samples) == 36
    by_group = {}
    for sample in samples:
        by_group.setdefault(sample.group_id, set()).add(sample.metadata["worker"])
    assert len(by_group) == 12 and all(len(workers) == 1 for workers in by_group.values())  # affinity
    (fast_peak, fast_served), (slow_peak, slow_served) = ray.get([fast.stats.remote(), slow.stats.remote()])
    assert fast_peak <= 2 and slow_peak == 2  # never more than the cap in flight (the slow worker fills it)
    # the first four requests leave together, two to each worker (least loaded, then the cap); every slot
    # freed after that is the fast worker's: freed capacity goes to whichever worker finishes first
    assert (fast_served, slow_served) == (10, 2)
    assert sorted(s.reward for s in samples) == [0.0] * 18 + [1.0] * 18
    for worker in (fast, slow):
        ray.kill(worker)


class _BatchRecorder:
    """Answers `generate_batch` with one token per sample (the request seed mod 97) and records the order;
    with `after` (another recorder), only once that one has answered."""

    def __init__(self, index: int, after=None):
        self.index, self.after, self.seen = index, after, []

    async def generate_batch(self, requests):
        deadline = time.monotonic() + 60  # a hang guard: the other recorder answers at once
        while self.after is not None and not await self.after.received.remote():
            assert time.monotonic() < deadline, "the other recorder never answered"
            await asyncio.sleep(0.01)
        self.seen.append([(r.prompt_ids[0], r.params.seed) for r in requests])
        return [Completion(r.request_id, [CompletionOutput([r.params.seed % 97 + slot], [-0.1], [0], "stop")
                                          for slot in range(r.params.n)], {"worker": self.index})
                for r in requests]

    async def received(self):
        return self.seen


def test_deterministic_mode_fixes_shares_order_and_seeds(ray_session):
    from rollflow.data.seeds import derive_seed

    second = ray.remote(num_cpus=0)(_BatchRecorder).remote(1)
    first = ray.remote(num_cpus=0)(_BatchRecorder).remote(0, after=second)  # answers after worker 1
    workers = [first, second]
    prompts = [EncodedPrompt({"answer": 0}, "p", [k]) for k in range(5)]
    samples = _evaluate(workers, _reward, prompts, SamplingParams(n=2), seed_key=("train", 3), max_in_flight=1,
                        seed=7, deterministic=True)
    seeds = [derive_seed(7, "train", 3, i) for i in range(5)]
    # worker w gets prompts w, w + 2, ... in one batch, in order (the cap does not split it), each seeded
    assert ray.get(workers[0].received.remote()) == [[(0, seeds[0]), (2, seeds[2]), (4, seeds[4])]]
    assert ray.get(workers[1].received.remote()) == [[(1, seeds[1]), (3, seeds[3])]]
    # samples come back in prompt order, each group in sample order, although worker 1 answered first
    assert [(s.prompt_ids[0], s.response_ids[0]) for s in samples] == \
        [(k, seeds[k] % 97 + slot) for k in range(5) for slot in range(2)]
    for worker in workers:
        ray.kill(worker)


class _Silent:
    """Never answers; counts the requests it got."""

    def __init__(self):
        self.requests = 0

    async def generate(self, request):
        self.requests += 1
        await asyncio.sleep(3600)

    async def received(self):
        return self.requests


def test_a_rollout_without_progress_stops_naming_the_workers(ray_session):
    from rollflow.errors import StalledError

    worker = ray.remote(num_cpus=0)(_Silent).remote()
    started = time.monotonic()
    with pytest.raises(StalledError, match=r"no progress for 1 s in phase rollout: waiting on actor_infer "
                                           r"worker 0 \(2 requests generating\)"):
        _evaluate([worker], _reward, [EncodedPrompt({"answer": 0}, "p", [1])] * 2, SamplingParams(n=1),
                  watchdog_s=1.0)
    assert time.monotonic() - started < 30  # a hang guard (~2 s): the default watchdog waits 900 s
    ray.kill(worker)


def test_a_dead_engine_worker_is_one_line(ray_session):
    from rollflow.errors import WorkerDiedError

    worker = ray.remote(num_cpus=0)(_Silent).remote()

    def kill_once_generating():  # killed while its request runs, not before it was sent
        deadline = time.monotonic() + 60
        while not ray.get(worker.received.remote()) and time.monotonic() < deadline:
            time.sleep(0.01)
        ray.kill(worker)

    threading.Thread(target=kill_once_generating, daemon=True).start()
    with pytest.raises(WorkerDiedError, match=r"^actor_infer worker 0 died during generate"):
        _evaluate([worker], _reward, [EncodedPrompt({"answer": 0}, "p", [1])], SamplingParams(n=1))


class _PoolFinishesBetweenChecks:
    """A group reward whose plain reward finishes on a pool thread right after the group is submitted (the
    reward pool's threads run concurrently with the rollout's loop)."""

    class _Pending:
        futures: list = []

        def __init__(self):
            import concurrent.futures
            import threading

            self.future = concurrent.futures.Future()
            threading.Timer(0.05, self.future.set_result, args=(1.0,)).start()

        def plain_futures(self):
            return [self.future] if not self.future.done() else []

        def finish(self, results):
            return [(1.0, {"answer": 1.0})]

    def submit_group(self, texts, rows):
        return self._Pending()


class _Instant:
    async def generate(self, request):
        return Completion(request.request_id, [CompletionOutput([5], [-0.1], [0], "stop")], {})


def test_rewards_finishing_between_checks_never_put_the_loop_to_sleep(ray_session):
    """Regression: when the last group's pool rewards completed between the loop's two looks at them, the
    loop slept for the whole watchdog period (the quickstart's eval stalled 15 minutes at step 20)."""
    worker = ray.remote(num_cpus=0)(_Instant).remote()
    ray.get(worker.__ray_ready__.remote())
    started = time.monotonic()
    samples = _evaluate([worker], _PoolFinishesBetweenChecks(), [EncodedPrompt({"answer": 1}, "p", [1])],
                        SamplingParams(n=1), watchdog_s=120.0)
    assert time.monotonic() - started < 60  # ~0.5 s; the regression slept the watchdog's 120 s
    assert [s.reward for s in samples] == [1.0]
    ray.kill(worker)
