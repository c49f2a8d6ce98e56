import asyncio
import re
import subprocess
import sys

import pytest
import torch

from rollflow.backends.base import TrainerSettings
from rollflow.backends.torch_backend import TorchBackend
from rollflow.data.sample import Sample, collate
from rollflow.engines import ENGINES, create_engine
from rollflow.engines.base import SEED_MODULUS, GenerationRequest, SamplingParams, sample_seed
from rollflow.engines.hf import HFEngine
from rollflow.errors import EngineError
from rollflow.registry import UnknownNameError

PROMPTS = [[3, 20, 21, 5], [3, 22, 5], [3, 23, 24, 25, 26, 5]]


def _run(engine, requests):
    async def main():
        return await asyncio.gather(*[engine.generate(r) for r in requests])

    return asyncio.run(main())


@pytest.fixture
def engine(random_model_dir):
    return HFEngine(random_model_dir, seed=0)


def test_prefill_once_per_request_and_finished_rows_leave_the_batch(engine, random_model_dir, monkeypatch):
    """Requests of different lengths in one batch: the decode batch shrinks as rows finish, and every
    row's tokens and logprobs are what the trainer recomputes (no row reads another row's KV cache)."""
    batch_sizes = []
    forward = engine._forward
    monkeypatch.setattr(engine, "_forward",
                        lambda ids, *rest: batch_sizes.append(ids.shape[0]) or forward(ids, *rest))
    engine.eos_ids = []  # lengths set by max_new_tokens alone
    requests = [GenerationRequest(f"r{i}", p, SamplingParams(max_new_tokens=limit, temperature=0.8, n=2))
                for i, (p, limit) in enumerate(zip(PROMPTS, (2, 3, 9)))]
    completions = _run(engine, requests)
    assert [[len(o.token_ids) for o in c.outputs] for c in completions] == [[2, 2], [3, 3], [9, 9]]
    # Forward calls: prefill of the 3 prompts (not 6 rows); the 6 rows after token 1; after token 2 two
    # rows finished (>= a quarter idle): 4; after token 3 two more: 2, until token 9 (no forward after it).
    assert batch_sizes == [3, 6, 4, 2, 2, 2, 2, 2, 2]
    samples = [Sample(PROMPTS[i], o.token_ids, o.logprobs)
               for i, c in enumerate(completions) for o in c.outputs]
    batch = collate(samples, pad_token_id=0)
    trainer = TorchBackend(TrainerSettings(random_model_dir, trainable=False, micro_batch_size=6))
    recomputed = trainer.forward_logprobs(batch, temperature=0.8)  # [B, T]
    gap = (recomputed - batch.rollout_logprobs).abs() * batch.response_mask
    assert float(gap.max()) < 1e-4


def test_greedy_is_deterministic_and_seeded_sampling_reproduces(random_model_dir):
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    first = _run(HFEngine(random_model_dir, seed=1), [GenerationRequest("a", PROMPTS[0], greedy)])
    second = _run(HFEngine(random_model_dir, seed=2), [GenerationRequest("a", PROMPTS[0], greedy)])
    assert first[0].outputs[0].token_ids == second[0].outputs[0].token_ids
    seeded = SamplingParams(max_new_tokens=6, temperature=1.0, n=2, seed=7)
    a = _run(HFEngine(random_model_dir, seed=1), [GenerationRequest("a", PROMPTS[1], seeded)])
    b = _run(HFEngine(random_model_dir, seed=2), [GenerationRequest("a", PROMPTS[1], seeded)])
    assert [o.token_ids for o in a[0].outputs] == [o.token_ids for o in b[0].outputs]


def test_update_weights_loads_the_weights_sets_the_version_and_rejects_unknown_names(engine):
    weights = {n: p.detach().clone() + 0.01 for n, p in engine.model.named_parameters()}
    engine.update_weights(weights, version=3)
    assert engine.version == 3
    name = next(iter(weights))
    assert torch.equal(dict(engine.model.named_parameters())[name], weights[name])
    before = dict(engine.model.named_parameters())[name].detach().clone()
    with pytest.raises(KeyError, match="not_a_parameter"):  # refused before any tensor is copied
        engine.update_weights({name: weights[name] + 1.0, "not_a_parameter": weights[name]}, version=4)
    assert engine.version == 3
    assert torch.equal(dict(engine.model.named_parameters())[name], before)


def test_close_resolves_running_and_queued_requests_and_refuses_new_ones(random_model_dir):
    """A request mid-decoding and one queued behind it both resolve at close() (nobody waits forever); the
    engine then refuses work with a clear error."""
    engine = HFEngine(random_model_dir, seed=0, max_batch_size=2)
    engine.eos_ids = []  # only max_new_tokens ends a sample: the running one cannot finish before close()
    running = GenerationRequest("running", PROMPTS[0], SamplingParams(max_new_tokens=40, n=2))
    queued = GenerationRequest("queued", PROMPTS[1], SamplingParams(max_new_tokens=40))  # over the batch

    async def main():
        tasks = [asyncio.ensure_future(engine.generate(r)) for r in (running, queued)]

        async def first_token():
            while engine.stats["tokens"] == 0:
                await asyncio.sleep(0)

        await asyncio.wait_for(first_token(), timeout=30)
        runner = engine._runner
        engine.close()
        completions = await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
        await asyncio.sleep(0)  # the runner sees its cancellation
        with pytest.raises(RuntimeError, match="closed"):
            await engine.generate(GenerationRequest("late", PROMPTS[2], SamplingParams(max_new_tokens=2)))
        return completions, runner

    completions, runner = asyncio.run(main())
    assert runner.cancelled()
    assert [c.request_id for c in completions] == ["running", "queued"]
    assert [[o.finish_reason for o in c.outputs] for c in completions] == [["abort", "abort"], ["abort"]]
    assert all(o.token_ids == [] and o.logprobs == [] for c in completions for o in c.outputs)
    assert engine.model is None
    with pytest.raises(RuntimeError, match="closed"):
        engine.update_weights({}, version=1)
    engine.close()  # idempotent


def _outcomes(engine, requests, timeout_s=30):
    """Each request's completion or exception, with every request in flight together."""
    async def main():
        return await asyncio.wait_for(asyncio.gather(*[engine.generate(r) for r in requests],
                                                     return_exceptions=True), timeout=timeout_s)

    return asyncio.run(main())


def test_nan_weights_fail_every_request_promptly_and_the_engine_serves_again_once_restored(engine):
    """Sampled, greedy and queued requests all fail with one EngineError line (none waits forever); the
    engine then serves a request on good weights."""
    engine.max_batch_size = 3  # "queued" (n=2) does not fit next to the other three rows: it waits
    good = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    engine.update_weights({name: torch.full_like(t, float("nan")) for name, t in good.items()}, version=1)
    requests = [GenerationRequest("sampled", PROMPTS[0], SamplingParams(max_new_tokens=8, n=2)),
                GenerationRequest("greedy", PROMPTS[1], SamplingParams(max_new_tokens=8, temperature=0.0)),
                GenerationRequest("queued", PROMPTS[2], SamplingParams(max_new_tokens=8, n=2))]
    outcomes = _outcomes(engine, requests)
    assert all(isinstance(outcome, EngineError) for outcome in outcomes), outcomes
    assert str(outcomes[0]) == ("hf engine: decoding failed: the model's logits are not finite "
                                "(non-finite weights?)")
    assert not engine._unresolved and not engine._queue

    engine.update_weights(good, version=2)
    completion = _outcomes(engine, [GenerationRequest("after", PROMPTS[0], SamplingParams(max_new_tokens=3))])[0]
    assert len(completion.outputs[0].token_ids) >= 1 and completion.metadata["version"] == 2


def test_an_error_mid_decoding_fails_the_batch_and_the_queue_with_its_first_line(engine, monkeypatch):
    engine.eos_ids = []  # every row runs to max_new_tokens: the failure comes mid-decoding
    engine.max_batch_size = 2
    forward, calls = engine._forward, []

    def failing_forward(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore details")
        return forward(*args)

    monkeypatch.setattr(engine, "_forward", failing_forward)
    requests = [GenerationRequest(f"r{i}", prompt, SamplingParams(max_new_tokens=10))
                for i, prompt in enumerate(PROMPTS)]
    outcomes = _outcomes(engine, requests)
    assert [str(outcome) for outcome in outcomes] == [
        "hf engine: decoding failed: CUDA error: an illegal memory access was encountered"] * 3
    monkeypatch.setattr(engine, "_forward", forward)
    assert len(_outcomes(engine, requests[:1])[0].outputs[0].token_ids) == 10


@pytest.mark.parametrize("field, value", [("max_new_tokens", 0), ("n", 0), ("temperature", -0.1),
                                          ("temperature", float("nan")), ("min_new_tokens", -1),
                                          ("min_new_tokens", 17)])  # over the default max_new_tokens 16
def test_sampling_params_refuse_values_no_engine_can_sample_with(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_any_request_seed_gives_sample_seeds_inside_torch_range(engine):
    assert sample_seed(2, 1) == 2_000_007  # 2 * 1_000_003 + 1
    assert 0 <= sample_seed(SEED_MODULUS - 1, 7) < SEED_MODULUS  # would overflow manual_seed unreduced
    params = SamplingParams(max_new_tokens=3, n=2, seed=SEED_MODULUS - 1)
    first, second = (_outcomes(engine, [GenerationRequest("s", PROMPTS[0], params)])[0] for _ in range(2))
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]


def test_engine_registry_is_lazy_and_rejects_unknown_names(random_model_dir):
    assert {"hf", "sglang", "sim", "vllm"} <= set(ENGINES.names())
    valid = re.escape(f"Valid: {', '.join(ENGINES.names())}")
    with pytest.raises(UnknownNameError, match=rf"Did you mean 'vllm'.*{valid}"):
        create_engine("vlm", model_path=random_model_dir)
    # Only selecting a GPU engine imports its module, and only constructing it imports the library.
    code = ("import sys, rollflow.engines, rollflow.engines.vllm_engine, rollflow.engines.sglang_engine; "
            "print(sorted(m for m in ('vllm', 'sglang') if m in sys.modules))")
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert imported.stdout.strip() == "[]"


# ---- continuous batching --------------------------------------------------------------------------------
LONG_PROMPT = [3, 23, 24, 25, 26, 27, 28, 29, 30, 5]  # longer than the running cache when it joins below


async def _staggered(engine, requests, after_tokens):
    """Submit request i once the engine has sampled `after_tokens[i]` tokens; the completions in order.

    The tests that place a join at a token build their engine with `admit_wait_steps=0` (an arrival joins at
    the next token instead of being held back to join with later ones)."""
    tasks = []
    for request, tokens in zip(requests, after_tokens):
        while engine.stats["tokens"] < tokens:
            await asyncio.sleep(0)
        tasks.append(asyncio.ensure_future(engine.generate(request)))
        await asyncio.sleep(0)
    return await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_requests_joining_a_running_batch_sample_what_a_static_batch_does(random_model_dir, temperature):
    """Seeded requests that join mid-decoding (a prompt longer than the running cache, then a shorter one)
    get the tokens and logprobs they get when all start together: padding, positions and per-position
    uniforms make a row's computation independent of when it joined."""
    requests = [GenerationRequest(f"r{i}", prompt, SamplingParams(max_new_tokens=8, temperature=temperature,
                                                                   n=2, seed=11 + i))
                for i, prompt in enumerate([PROMPTS[1], LONG_PROMPT, PROMPTS[0]])]
    static = HFEngine(random_model_dir, seed=0)
    joined = HFEngine(random_model_dir, seed=1, admit_wait_steps=0)
    for engine in (static, joined):
        engine.eos_ids = []  # every row runs its 8 tokens: the rows overlap for long
    together = asyncio.run(_staggered(static, requests, [0, 0, 0]))
    # r1 joins after r0's 2 rows sampled 2 tokens each (running cache: 3 + 2 columns < its 10 prompt
    # tokens), r2 once r1's rows sampled 4 (r2's 4-token prompt is left-padded to the running cache).
    staggered = asyncio.run(_staggered(joined, requests, [0, 4, 20]))
    assert static.stats["prefills"] == 1
    assert joined.stats["prefills"] == 3 and joined.stats["waves"] == 1  # they joined one running batch
    for a, b in zip(together, staggered):
        for out_a, out_b in zip(a.outputs, b.outputs):
            assert out_a.token_ids == out_b.token_ids and len(out_a.token_ids) == 8
            assert max(abs(x - y) for x, y in zip(out_a.logprobs, out_b.logprobs)) < 1e-5


@pytest.mark.parametrize("wait_steps", [0, 3])
def test_an_arrival_joins_the_running_batch_once_it_let_admit_wait_steps_tokens_pass(random_model_dir,
                                                                                     wait_steps, monkeypatch):
    """A request arriving mid-decoding is held back `admit_wait_steps` token boundaries, then joins the
    running batch (it does not wait for the batch to finish) and samples what it samples alone."""
    with pytest.raises(ValueError, match="admit_wait_steps must be >= 0"):
        HFEngine(random_model_dir, admit_wait_steps=-1)
    engine = HFEngine(random_model_dir, seed=0, admit_wait_steps=wait_steps)
    joins, join = [], engine._join

    def recording_join(batch, admitted):  # (decode steps run while each admitted request was queued, id)
        steps = engine.stats["decode_steps"]
        joins.extend((steps - p.submitted_step, p.request.request_id) for p in admitted)
        return join(batch, admitted)

    monkeypatch.setattr(engine, "_join", recording_join)
    long = GenerationRequest("long", PROMPTS[0], SamplingParams(max_new_tokens=30, min_new_tokens=30,
                                                                temperature=0.0))
    short = GenerationRequest("short", PROMPTS[1], SamplingParams(max_new_tokens=4, min_new_tokens=4,
                                                                  temperature=0.0))
    _, joined = asyncio.run(_staggered(engine, [long, short], [0, 5]))
    # The first boundary a request reaches comes after one decode step (it arrives between a token's
    # sampling and the next step), so it joins after `wait_steps + 1` steps.
    assert joins == [(0, "long"), (wait_steps + 1, "short")]
    assert engine.stats["waves"] == 1 and engine.stats["prefills"] == 2  # it joined the running batch
    assert 0 < joined.metadata["queue_seconds"] < joined.metadata["seconds"]
    expected = _run(HFEngine(random_model_dir, seed=0), [short])[0].outputs[0]
    assert joined.outputs[0].token_ids == expected.token_ids
    assert max(abs(x - y) for x, y in zip(joined.outputs[0].logprobs, expected.logprobs)) < 1e-5


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_conversations_on_their_own_clocks_sample_what_each_request_samples_alone(random_model_dir,
                                                                                  temperature):
    """Multi-turn conversations whose turns arrive one by one (each after an env delay of its own), through
    an engine holding arrivals back (the default `admit_wait_steps`): every turn samples the tokens and
    logprobs it samples alone, seeded rows included."""
    staggered, alone = HFEngine(random_model_dir, seed=0), HFEngine(random_model_dir, seed=1)
    for engine in (staggered, alone):
        engine.eos_ids = []  # every answer runs its max_new_tokens, so conversations overlap
    limits, observations = (2, 6, 3, 5, 4, 8), [[40, 41], [42], [43, 44, 45]]

    async def conversation(engine, index):
        prompt, outputs = PROMPTS[index % 3] + [50 + index], []
        for turn, observation in enumerate(observations):
            params = SamplingParams(max_new_tokens=limits[index], temperature=temperature,
                                    seed=10 * index + turn)
            request = GenerationRequest(f"c{index}t{turn}", prompt, params)
            outputs.append((await asyncio.wait_for(engine.generate(request), timeout=30)).outputs[0])
            await asyncio.sleep(0.001 * ((7 * index + 3 * turn) % 5))  # the env step
            prompt = prompt + outputs[-1].token_ids + observation
        return outputs

    async def together():
        return await asyncio.gather(*[conversation(staggered, i) for i in range(len(limits))])

    async def one_at_a_time():
        return [await conversation(alone, i) for i in range(len(limits))]

    for outputs, expected in zip(asyncio.run(together()), asyncio.run(one_at_a_time()), strict=True):
        for out, reference in zip(outputs, expected, strict=True):
            assert out.token_ids == reference.token_ids and len(out.token_ids) > 1
            assert max(abs(x - y) for x, y in zip(out.logprobs, reference.logprobs)) < 1e-5
    assert staggered.stats["prefills"] < 3 * len(limits)  # arrivals shared prefills


@pytest.mark.parametrize("continuous", [True, False])
def test_a_short_request_arriving_mid_decoding_finishes_before_a_long_one(random_model_dir, continuous):
    """With continuous batching a short request joins at the next token and is done long before the long
    one; in waves (`continuous_batching=False`) it waits for the long one to finish."""
    engine = HFEngine(random_model_dir, seed=0, continuous_batching=continuous)
    long = GenerationRequest("long", PROMPTS[0], SamplingParams(max_new_tokens=40, min_new_tokens=40))
    short = GenerationRequest("short", PROMPTS[1], SamplingParams(max_new_tokens=2, min_new_tokens=2))
    order = []

    async def main():
        async def run(request):
            completion = await engine.generate(request)
            order.append(request.request_id)
            return completion

        tasks = [asyncio.ensure_future(run(long))]
        while engine.stats["tokens"] < 5:  # the long request is decoding
            await asyncio.sleep(0)
        tasks.append(asyncio.ensure_future(run(short)))
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)

    completions = asyncio.run(main())
    assert [len(c.outputs[0].token_ids) for c in completions] == [40, 2]  # min_new_tokens: no EOS before
    assert order == (["short", "long"] if continuous else ["long", "short"])
    assert engine.stats["waves"] == (1 if continuous else 2)


def test_finished_rows_leave_and_the_cache_drops_columns_no_row_needs(engine, monkeypatch):
    """A long-prompt request finishes early: once it left, the cache is exactly as wide as the short row's
    own sequence (its left padding is gone)."""
    widths = []
    forward = engine._forward
    monkeypatch.setattr(engine, "_forward", lambda ids, attention, *rest: widths.append(attention.shape[1])
                        or forward(ids, attention, *rest))
    engine.eos_ids = []
    requests = [GenerationRequest("long_prompt", LONG_PROMPT, SamplingParams(max_new_tokens=2)),
                GenerationRequest("short_prompt", PROMPTS[1], SamplingParams(max_new_tokens=8))]
    _run(engine, requests)
    # Prefill: 10 columns; feeding token 1 of both rows: 11; then only the short row (3 prompt tokens)
    # remains and its token t (t = 2..7) is fed with 3 + t columns, as if it had run alone.
    assert widths == [10, 11] + [3 + t for t in range(2, 8)]


def test_the_cache_may_outgrow_the_models_positions_while_each_row_stays_within_its_own(random_model_dir):
    """A finished row that has not left yet (4 of 5 rows still run) keeps the cache's early columns while a
    request that joined late runs 55 tokens: the cache gets wider than the model's 64 positions, but
    position ids are per row, so the joined rows get what they get alone."""
    engine, alone = HFEngine(random_model_dir, seed=0, admit_wait_steps=0), HFEngine(random_model_dir, seed=0)
    widths, forward = [], engine._forward

    def recording_forward(ids, attention, *rest):
        widths.append(attention.shape[1])  # [B, L] mask: L cache columns
        return forward(ids, attention, *rest)

    engine._forward = recording_forward
    for e in (engine, alone):
        e.eos_ids = []
    first = GenerationRequest("first", PROMPTS[0], SamplingParams(max_new_tokens=30, temperature=0.0))
    late = GenerationRequest("late", PROMPTS[1], SamplingParams(max_new_tokens=55, n=4, seed=5))
    _, joined = asyncio.run(_staggered(engine, [first, late], [0, 25]))
    expected = _run(alone, [late])[0]
    assert max(widths) > engine.model.config.max_position_embeddings == 64
    for out, reference in zip(joined.outputs, expected.outputs):
        assert out.token_ids == reference.token_ids
        assert max(abs(x - y) for x, y in zip(out.logprobs, reference.logprobs)) < 1e-5


def test_update_weights_mid_generation_versions_the_later_tokens_and_keeps_the_earlier_ones(random_model_dir):
    """Partial rollout: tokens sampled before the update keep their tokens and version; every later token
    is sampled from the new weights (on top of the KV cache the old weights computed) and carries the
    new version."""
    from transformers import DynamicCache

    from rollflow.models import cache_keyword, load_causal_lm

    engine = HFEngine(random_model_dir, seed=0)
    engine.eos_ids = []
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    reference = _run(engine, [GenerationRequest("ref", PROMPTS[2], params)])[0].outputs[0]
    old = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    torch.manual_seed(1)
    new = {name: p + 0.05 * torch.randn_like(p) for name, p in old.items()}

    before = engine.stats["tokens"]

    async def main():
        task = asyncio.ensure_future(engine.generate(GenerationRequest("r", PROMPTS[2], params)))
        while engine.stats["tokens"] < before + 3:  # 3 tokens into this request
            await asyncio.sleep(0)
        sampled = engine.stats["tokens"] - before
        engine.update_weights(new, version=1)
        return await asyncio.wait_for(task, timeout=30), sampled

    completion, k = asyncio.run(main())
    out = completion.outputs[0]
    assert k >= 3 and len(out.token_ids) == 8
    assert out.policy_versions == [0] * k + [1] * (8 - k)
    assert out.token_ids[:k] == reference.token_ids[:k] and out.logprobs[:k] == reference.logprobs[:k]
    # Recompute: prompt and tokens 0..k-2 through the old weights (they were fed before the update), then
    # tokens k-1.. one at a time through the new weights.
    model = load_causal_lm(random_model_dir)
    cache = {cache_keyword(model): DynamicCache()}  # past_key_values before transformers 5.20, cache after
    prefix = torch.tensor([PROMPTS[2] + out.token_ids[:k - 1]])
    with torch.no_grad():
        model(input_ids=prefix, use_cache=True, **cache)
        model.load_state_dict(new, strict=False)
        for t in range(k, 8):
            logits = model(input_ids=torch.tensor([[out.token_ids[t - 1]]]), use_cache=True, **cache,
                           position_ids=torch.tensor([[len(PROMPTS[2]) + t - 1]])).logits[0, -1]
            log_probs = torch.log_softmax(logits.float(), -1)  # [V]
            assert int(log_probs.argmax()) == out.token_ids[t]
            assert abs(float(log_probs[out.token_ids[t]]) - out.logprobs[t]) < 1e-4


def test_min_new_tokens_keeps_stop_ids_out_until_then_and_reports_unmasked_logprobs(engine, random_model_dir):
    """Most of the vocabulary is a stop id: without min_new_tokens samples end at once; with it none of
    the first 5 tokens is a stop id. Logprobs are log-softmax(logits / T) over the whole vocabulary (what
    the trainer recomputes), not over the allowed tokens."""
    from rollflow.models import load_causal_lm

    stops = tuple(range(1, 70))
    free = SamplingParams(max_new_tokens=8, temperature=1.0, n=4, stop_token_ids=stops, seed=3)
    held = SamplingParams(max_new_tokens=8, temperature=1.0, n=4, stop_token_ids=stops, seed=3,
                          min_new_tokens=5)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=stops, min_new_tokens=3)
    completions = _run(engine, [GenerationRequest(f"r{i}", PROMPTS[0], params)
                                for i, params in enumerate((free, held, greedy))])
    assert sum(len(o.token_ids) for o in completions[0].outputs) < 4 * 5  # stop ids are likely here
    model = load_causal_lm(random_model_dir)
    for completion, minimum in zip(completions[1:], (5, 3)):
        for out in completion.outputs:
            assert not set(out.token_ids[:minimum]) & set(stops)
            assert len(out.token_ids) > minimum or len(out.token_ids) == 8
            assert out.finish_reason == ("stop" if out.token_ids[-1] in stops else "length")
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([PROMPTS[0] + out.token_ids])).logits[0]  # [P+T, V]
            # Temperature 1 for both: the sampled request's, and the greedy one's by definition.
            log_probs = torch.log_softmax(logits[len(PROMPTS[0]) - 1:-1], -1)  # [T, V]
            expected = log_probs.gather(1, torch.tensor(out.token_ids).unsqueeze(1)).squeeze(1)  # [T]
            assert torch.allclose(expected, torch.tensor(out.logprobs), atol=1e-4)


def test_abort_close_and_failure_reach_requests_that_joined_a_running_batch(random_model_dir, monkeypatch):
    """abort: a joined request ends "abort" with the prefix it generated, the running one is untouched;
    abort of an unknown id leaves nothing behind. close: both resolve "abort". A failure in the prefill of
    a joining request fails the running request too."""
    engine = HFEngine(random_model_dir, seed=0, admit_wait_steps=0)
    engine.eos_ids = []
    params = SamplingParams(max_new_tokens=30, temperature=0.0)
    alone = _run(engine, [GenerationRequest("alone", PROMPTS[1], params)])[0].outputs[0]

    async def until(tokens):  # the engine sampled `tokens` more tokens
        target = engine.stats["tokens"] + tokens
        while engine.stats["tokens"] < target:
            await asyncio.sleep(0)

    async def abort_joined():
        first = asyncio.ensure_future(engine.generate(GenerationRequest("first", PROMPTS[0], params)))
        await until(3)
        second = asyncio.ensure_future(engine.generate(GenerationRequest("second", PROMPTS[1], params)))
        await until(2 * 4)  # both rows sampled 4 more tokens
        engine.abort(["second", "never-submitted"])
        assert engine._aborted == {"second"}
        return await asyncio.wait_for(asyncio.gather(first, second), timeout=30)

    first, second = asyncio.run(abort_joined())
    assert engine._aborted == set()
    assert first.outputs[0].finish_reason == "length" and len(first.outputs[0].token_ids) == 30
    out = second.outputs[0]
    assert out.finish_reason == "abort" and 1 <= len(out.token_ids) < 30
    assert out.token_ids == alone.token_ids[: len(out.token_ids)]

    async def close_with_joined():
        tasks = [asyncio.ensure_future(engine.generate(GenerationRequest("a", PROMPTS[0], params)))]
        await until(2)
        tasks.append(asyncio.ensure_future(engine.generate(GenerationRequest("b", PROMPTS[1], params))))
        await until(2 * 2)
        engine.close()
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)

    closed = asyncio.run(close_with_joined())
    assert [c.outputs[0].finish_reason for c in closed] == ["abort", "abort"]

    failing = HFEngine(random_model_dir, seed=0, admit_wait_steps=0)
    forward = failing._forward

    def fail_on_second_prefill(ids, *rest):
        if ids.shape[1] > 1 and failing.stats["prefills"] == 1:
            raise RuntimeError("out of memory")
        return forward(ids, *rest)

    monkeypatch.setattr(failing, "_forward", fail_on_second_prefill)

    async def fail_joined():
        requests = [GenerationRequest("running", PROMPTS[0], params),
                    GenerationRequest("joining", PROMPTS[1], params)]
        return await _staggered(failing, requests, [0, 3])

    with pytest.raises(EngineError, match="decoding failed: out of memory"):
        asyncio.run(fail_joined())
    assert not failing._unresolved and not failing._queue and failing._runner.done()
