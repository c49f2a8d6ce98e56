import asyncio
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from rollflow.backends.base import TrainerSettings
from rollflow.backends.torch_backend import TorchBackend
from rollflow.data.sample import Sample, collate
from rollflow.engines import ENGINES, create_engine
from rollflow.engines.base import SEED_MODULUS, GenerationRequest, SamplingParams, sample_seed
from rollflow.engines.hf import HFEngine, cpu_decode_attention
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
    """Requests of different lengths in one wave: the decode batch shrinks as rows finish, and every
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
    """A request mid-wave and one queued behind it both resolve at close() (nobody waits forever); the
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
    engine.max_batch_size = 3  # "queued" (n=2) does not fit next to the other three rows: the next wave
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


def test_an_error_mid_wave_fails_the_wave_and_the_queue_with_its_first_line(engine, monkeypatch):
    engine.eos_ids = []  # every row runs to max_new_tokens: the failure comes mid-wave
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
                                          ("temperature", float("nan"))])
def test_sampling_params_refuse_values_no_engine_can_sample_with(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_any_request_seed_gives_sample_seeds_inside_torch_range(engine):
    assert sample_seed(2, 1) == 2_000_007  # 2 * 1_000_003 + 1
    assert 0 <= sample_seed(SEED_MODULUS - 1, 7) < SEED_MODULUS  # would overflow manual_seed unreduced
    params = SamplingParams(max_new_tokens=3, n=2, seed=SEED_MODULUS - 1)
    first, second = (_outcomes(engine, [GenerationRequest("s", PROMPTS[0], params)])[0] for _ in range(2))
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]


def test_cpu_decode_attention_equals_sdpa_with_grouped_heads_and_padding():
    """The matmul decode attention against torch's sdpa: 4 query heads on 2 KV heads, a padded row."""
    torch.manual_seed(0)
    query, key, value = torch.randn(3, 4, 1, 8), torch.randn(3, 2, 5, 8), torch.randn(3, 2, 5, 8)
    mask = torch.ones(3, 1, 1, 5, dtype=torch.bool)
    mask[1, ..., :2] = False  # row 1 is left-padded by two positions
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.3, enable_gqa=True)
    module = SimpleNamespace(num_key_value_groups=2)
    for attention_mask in (mask, None):
        if attention_mask is None:
            expected = F.scaled_dot_product_attention(query, key, value, scale=0.3, enable_gqa=True)
        output, weights = cpu_decode_attention(module, query, key, value, attention_mask, scaling=0.3)
        assert weights is None and output.shape == (3, 1, 4, 8)  # [B, 1, H, D]
        assert torch.allclose(output, expected.transpose(1, 2), atol=1e-6)


def test_engine_registry_is_lazy_and_rejects_unknown_names(random_model_dir):
    assert ENGINES.names() == ["hf", "sglang", "vllm"]
    with pytest.raises(UnknownNameError, match="Did you mean 'vllm'.*Valid: hf, sglang, vllm"):
        create_engine("vlm", model_path=random_model_dir)
    # Only selecting a GPU engine imports its module, and only constructing it imports the library.
    code = ("import sys, rollflow.engines, rollflow.engines.vllm_engine, rollflow.engines.sglang_engine; "
            "print(sorted(m for m in ('vllm', 'sglang') if m in sys.modules))")
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert imported.stdout.strip() == "[]"
