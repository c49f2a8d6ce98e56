"""SGLang engine: the conversions to and from SGLang's request / result dicts, checked on CPU without
SGLang, and the real engine on a GPU. The thread that drives SGLang's event loop is tested with a stand-in
for `sglang.Engine` in test_loop_thread.py."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rollflow.engines.base import GenerationRequest, SamplingParams
from rollflow.engines.sglang_engine import (
    completion_output_from_sglang,
    finish_reason_from_sglang,
    original_logprob_enabled,
    sglang_image_data,
    sglang_sampling_params,
)
from tests.engines.vlm_parity import vlm_parity_gap


def test_sampling_params_one_dict_per_sample_with_every_knob_explicit():
    params = SamplingParams(max_new_tokens=7, temperature=0.6, top_p=0.9, top_k=0, n=2, stop_token_ids=(5,))
    expected = {"max_new_tokens": 7, "min_new_tokens": 0, "temperature": 0.6, "top_p": 0.9, "top_k": -1,
                "min_p": 0.0, "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                "stop_token_ids": [5]}
    assert sglang_sampling_params(params) == [expected, expected]
    seeded = sglang_sampling_params(SamplingParams(top_k=4, n=3, seed=2))
    # sample seeds as in the hf engine: seed * 1_000_003 + slot
    assert [p["sampling_seed"] for p in seeded] == [2_000_006, 2_000_007, 2_000_008]
    assert {p["top_k"] for p in seeded} == {4}
    assert sglang_sampling_params(SamplingParams(min_new_tokens=5))[0]["min_new_tokens"] == 5


def test_original_logprob_switch_is_read_like_sglang_reads_booleans():
    assert original_logprob_enabled({"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"})
    assert original_logprob_enabled({"SGLANG_RETURN_ORIGINAL_LOGPROB": "True"})
    assert not original_logprob_enabled({"SGLANG_RETURN_ORIGINAL_LOGPROB": "false"})
    assert not original_logprob_enabled({})


def test_finish_reasons_map_and_unknown_ones_fail():
    reasons = [{"type": "stop", "matched": 1}, {"type": "length", "length": 4},
               {"type": "abort", "message": "x"}]
    assert [finish_reason_from_sglang(r) for r in reasons] == ["stop", "length", "abort"]
    assert finish_reason_from_sglang(None) == "abort"  # returned without finishing
    with pytest.raises(RuntimeError, match="weird"):
        finish_reason_from_sglang({"type": "weird"})


def test_result_dict_becomes_tokens_with_their_logprobs():
    result = {"output_ids": [7, 1], "meta_info": {
        "id": "r#0", "finish_reason": {"type": "stop", "matched": 1},
        "output_token_logprobs": [(-0.25, 7, None), (-1.5, 1, None)]}}
    out = completion_output_from_sglang(result, version=3)
    assert (out.token_ids, out.logprobs, out.policy_versions) == ([7, 1], [-0.25, -1.5], [3, 3])
    assert out.finish_reason == "stop"
    with pytest.raises(RuntimeError, match="return_logprob"):
        completion_output_from_sglang({"meta_info": {"finish_reason": None}}, version=0)


@pytest.mark.gpu
def test_sglang_engine_refuses_to_start_with_original_logprobs(random_model_dir, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("sglang")
    from rollflow.engines.sglang_engine import SGLangEngine

    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    with pytest.raises(ValueError, match="SGLANG_RETURN_ORIGINAL_LOGPROB"):
        SGLangEngine(random_model_dir)
    monkeypatch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB")
    engine = SGLangEngine(random_model_dir, mem_fraction_static=0.25, disable_cuda_graph=True)
    try:
        params = SamplingParams(max_new_tokens=4, temperature=1.0, n=3)
        completion = asyncio.run(engine.generate(GenerationRequest("s", [3, 20, 5], params)))
        assert len(completion.outputs) == 3 and all(1 <= len(o.token_ids) <= 4 for o in completion.outputs)
    finally:
        engine.close()


def test_a_vlm_request_sends_its_images_once_per_sample():
    from rollflow.data.vision import VisionInputs
    from rollflow.data.visual_tasks import draw_cells

    images = [draw_cells({0: (230, 40, 40)})]
    vision = VisionInputs(torch.zeros(64, 96), torch.tensor([[1, 8, 8]]), images)
    request = GenerationRequest("v", [3, 7, 5], SamplingParams(n=3), vision)
    assert sglang_image_data(request) == {"image_data": [images, images, images]}
    assert sglang_image_data(GenerationRequest("t", [3, 5], SamplingParams(n=2))) == {}


@pytest.mark.gpu
def test_sglang_samples_a_vlm_prompt_with_the_logprobs_the_trainer_gives(vl_model_dir):
    """Not run on this project's CPU machines: SGLang needs a CUDA GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("sglang")
    from rollflow.engines.sglang_engine import SGLangEngine

    gap = vlm_parity_gap(lambda path: SGLangEngine(path, mem_fraction_static=0.25, disable_cuda_graph=True),
                         vl_model_dir)
    assert gap < 1e-2, gap
