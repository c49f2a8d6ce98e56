"""The bundled tiny model: what it is, that it answers held-out sums in the right format, and that its build
record matches the recipe that makes it (the build itself runs in tests/e2e/test_supervised_runs.py)."""

import asyncio
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

from rollflow.config import load_config
from rollflow.data.arithmetic import arithmetic_splits
from rollflow.data.supervised import chat_prompt_ids
from rollflow.engines import create_engine
from rollflow.engines.base import GenerationRequest, SamplingParams
from rollflow.pipelines import build_tiny_model

RECIPE = build_tiny_model.TINY_MODEL_DIR.parents[2] / "examples" / "sft_tiny.yaml"


@pytest.fixture(scope="module")
def bundled():
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model.TINY_MODEL_DIR)
    return model, AutoTokenizer.from_pretrained(build_tiny_model.TINY_MODEL_DIR)


@pytest.fixture(scope="module")
def bundled_engine():
    engine = create_engine("hf", model_path=str(build_tiny_model.TINY_MODEL_DIR))
    yield engine, AutoTokenizer.from_pretrained(build_tiny_model.TINY_MODEL_DIR)
    engine.close()


def greedy_completions(engine, tokenizer, prompts: list[str], max_new_tokens: int = 4) -> list[list[int]]:
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    requests = [GenerationRequest(f"greedy-{i}", chat_prompt_ids(tokenizer, p), greedy) for i, p in enumerate(prompts)]

    async def run():
        return await asyncio.gather(*(engine.generate(request) for request in requests))

    return [completion.outputs[0].token_ids for completion in asyncio.run(run())]


def test_bundled_model_config_size_and_tokenizer(bundled):
    model, tokenizer = bundled
    config = model.config
    assert isinstance(model, Qwen2ForCausalLM)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (128, 4, 4)
    assert (config.num_key_value_heads, config.intermediate_size, config.max_position_embeddings) == (2, 512, 256)
    assert config.tie_word_embeddings and config.vocab_size == len(tokenizer)
    assert model.dtype == torch.float32
    assert 0.9e6 < sum(p.numel() for p in model.parameters()) < 1.1e6
    assert tokenizer.padding_side == "left" and tokenizer.eos_token == "<eos>"
    for text in ("What is 7 * 8?", "a\n\tb  c", "23+58"):  # loaded as users and engines load it
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_build_record_is_the_recipe_and_its_stop(bundled):
    info = json.loads((build_tiny_model.TINY_MODEL_DIR / build_tiny_model.BUILD_INFO_FILE).read_text())
    recipe = load_config(RECIPE)
    assert info["recipe"] == RECIPE.name and info["seed"] == recipe.seed == 0
    assert info["eval"]["samples"] == 500  # the quickstart's held-out set: its starting accuracy
    assert recipe.train.stop_at_accuracy <= info["eval"]["accuracy"] <= 0.5
    assert info["steps"] % recipe.eval.every_steps == 0  # it stopped at an eval


def test_bundled_model_answers_held_out_prompts_as_digits_then_eos(bundled_engine):
    engine, tokenizer = bundled_engine
    _, eval_rows = arithmetic_splits()
    completions = greedy_completions(engine, tokenizer, [row["prompt"] for row in eval_rows[:100]])
    texts = [tokenizer.decode(ids) for ids in completions]
    for text in texts[:32]:
        assert text.endswith("<eos>") and text[: -len("<eos>")].isdigit(), text
    correct = sum(text[: -len("<eos>")] == row["answer"] for text, row in zip(texts, eval_rows))
    assert correct > 15


def test_left_padding_does_not_change_greedy_completions(bundled_engine):
    engine, tokenizer = bundled_engine
    prompts = ["3+4", "12+7", "45+67", "9+88", "100+1"]  # different lengths, so the batch is padded
    batched = greedy_completions(engine, tokenizer, prompts)
    one_by_one = [greedy_completions(engine, tokenizer, [p])[0] for p in prompts]
    assert batched == one_by_one  # positions come from the attention mask, as for an unpadded prompt


def test_a_rebuild_says_whether_it_is_the_bundled_model(tmp_path):
    import shutil

    shutil.copy(build_tiny_model.TINY_MODEL_DIR / "model.safetensors", tmp_path / "model.safetensors")
    assert "byte for byte the bundled model's" in build_tiny_model.same_as_bundled(tmp_path)
    with open(tmp_path / "model.safetensors", "r+b") as weights:  # one byte of the last weight changed
        weights.seek(-1, 2)
        last = weights.read(1)
        weights.seek(-1, 2)
        weights.write(bytes([last[0] ^ 1]))
    assert "differ from the bundled model's (step 250, accuracy 0.354)" in build_tiny_model.same_as_bundled(tmp_path)


VL_RECIPE = RECIPE.parent / "sft_tiny_vl.yaml"


def test_the_bundled_vlm_is_its_recipe_s_stop_and_counts_about_half_right():
    from rollflow.data.prompts import PromptEncoder
    from rollflow.data.vision import load_vision_processor
    from rollflow.data.visual_tasks import visual_task_splits
    from rollflow.models import load_tokenizer, resolve_model_path

    path = resolve_model_path("tiny-vl")
    assert path == str(build_tiny_model.TINY_VL_MODEL_DIR)
    info = json.loads((build_tiny_model.TINY_VL_MODEL_DIR / build_tiny_model.BUILD_INFO_FILE).read_text())
    recipe = load_config(VL_RECIPE)
    assert info["recipe"] == VL_RECIPE.name and info["command"].endswith("--vl")
    assert recipe.train.stop_at_accuracy <= info["eval"]["accuracy"] <= 0.5 and info["eval"]["samples"] == 500
    assert info["steps"] % recipe.eval.every_steps == 0
    assert 1.1e6 < info["num_parameters"] < 1.3e6
    tokenizer = load_tokenizer(path)
    encoder = PromptEncoder(tokenizer, processor=load_vision_processor(path, tokenizer))
    rows = visual_task_splits("count_shapes")[1][:100]
    engine = create_engine("hf", model_path=path)
    greedy = SamplingParams(max_new_tokens=2, temperature=0.0)
    prompts = [encoder.encode(row) for row in rows]

    async def run():
        return await asyncio.gather(*(engine.generate(GenerationRequest(f"g{i}", p.token_ids, greedy, p.vision))
                                      for i, p in enumerate(prompts)))

    try:
        texts = [tokenizer.decode(c.outputs[0].token_ids) for c in asyncio.run(run())]
    finally:
        engine.close()
    assert all(len(text) == len("3<eos>") and text[0] in "12345" and text.endswith("<eos>") for text in texts), texts
    correct = sum(text[0] == row["answer"] for text, row in zip(texts, rows))
    assert 30 <= correct <= 65, correct  # the RL quickstart's room: 0.484 on all 500
