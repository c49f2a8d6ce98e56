import asyncio

import pytest
import torch

from rollflow.backends.torch_backend import TorchBackend
from rollflow.cluster.weight_sync import weights_checksum
from rollflow.data.sample import Sample, collate
from rollflow.engines import ENGINES, create_engine
from rollflow.engines.base import GenerationRequest, SamplingParams
from rollflow.engines.hf import HFEngine
from rollflow.errors import WeightSyncError
from rollflow.registry import UnknownNameError

PROMPTS = [[3, 20, 21, 5], [3, 22, 5], [3, 23, 24, 25, 26, 5]]


def _run(engine, requests):
    async def main():
        return await asyncio.gather(*[engine.generate(r) for r in requests])

    return asyncio.run(main())


@pytest.fixture
def engine(random_model_dir):
    return HFEngine(random_model_dir, seed=0)


def test_generates_n_completions_with_logprobs_and_versions(engine):
    params = SamplingParams(max_new_tokens=5, temperature=1.0, n=3)
    completions = _run(engine, [GenerationRequest(f"r{i}", p, params) for i, p in enumerate(PROMPTS)])
    assert [c.request_id for c in completions] == ["r0", "r1", "r2"]
    for completion in completions:
        assert len(completion.outputs) == 3
        for out in completion.outputs:
            assert 1 <= len(out.token_ids) <= 5
            assert len(out.logprobs) == len(out.token_ids) == len(out.policy_versions)
            assert all(lp <= 0 for lp in out.logprobs) and set(out.policy_versions) == {0}
            assert out.finish_reason in ("stop", "length")
            assert (out.finish_reason == "length") == (len(out.token_ids) == 5 and out.token_ids[-1] not in engine.eos_ids)


def test_engine_logprobs_match_the_trainer(engine, random_model_dir):
    """Token-in, token-out: the trainer recomputes the engine's logprobs on the same tokens."""
    params = SamplingParams(max_new_tokens=6, temperature=0.7, n=4)
    completions = _run(engine, [GenerationRequest(f"r{i}", p, params) for i, p in enumerate(PROMPTS)])
    samples = [Sample(PROMPTS[i], o.token_ids, o.logprobs) for i, c in enumerate(completions) for o in c.outputs]
    batch = collate(samples, pad_token_id=0)
    trainer = TorchBackend(random_model_dir, trainable=False, micro_batch_size=5)
    gap = ((trainer.forward_logprobs(batch, temperature=0.7) - batch.rollout_logprobs).abs() * batch.response_mask)
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


def test_abort_stops_a_running_request_and_leaves_others(engine):
    long = SamplingParams(max_new_tokens=40, temperature=1.0, n=2, stop_token_ids=())

    async def main():
        engine.eos_ids = []  # never stop early, so the abort lands mid-generation
        victim = asyncio.ensure_future(engine.generate(GenerationRequest("victim", PROMPTS[0], long)))
        other = asyncio.ensure_future(engine.generate(GenerationRequest("other", PROMPTS[1], long)))
        for _ in range(5):
            await asyncio.sleep(0)
        engine.abort(["victim"])
        return await victim, await other

    victim, other = asyncio.run(main())
    assert all(o.finish_reason == "abort" for o in victim.outputs)
    assert all(len(o.token_ids) < 40 for o in victim.outputs)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 40 for o in other.outputs)


def test_update_weights_verifies_checksum_and_sets_version(engine):
    weights = {n: p.detach().clone() + 0.01 for n, p in engine.model.named_parameters()}
    engine.update_weights(weights, version=3, checksum=weights_checksum(weights))
    assert engine.version == 3
    name = next(iter(weights))
    assert torch.equal(dict(engine.model.named_parameters())[name], weights[name])
    corrupted = {n: t.clone() for n, t in weights.items()}
    corrupted[name].view(-1)[0] += 1.0
    with pytest.raises(WeightSyncError):
        engine.update_weights(corrupted, version=4, checksum=weights_checksum(weights))
    assert engine.version == 3


def test_engine_registry_is_lazy_and_rejects_unknown_names(random_model_dir):
    assert "hf" in ENGINES
    with pytest.raises(UnknownNameError, match="Valid: hf"):
        create_engine("vlm", model_path=random_model_dir)
