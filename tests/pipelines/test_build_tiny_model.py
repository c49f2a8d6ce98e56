import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

from rollflow.backends import create_backend
from rollflow.backends.base import TrainerSettings
from rollflow.data.arithmetic import arithmetic_splits
from rollflow.data.char_tokenizer import build_char_tokenizer
from rollflow.data.sample import collate
from rollflow.data.supervised import encode_sft_rows, shuffled_batches
from rollflow.engines import create_engine
from rollflow.pipelines import build_tiny_model
from rollflow.pipelines.build_tiny_model import greedy_accuracy, greedy_completions
from rollflow.workers.objectives import OBJECTIVES


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def bundled():
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model.TINY_MODEL_DIR)
    return model, AutoTokenizer.from_pretrained(build_tiny_model.TINY_MODEL_DIR)


@pytest.fixture(scope="module")
def bundled_engine():
    engine = create_engine("hf", model_path=str(build_tiny_model.TINY_MODEL_DIR))
    yield engine, AutoTokenizer.from_pretrained(build_tiny_model.TINY_MODEL_DIR)
    engine.close()


def test_a_few_sft_steps_on_a_very_small_model_reduce_the_loss(tokenizer, tmp_path):
    torch.manual_seed(0)
    config = build_tiny_model.tiny_qwen2_config(tokenizer, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, num_key_value_heads=1)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    settings = TrainerSettings(model_path=str(tmp_path), lr=3e-3, weight_decay=0.01, micro_batch_size=32,
                               device="cpu")
    backend = create_backend("torch", settings)
    train_rows, _ = arithmetic_splits(num_eval=10)
    batches = shuffled_batches(encode_sft_rows(tokenizer, train_rows[:64]), batch_size=32, seed=0)
    loss_fn = OBJECTIVES["nll"]()
    losses = [
        backend.train_step(collate(next(batches), tokenizer.pad_token_id), loss_fn)["loss"] for _ in range(30)
    ]
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses
    engine = create_engine("hf", model_path=str(tmp_path))
    engine.update_weights(backend.named_weights(), version=30)
    accuracy = greedy_accuracy(engine, tokenizer, train_rows[:8], max_new_tokens=4)
    engine.close()
    assert 0.0 <= accuracy <= 1.0


def test_bundled_model_config_and_size(bundled):
    model, tokenizer = bundled
    config = model.config
    assert isinstance(model, Qwen2ForCausalLM)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (128, 4, 4)
    assert (config.num_key_value_heads, config.intermediate_size, config.max_position_embeddings) == (
        2,
        512,
        64,
    )
    assert config.tie_word_embeddings and config.vocab_size == len(tokenizer)
    assert model.dtype == torch.float32
    assert 0.9e6 < sum(p.numel() for p in model.parameters()) < 1.1e6
    assert tokenizer.padding_side == "left" and tokenizer.eos_token == "<eos>"
    info = json.loads((build_tiny_model.TINY_MODEL_DIR / build_tiny_model.BUILD_INFO_FILE).read_text())
    assert 0.30 <= info["eval"]["greedy_accuracy"] <= 0.50


def test_bundled_model_answers_held_out_prompts_as_digits_then_eos(bundled_engine):
    engine, tokenizer = bundled_engine
    _, eval_rows = arithmetic_splits()
    completions = greedy_completions(engine, tokenizer, [row["prompt"] for row in eval_rows[:32]], 4)
    for ids in completions:
        text = tokenizer.decode(ids)
        assert text.endswith("<eos>") and text[: -len("<eos>")].isdigit(), text
    assert greedy_accuracy(engine, tokenizer, eval_rows[:100], max_new_tokens=4) > 0.15


def test_left_padding_does_not_change_greedy_completions(bundled_engine):
    engine, tokenizer = bundled_engine
    prompts = ["3+4", "12+7", "45+67", "9+88", "100+1"]  # different lengths, so the batch is padded
    batched = greedy_completions(engine, tokenizer, prompts, max_new_tokens=4)
    one_by_one = [greedy_completions(engine, tokenizer, [p], max_new_tokens=4)[0] for p in prompts]
    assert batched == one_by_one  # positions come from the attention mask, as for an unpadded prompt


def test_build_cli_saves_a_loadable_model(tmp_path):
    # Target 0: no SFT step is needed, which exercises evaluation, saving and the build record quickly.
    assert build_tiny_model.main(["--out", str(tmp_path), "--target-accuracy", "0"]) == 0
    info = json.loads((tmp_path / build_tiny_model.BUILD_INFO_FILE).read_text())
    assert info["steps"] == 0 and info["num_parameters"] > 0
    assert (info["sft"]["backend"], info["sft"]["objective"]) == ("torch", "nll")
    assert sorted(path.name for path in tmp_path.iterdir() if path.suffix == ".pt") == []  # no optimizer state
    AutoModelForCausalLM.from_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    engine = create_engine("hf", model_path=str(tmp_path))
    assert greedy_accuracy(engine, tokenizer, [{"prompt": "1+2", "answer": "3"}], max_new_tokens=4) >= 0
    engine.close()


def test_build_cli_fails_when_the_target_is_not_reached(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--target-accuracy", "1.1", "--max-steps", "1", "--eval-every", "1"]
    assert build_tiny_model.main(argv) == 1
    assert "after 1 steps" in capsys.readouterr().err
    assert not (tmp_path / build_tiny_model.BUILD_INFO_FILE).exists()
