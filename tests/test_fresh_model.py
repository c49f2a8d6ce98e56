"""`rollflow.fresh_model` and `rollflow new-model`: a random small Qwen2 with the ASCII tokenizer that
`rollflow.models`, `generate` and the hf engine load like any other model."""

import asyncio

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rollflow.cli import main
from rollflow.data.char_tokenizer import build_ascii_tokenizer
from rollflow.data.supervised import chat_prompt_ids
from rollflow.engines import create_engine
from rollflow.engines.base import GenerationRequest, SamplingParams
from rollflow.errors import ConfigError
from rollflow.fresh_model import fresh_qwen2_config, save_fresh_model
from rollflow.models import load_causal_lm, load_tokenizer

SMALL = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64}


@pytest.fixture(scope="module")
def fresh_model(tmp_path_factory):
    """The default-size model: (directory, parameter count)."""
    path = tmp_path_factory.mktemp("fresh") / "model"
    return str(path), save_fresh_model(path, seed=0)


def test_default_sizes_give_about_a_million_parameters(fresh_model):
    path, num_params = fresh_model
    assert 1_000_000 <= num_params <= 5_000_000
    model = load_causal_lm(path)
    assert sum(parameter.numel() for parameter in model.parameters()) == num_params


def test_config_follows_the_tokenizer_and_the_tiny_model_architecture():
    tokenizer = build_ascii_tokenizer()
    config = fresh_qwen2_config(tokenizer)
    assert (config.vocab_size, config.pad_token_id, config.eos_token_id, config.bos_token_id) == (262, 0, 1, None)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size, config.max_position_embeddings) == (
        128, 4, 4, 2, 512, 256)
    assert config.tie_word_embeddings
    assert config.dtype in ("float32", torch.float32)


def test_rollflow_models_load_it_and_it_generates_greedily(fresh_model):
    path, _ = fresh_model
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path)
    assert isinstance(model, Qwen2ForCausalLM)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, len(tokenizer)) == (0, 1, 262)
    assert tokenizer.model_max_length == 256
    assert (model.generation_config.pad_token_id, model.generation_config.eos_token_id) == (0, 1)
    assert tokenizer.decode(tokenizer.encode("What is 7 * 8?\n")) == "What is 7 * 8?\n"

    prompt = torch.tensor([chat_prompt_ids(tokenizer, "What is 7 * 8?")])
    output = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    assert output.shape[0] == 1 and prompt.shape[1] < output.shape[1] <= prompt.shape[1] + 4
    assert torch.equal(output[0, :prompt.shape[1]], prompt[0])
    assert int(output.max()) < len(tokenizer)


def test_the_hf_engine_serves_it(fresh_model):
    path, _ = fresh_model
    engine = create_engine("hf", model_path=path, seed=0, device="cpu")
    try:
        prompt_ids = chat_prompt_ids(load_tokenizer(path), "1 + 2")
        request = GenerationRequest("r0", prompt_ids, SamplingParams(max_new_tokens=3, temperature=0.0))
        completion = asyncio.run(engine.generate(request))
    finally:
        engine.close()
    assert 1 <= len(completion.outputs[0].token_ids) <= 3
    assert len(completion.outputs[0].logprobs) == len(completion.outputs[0].token_ids)


def test_weights_depend_on_the_seed_alone_and_leave_the_global_rng_alone(tmp_path):
    state = torch.get_rng_state()
    save_fresh_model(tmp_path / "a", seed=3, **SMALL)
    assert torch.equal(torch.get_rng_state(), state)
    save_fresh_model(tmp_path / "b", seed=3, **SMALL)
    save_fresh_model(tmp_path / "c", seed=4, **SMALL)
    a, b, c = (load_causal_lm(str(tmp_path / name)).state_dict() for name in "abc")
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert not all(torch.equal(a[name], c[name]) for name in a)


def test_an_existing_empty_directory_is_used(tmp_path):
    assert save_fresh_model(tmp_path, **SMALL) > 0
    assert (tmp_path / "config.json").is_file() and (tmp_path / "tokenizer.json").is_file()


def test_refuses_a_non_empty_directory_or_a_file(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not empty"):
        save_fresh_model(tmp_path, **SMALL)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    with pytest.raises(ConfigError, match="is a file"):
        save_fresh_model(tmp_path / "notes.txt", **SMALL)


@pytest.mark.parametrize("sizes, message", [
    ({"hidden_size": 0}, "hidden_size must be a positive integer"),
    ({"num_layers": -1}, "num_layers must be a positive integer"),
    ({"max_positions": 2.5}, "max_positions must be a positive integer"),
    ({"hidden_size": 130}, "not divisible by num_heads 4"),
    ({"num_heads": 4, "num_kv_heads": 3}, "not divisible by num_kv_heads 3"),
    ({"hidden_size": 12, "num_heads": 4}, "head size .* is odd"),
])
def test_bad_sizes_are_refused_before_anything_is_written(tmp_path, sizes, message):
    with pytest.raises(ConfigError, match=message):
        save_fresh_model(tmp_path / "model", **sizes)
    assert not (tmp_path / "model").exists()


def test_cli_creates_the_model_and_refuses_a_non_empty_directory(tmp_path, capsys):
    out = tmp_path / "model"
    argv = ["new-model", "--out", str(out), "--seed", "1", "--hidden-size", "32", "--layers", "1", "--heads", "2",
            "--kv-heads", "1", "--intermediate-size", "64", "--max-positions", "64"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "parameters: " in printed
    assert load_causal_lm(str(out)).config.max_position_embeddings == 64
    assert load_tokenizer(str(out)).model_max_length == 64

    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "not empty" in error


@pytest.mark.parametrize("flags, message", [
    (["--layers", "0"], "num_layers must be a positive integer"),
    (["--hidden-size", "130"], "not divisible by num_heads"),
])
def test_cli_bad_sizes_are_one_line_and_exit_2(tmp_path, capsys, flags, message):
    assert main(["new-model", "--out", str(tmp_path / "model"), *flags]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message in error
    assert not (tmp_path / "model").exists()


def test_cli_vl_rope_theta_sets_the_language_models_rotary_base(tmp_path, capsys):
    small = ["--hidden-size", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--intermediate-size", "64"]
    assert main(["new-model", "--vl", "--out", str(tmp_path / "theta"), "--rope-theta", "100", *small]) == 0
    assert main(["new-model", "--vl", "--out", str(tmp_path / "default"), *small]) == 0
    capsys.readouterr()
    thetas = {}
    for name in ("theta", "default"):
        model = load_causal_lm(str(tmp_path / name))
        thetas[name] = model.config.text_config.rope_parameters["rope_theta"]
        # The rotary base reaches the rotary embedding itself, not only the config.
        inv_freq = model.model.language_model.rotary_emb.inv_freq
        assert inv_freq[-1].item() == pytest.approx(thetas[name] ** (-(len(inv_freq) - 1) / len(inv_freq)), rel=1e-4)
    assert thetas == {"theta": 100.0, "default": 1e6}


@pytest.mark.parametrize("flags, message", [
    (["--rope-theta", "100"], "--rope-theta is for --vl models"),
    (["--vl", "--rope-theta", "0"], "rope_theta must be a positive, finite number, got 0.0"),
    (["--vl", "--rope-theta", "nan"], "rope_theta must be a positive, finite number, got nan"),
])
def test_cli_rope_theta_misuse_is_one_line_and_exit_2(tmp_path, capsys, flags, message):
    assert main(["new-model", "--out", str(tmp_path / "model"), *flags]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message in error
    assert not (tmp_path / "model").exists()
