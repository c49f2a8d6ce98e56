import json

import pytest

from rollflow.data.arithmetic import arithmetic_splits
from rollflow.data.char_tokenizer import build_char_tokenizer
from rollflow.data.prompts import PromptEncoder, PromptSampler, load_rows
from rollflow.errors import DataError


def test_builtin_task_splits_are_fixed_and_disjoint():
    train = load_rows(task="add2", split="train")
    held_out = load_rows(task="add2", split="eval")
    assert held_out == arithmetic_splits("add2", seed=0)[1]  # the fixed split: no run seed can move it
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert len(load_rows(task="add2", split="eval", limit=7)) == 7


def test_jsonl_rows_keep_extra_columns(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "answer": "1", "level": 3}) + "\n\n")
    assert load_rows(path=str(path)) == [{"prompt": "hi", "answer": "1", "level": 3}]


@pytest.mark.parametrize("content, message", [
    ('{"question": "x"}\n', "no 'prompt' column"),
    ('{"prompt": "x"}\nnot json\n', "d.jsonl:2: not valid JSON"),
    ('[1, 2]\n', "JSON object"),
    ('', "no rows"),
])
def test_bad_jsonl_gives_clear_errors(tmp_path, content, message):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        load_rows(path=str(path))


def test_missing_file_and_unknown_task():
    with pytest.raises(DataError, match="not found"):
        load_rows(path="/nonexistent/d.jsonl")
    with pytest.raises(DataError, match="unknown arithmetic task"):
        load_rows(task="add3")


def test_encoder_applies_chat_template_and_checks_length():
    tokenizer = build_char_tokenizer()
    encoded = PromptEncoder(tokenizer).encode({"prompt": "12+3"})
    assert encoded.text == "<|user|>12+3<|assistant|>"
    assert tokenizer.decode(encoded.token_ids) == encoded.text
    raw = PromptEncoder(tokenizer, apply_chat_template=False).encode({"prompt": "12+3"})
    assert raw.text == "12+3" and len(raw.token_ids) == 4
    with pytest.raises(DataError, match="max_prompt_tokens"):
        PromptEncoder(tokenizer, max_prompt_tokens=3).encode({"prompt": "12+3"})


def test_sampler_is_deterministic_and_resumes_exactly():
    rows = [{"prompt": str(i)} for i in range(10)]
    first = PromptSampler(rows, batch_size=4, seed=1)
    batches = [first.next_batch() for _ in range(3)]  # crosses an epoch boundary (12 > 10)
    assert sorted(r["prompt"] for r in batches[0] + batches[1][:1] + batches[1][1:] + batches[2][:2]) == sorted(
        r["prompt"] for r in rows)
    again = PromptSampler(rows, batch_size=4, seed=1)
    again.next_batch()
    state = again.state()
    resumed = PromptSampler(rows, batch_size=4, seed=1)
    resumed.load_state(state)
    assert [resumed.next_batch(), resumed.next_batch()] == batches[1:]


def test_answer_key_is_exposed_as_answer(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "1+1", "solution": "2"}) + "\n")
    assert load_rows(path=str(path), answer_key="solution") == [{"prompt": "1+1", "solution": "2", "answer": "2"}]


def test_a_binary_or_directory_dataset_is_one_clear_error(tmp_path):
    binary = tmp_path / "d.jsonl"
    binary.write_bytes(b'{"prompt": "1+1"}\n\x89PNG\r\n\x1a\n\x00\x00')
    with pytest.raises(DataError, match=r"d\.jsonl:2: not UTF-8 text \(byte 0x89\)"):
        load_rows(path=str(binary))
    with pytest.raises(DataError, match="it is a directory"):
        load_rows(path=str(tmp_path))


def test_sampler_order_depends_on_seed_and_epoch_only():
    rows = list(range(20))
    first, second = PromptSampler(rows, 20, seed=0), PromptSampler(rows, 20, seed=1)
    assert first.next_batch() != second.next_batch()
    assert PromptSampler(rows, 20, seed=2**64 - 1).next_batch() != rows  # a 64-bit seed shuffles too
    # encoded prompts sample like rows: the sampler only orders what it is given
    encoded = [PromptEncoder(build_char_tokenizer()).encode({"prompt": f"{i}+1"}) for i in range(5)]
    sampled = PromptSampler(encoded, 5, seed=3).next_batch()
    assert sorted(p.text for p in sampled) == sorted(p.text for p in encoded)
