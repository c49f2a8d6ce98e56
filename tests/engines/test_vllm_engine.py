"""vLLM engine: the conversions to and from vLLM's types, checked on CPU without vLLM (its outputs are built
with SimpleNamespace in the shapes vLLM documents), and the real engine on a GPU."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from rollflow.engines.base import CompletionOutput, GenerationRequest, SamplingParams
from rollflow.engines.hf import _filter_top_k_top_p
from rollflow.engines.vllm_engine import (
    apply_request_output,
    finish_reason_from_vllm,
    logprob_mismatch,
    vllm_sampling_kwargs,
)


def test_sampling_kwargs_map_every_field_and_ask_for_the_sampled_tokens_logprob():
    params = SamplingParams(max_new_tokens=7, temperature=0.6, top_p=0.9, top_k=0, n=4,
                            stop_token_ids=(5, 9), seed=11)
    assert vllm_sampling_kwargs(params) == {
        "n": 4, "temperature": 0.6, "top_p": 0.9, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
        "frequency_penalty": 0.0, "presence_penalty": 0.0, "max_tokens": 7, "min_tokens": 0, "seed": 11,
        "stop_token_ids": [5, 9], "logprobs": 0, "detokenize": False,
    }
    assert vllm_sampling_kwargs(SamplingParams(top_k=20))["top_k"] == 20
    assert vllm_sampling_kwargs(SamplingParams())["seed"] is None
    assert vllm_sampling_kwargs(SamplingParams(min_new_tokens=3))["min_tokens"] == 3
    # vLLM refuses greedy sampling with n > 1: one greedy sample, which the engine copies n times
    assert vllm_sampling_kwargs(SamplingParams(temperature=0.0, n=4))["n"] == 1


def _vllm_reported_logprob(logits: torch.Tensor, token: int, params: SamplingParams, mode: str) -> float:
    """What vLLM's sampler reports for `token`, following the order its Sampler docstring gives
    (vllm/v1/sample/sampler.py): raw_logprobs = log-softmax of the logits before anything; otherwise greedy
    requests get log-softmax of the logits, sampled ones log-softmax after temperature and top-k / top-p."""
    if mode == "raw_logprobs" or params.temperature == 0:
        return float(torch.log_softmax(logits, -1)[token])
    processed = _filter_top_k_top_p((logits / params.temperature).unsqueeze(0), [params])[0]
    return float(torch.log_softmax(processed, -1)[token])


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0), SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.0, top_k=3), SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=0.7, top_p=0.5),
    SamplingParams(temperature=1.3, top_k=3, top_p=0.8),
])
def test_logprob_mismatch_is_reported_exactly_when_vllm_would_report_another_quantity(params, mode):
    torch.manual_seed(0)
    logits = torch.randn(50) * 3  # [V]
    token = int(logits.argmax())  # inside every top-k / top-p set
    rollflow = float(torch.log_softmax(logits / (params.temperature or 1.0), -1)[token])
    same = abs(_vllm_reported_logprob(logits, token, params, mode) - rollflow) < 1e-6
    assert (logprob_mismatch(params, mode) is None) == same


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_min_new_tokens_is_a_mismatch_under_processed_logprobs_only(temperature):
    """vLLM's sampler masks EOS / stop ids for min_tokens before it takes processed logprobs (its Sampler
    docstring: step 5 before step 7), so those are renormalized without the stop ids; raw_logprobs come
    before the mask (and are refused for temperatures other than 0 and 1, as without min_new_tokens)."""
    params = SamplingParams(temperature=temperature, min_new_tokens=4)
    assert "min_new_tokens" in logprob_mismatch(params, "processed_logprobs")
    assert (logprob_mismatch(params, "raw_logprobs") is None) == (temperature in (0.0, 1.0))
    assert logprob_mismatch(SamplingParams(temperature=temperature), "processed_logprobs") is None


def test_logprob_mismatch_refuses_modes_that_return_logits():
    assert "processed_logprobs" in logprob_mismatch(SamplingParams(), "raw_logits")


def test_finish_reasons_map_and_unknown_ones_fail():
    reasons = ("stop", "length", "abort", None)
    assert [finish_reason_from_vllm(r) for r in reasons] == ["stop", "length", "abort", None]
    with pytest.raises(RuntimeError, match="error"):
        finish_reason_from_vllm("error")


def _delta(index, tokens, logprobs, finish=None):
    """One vLLM CompletionOutput of a DELTA stream: new token ids and one {token: Logprob} per token."""
    mappings = [{token: SimpleNamespace(logprob=lp) for token, lp in entry.items()} for entry in logprobs]
    return SimpleNamespace(index=index, token_ids=tokens, finish_reason=finish, logprobs=mappings)


def test_delta_outputs_accumulate_per_sample_with_the_version_at_arrival():
    outputs = [CompletionOutput(finish_reason="abort") for _ in range(3)]
    # The sampled token's entry is picked even when the mapping holds other tokens too (vLLM adds the
    # top-`logprobs` tokens, and with logprobs=0 may still carry the sampled one with a rank).
    apply_request_output(outputs, SimpleNamespace(outputs=[
        _delta(0, [5, 6], [{5: -0.1}, {6: -0.5, 9: -0.2}]),
        _delta(1, [7], [{7: -1.5}]),
    ]), version=3)
    apply_request_output(outputs, SimpleNamespace(outputs=[
        _delta(0, [1], [{1: -0.3}], finish="stop"),
        _delta(1, [8], [{8: -2.0}], finish="length"),
    ]), version=4)
    assert [o.token_ids for o in outputs] == [[5, 6, 1], [7, 8], []]
    assert [o.logprobs for o in outputs] == [[-0.1, -0.5, -0.3], [-1.5, -2.0], []]
    assert [o.policy_versions for o in outputs] == [[3, 3, 4], [3, 4], []]
    assert [o.finish_reason for o in outputs] == ["stop", "length", "abort"]  # sample 2 never finished


def test_tokens_without_logprobs_are_an_error():
    outputs = [CompletionOutput()]
    with pytest.raises(RuntimeError, match="logprobs"):
        apply_request_output(outputs, SimpleNamespace(outputs=[
            SimpleNamespace(index=0, token_ids=[4], logprobs=None, finish_reason=None)]), version=0)


@pytest.mark.gpu
def test_vllm_engine_refuses_requests_whose_logprobs_would_differ(random_model_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm")
    from rollflow.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(random_model_dir, dtype="bfloat16", gpu_memory_utilization=0.25, enforce_eager=True)
    try:
        filtered = GenerationRequest("f", [3, 20, 5], SamplingParams(temperature=0.7, top_k=5))
        with pytest.raises(ValueError, match="top-k"):
            asyncio.run(engine.generate(filtered))
    finally:
        engine.close()
