"""The engine-vs-trainer check for a VLM prompt, shared by the vLLM and SGLang engine tests."""

from __future__ import annotations

import asyncio

import torch


def vlm_parity_gap(make_engine, model_dir: str, seed: int | None = None) -> float:
    """Sample a count_shapes prompt with its image n=2 from `make_engine(model_dir)` and return the largest gap
    between the trainer's logprobs of those samples and the engine's."""
    from rollflow.backends.logprobs import response_logprobs
    from rollflow.data.prompts import PromptEncoder
    from rollflow.data.sample import Sample, collate
    from rollflow.data.vision import load_vision_processor
    from rollflow.data.visual_tasks import count_shapes_splits
    from rollflow.engines.base import GenerationRequest, SamplingParams
    from rollflow.models import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    encoder = PromptEncoder(tokenizer, processor=load_vision_processor(model_dir, tokenizer))
    prompt = encoder.encode(count_shapes_splits()[1][0])
    engine = make_engine(model_dir)
    try:
        request = GenerationRequest("vl", prompt.token_ids, SamplingParams(max_new_tokens=4, n=2, seed=seed),
                                    prompt.vision)
        outputs = asyncio.run(engine.generate(request)).outputs
    finally:
        engine.close()
    samples = [Sample(prompt.token_ids, list(o.token_ids), list(o.logprobs), [1] * len(o.token_ids),
                      vision=prompt.vision) for o in outputs]
    assert all(s.response_ids for s in samples)
    batch = collate(samples, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        trainer = response_logprobs(load_causal_lm(model_dir), batch)
    return ((trainer - batch.rollout_logprobs) * batch.response_mask).abs().max().item()
