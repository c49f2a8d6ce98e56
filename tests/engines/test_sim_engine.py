"""The `sim` engine: it schedules the same requests into the same batches as the `hf` engine, takes the time its
cost model says, draws lengths from its distribution within the request's limits, and keeps the engine
protocol (abort with the tokens so far, versions switching at a weight load, sleep refusing generation)."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from rollflow.engines.base import GenerationRequest, SamplingParams
from rollflow.engines.hf import HFEngine
from rollflow.engines.sim import SimEngine
from rollflow.sim.profiles import PROFILES

# (prompt length, samples, tokens) of requests that all arrive at once: more rows than fit one batch of 8
REQUESTS = [(4, 1, 5), (3, 2, 9), (6, 3, 4), (2, 1, 12), (5, 2, 3), (3, 3, 7), (4, 1, 6), (7, 2, 10), (3, 1, 2),
            (5, 3, 8)]


def _requests(prefix: str = "r") -> list[GenerationRequest]:
    """Each request generates exactly its tokens: min_new_tokens = max_new_tokens (no stop before)."""
    return [GenerationRequest(f"{prefix}{i}", [3 + (i + j) % 20 for j in range(prompt)],
                              SamplingParams(max_new_tokens=tokens, min_new_tokens=tokens, n=n, seed=i))
            for i, (prompt, n, tokens) in enumerate(REQUESTS)]


def _run(engine, requests: list[GenerationRequest]) -> tuple[list[str], list]:
    """Generate every request at once; returns the order the completions came back in, and the completions."""
    order: list[str] = []

    async def one(request):
        completion = await engine.generate(request)
        order.append(completion.request_id)
        return completion

    async def main():
        return await asyncio.gather(*[one(r) for r in requests])

    return order, asyncio.run(main())


def _sim(**simulation) -> SimEngine:
    return SimEngine("tiny", simulation={"time_scale": 1000.0, "token_scale": 1, **simulation})


def test_the_sim_engine_schedules_like_the_hf_engine(random_model_dir):
    hf = HFEngine(random_model_dir, max_batch_size=8, admit_wait_steps=0)
    sim = _sim(overrides={"max_running": 8})
    hf.batch_trace, sim.batch_trace = [], []
    hf_order, hf_completions = _run(hf, _requests())
    sim_order, sim_completions = _run(sim, _requests())
    hf.close()
    assert sim_order == hf_order  # the same completion order
    assert sim.batch_trace == hf.batch_trace  # the same rows in every decode step
    assert len(hf.batch_trace) > max(tokens for _, _, tokens in REQUESTS)  # more than one wave: admissions
    assert max(hf.batch_trace) == 8 and min(hf.batch_trace) < 8
    for hf_completion, sim_completion in zip(hf_completions, sim_completions):
        assert [len(o.token_ids) for o in sim_completion.outputs] == [len(o.token_ids) for o in hf_completion.outputs]
        assert {o.finish_reason for o in sim_completion.outputs} == {"length"}


def test_time_follows_the_cost_model():
    hardware = PROFILES.get("h800-7b")
    engine = _sim(time_scale=200.0)
    request = GenerationRequest("t", [3] * 10, SamplingParams(max_new_tokens=500, min_new_tokens=500, n=4))
    started = time.perf_counter()
    _run(engine, [request])
    wall = time.perf_counter() - started
    # one prefill of the 10-token prompt (the 4 rows share it), then 500 steps of 4 rows from 40 KV tokens
    expected = hardware.prefill_s_per_token * 10 + hardware.decode_seconds(500, 40, 4)
    assert engine.stats["simulated_seconds"] == pytest.approx(expected, rel=1e-6)
    assert engine.stats["decode_steps"] == 500 and engine.stats["tokens"] == 2000
    assert expected / 200 <= wall < expected / 200 + 0.5  # it slept the scaled time, and not much more


def test_the_decode_step_arithmetic():
    hardware = PROFILES.get("h800-7b")
    # 3 steps of 2 rows from 100 KV tokens: 3 * 8e-3 + 2.3e-8 * (100 + 102 + 104) = 0.024 + 7.038e-6
    assert hardware.decode_seconds(3, 100, 2) == pytest.approx(0.024 + 2.3e-8 * 306)
    for seconds in (0.0, 0.0079, 0.008, 0.5, 3.0):
        steps = hardware.decode_steps_within(seconds, 100, 2)  # the most whole steps that fit
        assert hardware.decode_seconds(steps, 100, 2) <= seconds < hardware.decode_seconds(steps + 1, 100, 2)


def test_lengths_follow_the_distribution_within_the_requests_limits():
    engine = _sim(token_scale=16)  # the default lognormal: median 300, 99th percentile 20x that
    params = SamplingParams(max_new_tokens=1000, n=500, seed=7)  # a limit of 16,000 simulated tokens
    _, (completion,) = _run(engine, [GenerationRequest("l", [3, 4], params)])
    payload = [len(o.token_ids) for o in completion.outputs]
    assert 15 <= statistics.median(payload) <= 23  # ~300 / 16 = 19 payload tokens
    assert sorted(payload)[int(0.99 * len(payload))] >= 10 * statistics.median(payload)  # the tail is long
    for output in completion.outputs:
        assert len(output.logprobs) == len(output.policy_versions) == len(output.token_ids)
        if output.finish_reason == "stop":
            assert output.token_ids[-1] == engine.eos_id and engine.eos_id not in output.token_ids[:-1]
        else:
            assert output.finish_reason == "length" and len(output.token_ids) == 1000
    _, (again,) = _run(_sim(token_scale=16), [GenerationRequest("l", [3, 4], params)])
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in completion.outputs]  # seeded
    short = SamplingParams(max_new_tokens=2, min_new_tokens=2, n=3)
    _, (capped,) = _run(engine, [GenerationRequest("c", [3], short)])
    assert [(len(o.token_ids), o.finish_reason) for o in capped.outputs] == [(2, "length")] * 3


def test_a_simulated_token_limit_below_one_payload_token_is_kept():
    # `rollflow plan` with a limit of 6 tokens at token_scale 16: the request's limit is 1 payload token (16
    # simulated ones), the engine's own 6; every row decodes 6 simulated tokens (3 rows x 6 steps = 18) and
    # ends at the limit with its 1 payload token
    engine = SimEngine("tiny", simulation={"time_scale": 1000.0, "token_scale": 16}, max_new_simulated_tokens=6)
    params = SamplingParams(max_new_tokens=1, n=3, seed=0)
    _, (completion,) = _run(engine, [GenerationRequest("six", [3, 4], params)])
    assert [(len(o.token_ids), o.finish_reason) for o in completion.outputs] == [(1, "length")] * 3
    assert engine.stats["decode_steps"] == 6 and engine.stats["tokens"] == 18


class _Clock:
    """The sim engine's `time`, whose `monotonic()` moves only when the test moves it (its simulated time then
    depends on nothing else); the rest of `time` as usual."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


def test_a_weight_load_versions_later_tokens_and_an_abort_keeps_what_was_generated(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr("rollflow.engines.sim.time", clock)
    engine = _sim(time_scale=50.0, overrides={"sync_fixed_s": 0.0, "model_bytes": 0})
    request = GenerationRequest("long", [3] * 4, SamplingParams(max_new_tokens=20_000, min_new_tokens=20_000))

    async def main():
        task = asyncio.ensure_future(engine.generate(request))
        for _ in range(100):  # a few turns of the loop: the engine admits it, and it decodes from clock 0 on
            if engine.stats["prefill_tokens"]:
                break
            await asyncio.sleep(0)
        clock.now += 0.3  # ~15 simulated seconds: ~1,800 tokens
        engine.update_weights({}, version=1)
        clock.now += 0.3
        engine.abort(["long"])
        return await asyncio.wait_for(task, 60)

    output = asyncio.run(main()).outputs[0]
    assert output.finish_reason == "abort" and 1000 < len(output.token_ids) < 20_000
    switch = output.policy_versions.index(1)
    assert set(output.policy_versions[:switch]) == {0} and set(output.policy_versions[switch:]) == {1}
    assert 0.25 < switch / len(output.token_ids) < 0.75  # the load came half-way


def test_sleep_refuses_generation_until_wake_and_close_resolves_everything():
    engine = _sim()
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        _run(engine, _requests()[:1])
    engine.wake()
    _, (completion,) = _run(engine, _requests()[:1])
    assert len(completion.outputs[0].token_ids) == REQUESTS[0][2]

    async def closed_mid_run():
        task = asyncio.ensure_future(engine.generate(GenerationRequest("c", [3], SamplingParams(
            max_new_tokens=50_000, min_new_tokens=50_000))))
        await asyncio.sleep(0.05)
        engine.close()
        return await task

    assert asyncio.run(closed_mid_run()).outputs[0].finish_reason == "abort"


def test_a_resubmitted_sample_continues_its_own_length(monkeypatch):
    """The core's `resubmit`: a sample aborted part-way comes back as prompt + its tokens so far, with what is left
    of its budget. The engine continues that sample (what is left of its 2,000 tokens), not a new one (a fresh
    draw would add 2,000 more); a request with another prompt still draws its own."""
    clock = _Clock()
    monkeypatch.setattr("rollflow.engines.sim.time", clock)
    engine = _sim(time_scale=50.0, overrides={"sync_fixed_s": 0.0, "model_bytes": 0})
    engine.lengths = engine.lengths.__class__("fixed", median=2000)
    prompt, budget = [3] * 4, 5000

    async def main():
        task = asyncio.ensure_future(engine.generate(GenerationRequest("s", prompt, SamplingParams(budget))))
        for _ in range(100):  # a few turns of the loop: the engine admits it, and it decodes from clock 0 on
            if engine.stats["prefill_tokens"]:
                break
            await asyncio.sleep(0)
        clock.now += 0.3  # part of the way
        engine.abort(["s"])
        first = (await asyncio.wait_for(task, 60)).outputs[0]
        prefix = first.token_ids
        rest = await _with_time_passing(engine.generate(GenerationRequest(
            "s-again", prompt + prefix, SamplingParams(budget - len(prefix)))))
        other = await _with_time_passing(engine.generate(GenerationRequest("t", [5] * 4, SamplingParams(budget))))
        return first, rest.outputs[0], other.outputs[0]

    async def _with_time_passing(generation):
        """Await `generation` while the test's clock runs ahead (a simulated minute every few milliseconds)."""
        task = asyncio.ensure_future(generation)
        for _ in range(10_000):  # a hang guard: it takes a few turns
            if task.done():
                return task.result()
            clock.now += 1.0
            if engine._changed is not None:
                engine._changed.set()  # the engine looks at the clock again now, not at its next timeout
            await asyncio.sleep(0.001)
        raise AssertionError("the simulated generation never finished")

    first, rest, other = asyncio.run(main())
    assert first.finish_reason == "abort" and 0 < len(first.token_ids) < 2000
    assert rest.finish_reason == "stop" and len(first.token_ids) + len(rest.token_ids) == 2000
    assert rest.token_ids[-1] == engine.eos_id
    assert len(other.token_ids) == 2000 and not engine._continuations  # drawn afresh; nothing left over
