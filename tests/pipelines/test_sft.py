import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

from rollflow.data.arithmetic import arithmetic_splits
from rollflow.data.char_tokenizer import build_char_tokenizer
from rollflow.pipelines import build_tiny_model
from rollflow.pipelines.sft import (
    SFTExample,
    collate_sft,
    encode_sft_example,
    encode_sft_rows,
    greedy_accuracy,
    greedy_completions,
    sft_loss,
    sft_train_step,
    shuffled_batches,
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Small ops slow down ~100x with oversubscribed threads on a shared 2-core machine.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def bundled():
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model.TINY_MODEL_DIR)
    return model, AutoTokenizer.from_pretrained(build_tiny_model.TINY_MODEL_DIR)


def test_loss_mask_covers_only_the_answer_and_eos(tokenizer):
    example = encode_sft_example(tokenizer, "23+58", "81")
    tokens = tokenizer.convert_ids_to_tokens(example.input_ids)
    assert tokens == ["<|user|>", "2", "3", "+", "5", "8", "<|assistant|>", "8", "1", "<eos>"]
    assert example.loss_mask == [0, 0, 0, 0, 0, 0, 0, 1, 1, 1]


def test_collate_right_pads_to_the_longest_example():
    examples = [SFTExample([5, 6, 7], [0, 1, 1]), SFTExample([8, 9], [0, 1])]
    batch = collate_sft(examples, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [0, 1, 0]]


def test_sft_loss_hand_computed():
    # B=2, T=3, V=2. Position t predicts token t+1; only targets with loss_mask 1 count.
    # Row 0: logits[0,0] = [0, ln 3] -> p(token 1) = 3/4; target 1, mask 1 -> nll = ln(4/3).
    #        logits[0,1] = [0, 0]    -> p = 1/2;            target 0, mask 1 -> nll = ln 2.
    # Row 1: logits[1,0] = [ln 3, 0] -> p(token 0) = 3/4;  target 0, mask 1 -> nll = ln(4/3).
    #        position 1's target is masked out.
    # Loss = (2 ln(4/3) + ln 2) / 3.
    logits = torch.tensor(
        [[[0.0, math.log(3)], [0.0, 0.0], [5.0, -5.0]], [[math.log(3), 0.0], [9.0, -9.0], [0.0, 0.0]]]
    )
    input_ids = torch.tensor([[0, 1, 0], [1, 0, 1]])
    loss_mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    expected = (2 * math.log(4 / 3) + math.log(2)) / 3
    assert sft_loss(logits, input_ids, loss_mask).item() == pytest.approx(expected, rel=1e-6)

    # The same sum as a plain loop over every (row, position).
    total, count = 0.0, 0
    for b in range(2):
        for t in range(2):
            if loss_mask[b, t + 1]:
                total -= torch.log_softmax(logits[b, t], dim=-1)[input_ids[b, t + 1]].item()
                count += 1
    assert sft_loss(logits, input_ids, loss_mask).item() == pytest.approx(total / count, rel=1e-6)


def test_shuffled_batches_are_full_deterministic_and_cover_each_epoch():
    examples = [SFTExample([index], [1]) for index in range(10)]
    first = shuffled_batches(examples, batch_size=3, seed=0)
    epoch = [next(first) for _ in range(3)]  # 10 // 3 = 3 full batches per epoch, 1 example dropped
    seen = [example.input_ids[0] for batch in epoch for example in batch]
    assert all(len(batch) == 3 for batch in epoch) and len(set(seen)) == 9
    again = shuffled_batches(examples, batch_size=3, seed=0)
    assert [next(again) for _ in range(3)] == epoch
    with pytest.raises(ValueError, match="batch_size"):
        next(shuffled_batches(examples, batch_size=11, seed=0))


def test_a_few_sft_steps_on_a_very_small_model_reduce_the_loss(tokenizer):
    torch.manual_seed(0)
    config = build_tiny_model.tiny_qwen2_config(tokenizer, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, num_key_value_heads=1)
    model = Qwen2ForCausalLM(config)
    train_rows, _ = arithmetic_splits(num_eval=10)
    examples = encode_sft_rows(tokenizer, train_rows[:64])
    batches = shuffled_batches(examples, batch_size=32, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = [
        sft_train_step(model, optimizer, collate_sft(next(batches), tokenizer.pad_token_id))["loss"]
        for _ in range(30)
    ]
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses
    accuracy = greedy_accuracy(model, tokenizer, train_rows[:8], batch_size=4, max_new_tokens=4)
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


def test_bundled_model_answers_held_out_prompts_as_digits_then_eos(bundled):
    model, tokenizer = bundled
    _, eval_rows = arithmetic_splits()
    completions = greedy_completions(model, tokenizer, [row["prompt"] for row in eval_rows[:32]], 32, 4)
    for ids in completions:
        text = tokenizer.decode(ids)
        assert text.endswith("<eos>") and text[: -len("<eos>")].isdigit(), text
    assert greedy_accuracy(model, tokenizer, eval_rows[:100], batch_size=100, max_new_tokens=4) > 0.15


def test_left_padding_does_not_change_greedy_completions(bundled):
    model, tokenizer = bundled
    prompts = ["3+4", "12+7", "45+67", "9+88", "100+1"]  # different lengths, so the batch is padded
    batched = greedy_completions(model, tokenizer, prompts, batch_size=len(prompts), max_new_tokens=4)
    one_by_one = [
        greedy_completions(model, tokenizer, [p], batch_size=1, max_new_tokens=4)[0] for p in prompts
    ]
    assert batched == one_by_one  # positions come from the attention mask, as for an unpadded prompt


def test_build_cli_saves_a_loadable_model(tmp_path):
    # Target 0: no SFT step is needed, which exercises evaluation, saving and the build record quickly.
    assert build_tiny_model.main(["--out", str(tmp_path), "--target-accuracy", "0"]) == 0
    info = json.loads((tmp_path / build_tiny_model.BUILD_INFO_FILE).read_text())
    assert info["steps"] == 0 and info["num_parameters"] > 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert (
        greedy_accuracy(model, tokenizer, [{"prompt": "1+2", "answer": "3"}], batch_size=1, max_new_tokens=4)
        >= 0
    )


def test_build_cli_fails_when_the_target_is_not_reached(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--target-accuracy", "1.1", "--max-steps", "1", "--eval-every", "1"]
    assert build_tiny_model.main(argv) == 1
    assert "after 1 steps" in capsys.readouterr().err
    assert not (tmp_path / build_tiny_model.BUILD_INFO_FILE).exists()
