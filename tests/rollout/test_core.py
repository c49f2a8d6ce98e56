"""The rollout core with the prompt-group program: group lifecycle, refill within its bound,
over-provisioning and long rounds, the staleness bound under random timings, resuming with groups in flight,
partial rollout. (The env-group program gets the same policy: tests/rollout/test_env_groups.py.)"""

import asyncio
import random
import sys
import threading
import time

import pytest
import ray
import ray.cloudpickle

from rollflow.data.prompts import EncodedPrompt, PromptSampler
from rollflow.engines.base import Completion, CompletionOutput, SamplingParams
from rollflow.rollout.core import RolloutCore
from rollflow.rollout.prompt_groups import PromptGroups
from rollflow.rollout.settings import CoreSettings

# Actors of this module's classes get them by value: their processes then skip this module's imports (torch
# among them, ~3 s of CPU on 2 cores), which importing the class from here would cost each of them.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class _FakeEngine:
    """An engine worker: prompt [k] answers `k % 7` after `delays[k]` seconds (default 0), one token per
    `tokens[k]`; every token carries the engine's current version, read as each token is "sampled". The first
    request of a key in `held` answers only once it is aborted (a long tail that is cut whatever the machine's
    speed); a key in `gated` samples its first token, then waits for `open_gate(key)` (a slow response that
    started by the weights of its time)."""

    def __init__(self, delays: dict[int, float] | None = None, tokens: dict[int, int] | None = None,
                 jitter: float = 0.0, seed: int = 0, held: frozenset[int] = frozenset(),
                 gated: frozenset[int] = frozenset()):
        self.delays, self.tokens, self.jitter, self.held = delays or {}, tokens or {}, jitter, held
        self.gated, self.opened = gated, set()
        self.random = random.Random(seed)
        self.version, self.aborted, self.requests, self.served = 0, set(), [], 0
        self.active: set[str] = set()  # requests being answered
        self.midway: set[str] = set()  # requests whose current sample has tokens and more to come
        self.paused: set[str] = set()  # requests that sample nothing more until they are aborted

    async def _one(self, request):
        key, request_id = request.prompt_ids[0], request.request_id
        first = key not in self.requests
        self.requests.append(key)
        self.active.add(request_id)
        if first and key in self.held:
            self.paused.add(request_id)
        length = min(self.tokens.get(key, 1), request.params.max_new_tokens)
        delay = self.delays.get(key, 0.0) + self.random.uniform(0, self.jitter)
        outputs = []
        for _ in range(request.params.n):
            versions = []
            for _ in range(length):
                await asyncio.sleep(delay / length)
                await _until(lambda: request_id not in self.paused or request_id in self.aborted)
                if request_id in self.aborted:
                    break
                versions.append(self.version)
                if key in self.gated:
                    await _until(lambda: key in self.opened)
                if len(versions) < length:
                    self.midway.add(request_id)
            self.midway.discard(request_id)
            reason = "abort" if request_id in self.aborted else "stop"
            outputs.append(CompletionOutput([key % 7] * len(versions), [-0.1] * len(versions), versions, reason))
        self.active.discard(request_id)
        self.paused.discard(request_id)
        self.served += 1
        return Completion(request_id, outputs, {})

    async def generate(self, request):
        return await self._one(request)

    async def generate_batch(self, requests):
        return list(await asyncio.gather(*[self._one(r) for r in requests]))

    async def abort(self, request_ids):
        self.aborted.update(request_ids)

    async def set_version(self, version, mid_response: bool = False, pause: bool = False):
        """The weight sync. `mid_response`: once a sample is part-way (at once when nothing is generating), so
        its next token carries the new version; `pause`: that request then samples nothing more until it is
        aborted (as `resubmit` does after an update)."""
        if mid_response:
            await _until(lambda: self.midway or not self.active)
            if pause:
                self.paused.update(self.midway)
        self.version = version

    async def open_gate(self, key):
        self.opened.add(key)

    async def seen(self):
        return list(self.requests)

    async def served_requests(self):
        return self.served


async def _until(condition, timeout_s: float = 60.0) -> None:
    """Poll `condition` on the actor's loop until it holds (a hang guard: the waits take well under 1 s)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "a fake engine waited a minute"
        await asyncio.sleep(0.005)


def _wait_until(condition, timeout_s: float = 60.0) -> None:
    """Poll `condition` from the driver until it holds (a hang guard: the waits take well under 1 s)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s:g} s"
        time.sleep(0.01)


def _reward(completion, **row):
    """1 for prompts whose key is even, else 0; prompts with key % 10 == 9 raise."""
    if row["key"] % 10 == 9:
        raise ValueError("broken row")
    return float(row["key"] % 2 == 0), {"even": float(row["key"] % 2 == 0)}


def _prompts(count: int) -> list[EncodedPrompt]:
    return [EncodedPrompt({"key": k}, f"p{k}", [k]) for k in range(count)]


def _stream(workers, settings, prompts, deterministic=False, n=2, reward=_reward, max_new_tokens=16,
            difficulty_mask=None):
    settings = CoreSettings(**{"seed": 3, "watchdog_s": 30, "deterministic": deterministic, **settings})
    sampler = PromptSampler(prompts, settings.groups_per_step, seed=0, shuffle=False)
    program = PromptGroups(reward, str, SamplingParams(max_new_tokens, n=n), difficulty_mask=difficulty_mask)
    return RolloutCore(workers, program, sampler, settings)


def _keys(result):
    return sorted({s.row["key"] for s in result.samples if s.status.value in ("finished", "truncated")})


@pytest.fixture
def engine(ray_session):
    worker = ray.remote(num_cpus=0)(_FakeEngine).remote()
    yield worker
    ray.kill(worker)


def test_a_synchronous_step_consumes_its_prompts_in_order_and_counts_each_state(engine):
    stream = _stream([engine], dict(groups_per_step=4), _prompts(20), deterministic=True)
    first = stream.next_batch(step=1, policy_version=0)
    assert _keys(first) == [0, 1, 2, 3]
    assert first.metrics["rollout/groups/consumed"] == 4
    assert first.metrics["rollout/groups/queued"] == first.metrics["rollout/groups/generating"] == 0
    assert first.metrics["staleness/mean"] == 0
    second = stream.next_batch(step=2, policy_version=0)
    assert _keys(second) == [4, 5, 6, 7]


def test_a_reward_that_raises_fails_its_group_and_a_new_prompt_takes_its_place(engine):
    # prompt 9 raises in the reward: its group fails, is counted, and prompt 12 refills the batch
    stream = _stream([engine], dict(groups_per_step=4, max_refill_groups=2), _prompts(30))
    for step in (1, 2, 3):
        result = stream.next_batch(step=step, policy_version=0)
    assert result.metrics["rollout/groups/failed"] == 1
    assert result.metrics["rollout/refill_groups"] == 1
    assert _keys(result) == [8, 10, 11, 12]
    failed = [s for s in result.samples if s.status.value == "failed"]
    assert failed and all(s.row["key"] == 9 and "broken row" in s.metadata["error"] for s in failed)
    assert len({s.group_id for s in result.samples if s.status.value == "finished"}) == 4


def test_refill_replaces_filtered_groups_until_its_bound(engine):
    # groups of keys divisible by 3 get rewards [1, 0] (kept by the mask (0, 1)), the others [0, 0] (dropped)
    def mixed_on_multiples_of_three(completion, **row):
        return float(row["key"] % 3 == 0 and mixed_on_multiples_of_three.calls.__next__() % 2 == 0), {}

    import itertools

    mixed_on_multiples_of_three.calls = itertools.count()
    settings = dict(groups_per_step=3, max_refill_groups=4)
    stream = _stream([engine], settings, _prompts(40), reward=mixed_on_multiples_of_three,
                     difficulty_mask=(0.0, 1.0))
    result = stream.next_batch(step=1, policy_version=0)
    # keys 0, 3, 6 are the only mixed groups among 0..6: 4 refills (keys 3..6) after the first 3 prompts
    trained = {s.row["key"] for s in result.samples if s.status.value == "finished"}
    assert trained == {0, 3, 6}
    assert result.metrics["rollout/refill_groups"] == 4
    assert result.metrics["rollout/groups/filtered"] == 4
    assert result.metrics["rollout/refill_bound_hit"] == 0
    assert result.metrics["difficulty_mask/kept_samples"] == 6  # 3 groups x 2 samples
    # the next step: only key 9 of 7..10 is a multiple of 3 (and it raises): the bound is hit with 0 groups
    bounded = stream.next_batch(step=2, policy_version=0)
    assert bounded.metrics["rollout/refill_bound_hit"] == 1
    assert bounded.metrics["rollout/refill_groups"] == 4
    assert bounded.metrics["rollout/groups/consumed"] <= 2


def test_overprovisioning_aborts_the_slowest_groups_and_runs_them_in_a_long_round(ray_session):
    slow = {5: 1.2, 11: 1.2}  # two long-tail prompts; 5 is still generating when step 1 cuts it
    worker = ray.remote(num_cpus=0)(_FakeEngine).remote(delays=slow, tokens={5: 8, 11: 8},
                                                        held=frozenset({5}))
    settings = dict(groups_per_step=4, overprovision=1.5, long_round_every=3)
    stream = _stream([worker], settings, _prompts(40))
    first = stream.next_batch(step=1, policy_version=0)  # launches 0..5, keeps four of 0..4
    assert 5 not in _keys(first)
    assert first.metrics["rollout/groups/aborted"] >= 1 and first.metrics["rollout/long_queue"] == 1
    second = stream.next_batch(step=2, policy_version=1)
    assert 5 not in _keys(second) and 11 not in _keys(second)
    long = stream.next_batch(step=3, policy_version=2)  # the long round runs 5 and 11 to the end
    assert long.metrics["rollout/long_round"] == 1
    assert {5, 11} <= set(_keys(long))
    long_samples = [s for s in long.samples if s.row["key"] in (5, 11)]
    assert all(len(s.response_ids) == 8 for s in long_samples)
    ray.kill(worker)


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_asynchronous_batches_never_exceed_the_staleness_bound(ray_session, max_staleness):
    """Random generation times and random training times: every trained sample's oldest token is at most
    `max_staleness` versions behind the trainer, and the stream runs ahead (some samples are stale > 0)."""
    workers = [ray.remote(num_cpus=0)(_FakeEngine).remote(jitter=0.08, seed=s, tokens={k: 3 for k in range(200)})
               for s in range(2)]
    settings = dict(groups_per_step=4, max_staleness=max_staleness, max_refill_groups=8)
    stream = _stream(workers, settings, _prompts(200))
    rng, seen, staleness = random.Random(0), [], []
    try:
        for version in range(12):
            result = stream.next_batch(step=version + 1, policy_version=version)
            staleness += [version - min(s.policy_versions) for s in result.samples if s.status.value == "finished"]
            seen += _keys(result)
            if version == 0:  # the groups drawn ahead are sampled by version 0 too: some will be stale
                _wait_until(lambda: sum(ray.get([w.served_requests.remote() for w in workers])) >= 8)
            time.sleep(rng.uniform(0, 0.15))  # "training" (random lengths spread the interleavings)
            ray.get([w.set_version.remote(version + 1) for w in workers])  # the weight sync
    finally:
        stream.close()
    assert max(staleness) <= max_staleness
    assert max(staleness) >= 1  # it did run ahead
    assert len(seen) == len(set(seen))  # no prompt trained twice
    for worker in workers:
        ray.kill(worker)


def _constant(completion, **row):
    return 1.0, {}


def test_staleness_bounded_at_admission_trains_the_slow_group_in_its_step_and_drops_nothing(ray_session):
    """Key 0's response is slow (its first token by version 0, the rest once the next step's groups are done):
    it holds step 1 back while the groups drawn for step 2 generate, and every step trains the groups drawn for
    it, in draw order, within the bound; nothing is dropped, so the trained responses are as long as the
    generated ones."""
    worker = ray.remote(num_cpus=0)(_FakeEngine).remote(tokens={0: 8}, gated=frozenset({0}))
    stream = _stream([worker], dict(groups_per_step=2, max_staleness=1), _prompts(40), reward=_constant)
    # the gate opens once keys 1-3 (the rest of step 1's and step 2's groups) are done: held back, not cut
    opener = threading.Thread(target=lambda: (_wait_until(lambda: ray.get(worker.served_requests.remote()) >= 3),
                                              ray.get(worker.open_gate.remote(0))))
    opener.start()
    batches, metrics = [], []
    try:
        for version in range(5):
            result = stream.next_batch(step=version + 1, policy_version=version)
            batches.append(_keys(result))
            metrics.append(result.metrics)
            ray.get(worker.set_version.remote(version + 1))
    finally:
        opener.join()
        stream.close()
        ray.kill(worker)
    assert batches == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]  # draw order, whatever finished first
    assert all(m["rollout/stale_dropped"] == 0 and m["staleness/max"] <= 1 for m in metrics)
    # step 1 trains keys 0 and 1 (2 samples each: 8 and 1 tokens); by then keys 0-3 had finished
    assert metrics[0]["rollout/trained_response_len_mean"] == (8 + 1) / 2
    assert metrics[0]["rollout/generated_response_len_mean"] == (2 * 8 + 6 * 1) / 8


def test_staleness_by_dropping_drops_the_slow_group(ray_session):
    """`staleness_control: drop` hands out the groups that finish first: key 0, started by version 0 and
    finished after two updates, is too old to train and is dropped (and its long answers with it)."""
    worker = ray.remote(num_cpus=0)(_FakeEngine).remote(tokens={0: 8}, gated=frozenset({0}))
    settings = dict(groups_per_step=2, max_staleness=1, staleness_control="drop", max_refill_groups=0)
    stream = _stream([worker], settings, _prompts(40), reward=_constant)
    trained, dropped, lengths = [], 0.0, []
    try:
        for version in range(2):
            result = stream.next_batch(step=version + 1, policy_version=version)
            trained += _keys(result)
            ray.get(worker.set_version.remote(version + 1))
        ray.get(worker.open_gate.remote(0))  # key 0 finishes now, two versions after its first token
        _wait_until(lambda: any(group.index == 0 for group in stream._ready))
        for version in range(2, 4):
            result = stream.next_batch(step=version + 1, policy_version=version)
            trained += _keys(result)
            dropped += result.metrics["rollout/stale_dropped"]
            lengths.append(result.metrics["rollout/generated_response_len_mean"])
            ray.get(worker.set_version.remote(version + 1))
    finally:
        stream.close()
        ray.kill(worker)
    assert 0 not in trained and dropped == 1
    assert lengths[0] > 1  # generated (key 0's 8 tokens among them), never trained


def test_a_huge_staleness_bound_draws_prompts_as_the_queue_empties_and_logs_few_fractions(ray_session):
    """`max_staleness: 1000000` opens a quota of a million steps: drawn at once, it held 8 million prompts in
    memory (and in every checkpoint) and logged a million `staleness/frac_k` scalars a step."""
    worker = ray.remote(num_cpus=0)(_FakeEngine).remote(tokens={k: 2 for k in range(100)},
                                                        delays={k: 0.5 for k in range(100)})
    settings = dict(groups_per_step=4, max_staleness=1_000_000)
    stream = _stream([worker], settings, _prompts(100))
    ray.get(worker.seen.remote())  # the actor is up: its start is not what this test times
    try:
        started = time.perf_counter()
        result = stream.next_batch(step=1, policy_version=0)
        state = stream.state()
    finally:
        stream.close()
    assert time.perf_counter() - started < 60  # a hang guard (~1 s); what was drawn is checked below
    # drawn: what the engine took (up to 64 requests in flight, ~0.5 s each) and one step's launch queued
    # beyond it, not the quota's 4 million prompts
    assert state["next_index"] <= 3 * (64 + stream.settings.launched_per_step), state["next_index"]
    assert len(state["pending"]) <= state["next_index"]
    assert sorted(k for k in result.metrics if k.startswith("staleness/frac_")) == \
        [f"staleness/frac_{k}" for k in range(9)]
    ray.kill(worker)


def test_resume_regenerates_what_was_in_flight_and_skips_nothing(ray_session):
    worker = ray.remote(num_cpus=0)(_FakeEngine).remote(tokens={k: 2 for k in range(100)}, jitter=0.05)
    settings = dict(groups_per_step=4, max_staleness=1)
    def constant(completion, **row):
        return 1.0, {}

    stream = _stream([worker], settings, _prompts(100), reward=constant)
    trained, stale = [], 0.0
    for step in (1, 2, 3):
        result = stream.next_batch(step=step, policy_version=step - 1)
        trained += _keys(result)
        ray.get(worker.set_version.remote(step))  # the weight sync after the step
    stale += result.metrics["rollout/groups/stale"]  # counted since the stream started
    state = stream.state()  # taken with the next steps' groups in flight
    stream.close()
    assert state["pending"], "the producer runs ahead: something must be in flight"
    resumed = _stream([worker], settings, _prompts(100), reward=constant)
    resumed.load_state(state)
    try:
        for step in (4, 5, 6):
            result = resumed.next_batch(step=step, policy_version=step - 1)
            trained += _keys(result)
            # the keys queued again were drawn ahead: they count in the K steps the stream may run ahead
            assert result.metrics["staleness/max"] <= 1, step
            ray.get(worker.set_version.remote(step))
        stale += result.metrics["rollout/groups/stale"]
        final = resumed.state()
    finally:
        resumed.close()
    # every prompt drawn was trained once, is still pending, or went stale (dropped, counted): none skipped,
    # none twice
    held = [entry["index"] for entry in final["pending"]]
    assert len(set(trained + held)) == len(trained + held)
    assert set(trained + held) <= set(range(final["next_index"]))
    assert len(trained) + len(held) + stale == final["next_index"]
    ray.kill(worker)


@pytest.mark.parametrize("partial_rollout", ["continue", "resubmit"])
def test_partial_rollout_keeps_tokens_and_versions_across_weight_updates(ray_session, partial_rollout):
    """Updates land while groups generate: every trained sample still has all its tokens, its versions never
    decrease, some samples switch version mid-response, and `resubmit` sends unfinished samples again."""
    worker = ray.remote(num_cpus=0)(_FakeEngine).remote(delays={k: 0.3 for k in range(100)},
                                                        tokens={k: 6 for k in range(100)})
    settings = dict(groups_per_step=2, max_staleness=2, partial_rollout=partial_rollout)
    stream = _stream([worker], settings, _prompts(100), reward=lambda completion, **row: (1.0, {}),
                     max_new_tokens=6)
    samples, resubmitted, mixed = [], 0.0, []
    try:
        for version in range(6):
            result = stream.next_batch(step=version + 1, policy_version=version)
            samples += result.samples
            mixed.append(result.metrics["rollout/mixed_version_frac"])
            resubmitted += result.metrics["rollout/resubmitted_samples"]
            # the update lands while a sample is part-way, if any is generating (from step 2 on, the ones
            # drawn at the step's start are); `resubmit` must then abort it: it samples nothing more till then
            resubmit = partial_rollout == "resubmit"
            ray.get(worker.set_version.remote(version + 1, mid_response=True, pause=resubmit))
            stream.weights_updated()
    finally:
        stream.close()
    assert samples and all(len(s.response_ids) == 6 == len(s.policy_versions) == len(s.response_logprobs)
                           for s in samples)
    assert all(s.policy_versions == sorted(s.policy_versions) for s in samples)
    assert any(len(set(s.policy_versions)) > 1 for s in samples)  # a switch mid-response
    assert sum(m * 2 * 2 for m in mixed) == sum(len(set(s.policy_versions)) > 1 for s in samples)  # counted
    assert (resubmitted > 0) == (partial_rollout == "resubmit")
    ray.kill(worker)


def test_a_group_sampled_by_version_0_goes_stale_like_any_other():
    """Version 0 is a version: a group whose oldest token is 0 is 2 versions old at version 2 (it once
    counted as fresh, `0 or version`, and slipped past a bound of 1 when the timing let it wait)."""
    from rollflow.data.sample import Sample
    from rollflow.rollout.core import Group, GroupState

    stream = _stream([], dict(groups_per_step=2, max_staleness=1, max_refill_groups=0, staleness_control="drop"),
                     _prompts(4))
    old = Group(_prompts(1)[0], index=0, group_id=0, state=GroupState.READY,
                      samples=[Sample([0], [1, 2], policy_versions=[0, 1])])
    fresh = Group(_prompts(2)[1], index=1, group_id=1, state=GroupState.READY,
                        samples=[Sample([1], [3], policy_versions=[1])])
    stream._ready = [old, fresh]
    stream._drop_stale(policy_version=2)
    stream.close()
    assert stream._ready == [fresh] and old.state == GroupState.STALE
