import json
import random
from fractions import Fraction

import pytest

from rollflow.data.arithmetic import arithmetic_splits
from rollflow.data.char_tokenizer import build_ascii_tokenizer
from rollflow.data.prompts import DomainSampler, PromptEncoder, PromptSampler, load_rows
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
    tokenizer = build_ascii_tokenizer()
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
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="dataset directory .*empty is empty"):
        load_rows(path=str(empty))


def test_sampler_order_depends_on_seed_and_epoch_only():
    rows = list(range(20))
    first, second = PromptSampler(rows, 20, seed=0), PromptSampler(rows, 20, seed=1)
    assert first.next_batch() != second.next_batch()
    assert PromptSampler(rows, 20, seed=2**64 - 1).next_batch() != rows  # a 64-bit seed shuffles too
    # encoded prompts sample like rows: the sampler only orders what it is given
    encoded = [PromptEncoder(build_ascii_tokenizer()).encode({"prompt": f"{i}+1"}) for i in range(5)]
    sampled = PromptSampler(encoded, 5, seed=3).next_batch()
    assert sorted(p.text for p in sampled) == sorted(p.text for p in encoded)


def test_take_continues_the_order_and_next_batch_is_take_of_batch_size():
    rows = list(range(7))
    whole = PromptSampler(rows, batch_size=4, seed=5).take(20)  # crosses two epoch boundaries
    pieces = PromptSampler(rows, batch_size=4, seed=5)
    assert pieces.take(3) + pieces.take(1) + pieces.next_batch() + pieces.take(12) == whole
    assert pieces.take(0) == []
    # resuming after an odd take continues the same order
    first = PromptSampler(rows, batch_size=4, seed=5)
    first.take(9)
    resumed = PromptSampler(rows, batch_size=4, seed=5)
    resumed.load_state(first.state())
    assert resumed.take(11) == whole[9:]


def _domains(shares: dict[str, Fraction], batch_size: int, seed: int = 0, rows: int = 5) -> DomainSampler:
    """A `DomainSampler` whose domain `d` holds the rows `d0`, `d1`, ... (its own seed per domain)."""
    samplers = {name: PromptSampler([f"{name}{i}" for i in range(rows)], batch_size, seed=seed + index)
                for index, name in enumerate(shares)}
    return DomainSampler(samplers, shares, batch_size)


def _domain(row: str) -> str:
    return row.rstrip("0123456789")


def test_domain_sampler_batches_hold_each_share_exactly_when_it_is_whole():
    # shares 1/2, 3/8, 1/8 of 8 prompts: 4, 3 and 1 of each, in every batch and every window of 8
    shares = {"a": Fraction(1, 2), "b": Fraction(3, 8), "c": Fraction(1, 8)}
    sampler = _domains(shares, batch_size=8)
    for _ in range(5):
        batch = [_domain(row) for row in sampler.next_batch()]
        assert (batch.count("a"), batch.count("b"), batch.count("c")) == (4, 3, 1)
    stream = [_domain(row) for row in _domains(shares, batch_size=8).take(80)]
    for start in range(0, 73):  # a `take(k)` anywhere, then batches: still exact
        window = stream[start:start + 8]
        assert (window.count("a"), window.count("b"), window.count("c")) == (4, 3, 1)
    # prompt n comes from the domain with the largest (n + 1) * share - taken: n = 0: a (0.5); n = 1: b (0.75);
    # n = 2: a (0.5); n = 3: b and c tie at 0.5, the first wins; n = 4: c (0.625); n = 5: a; n = 6: b; n = 7: a
    assert stream[:8] == ["a", "b", "a", "b", "c", "a", "b", "a"]


def test_domain_sampler_stays_within_one_prompt_of_every_share():
    rng = random.Random(0)
    for _ in range(50):
        weights = [rng.randint(1, 9) for _ in range(rng.randint(1, 4))]
        shares = {f"d{i}x": Fraction(w, sum(weights)) for i, w in enumerate(weights)}
        stream = [_domain(row) for row in _domains(shares, batch_size=7).take(300)]
        for name, share in shares.items():
            taken = 0
            for n, domain in enumerate(stream, start=1):
                taken += domain == name
                assert abs(taken - n * share) < 1, (shares, name, n)


def test_domain_sampler_take_continues_the_schedule_and_resumes_exactly():
    shares = {"a": Fraction(2, 3), "b": Fraction(1, 3)}
    whole = _domains(shares, batch_size=6).take(40)  # several epochs of each domain's 5 rows
    pieces = _domains(shares, batch_size=6)
    assert pieces.take(1) + pieces.next_batch() + pieces.take(4) + pieces.take(29) == whole
    first = _domains(shares, batch_size=6)
    first.take(13)
    state = json.loads(json.dumps(first.state()))  # what a checkpoint keeps
    resumed = _domains(shares, batch_size=6)
    resumed.load_state(state)
    assert resumed.take(27) == whole[13:]
    # each domain walks its own rows in its own shuffled epochs: every row once per epoch
    a_rows = [row for row in whole if row.startswith("a")]
    assert sorted(a_rows[:5]) == sorted(a_rows[5:10]) == [f"a{i}" for i in range(5)]


def test_domain_sampler_refuses_other_domains_state():
    shares = {"a": Fraction(1, 2), "b": Fraction(1, 2)}
    sampler = _domains(shares, batch_size=2)
    with pytest.raises(DataError, match="domains a, c, not of data.domains"):
        sampler.load_state({"domains": {"a": {"epoch": 0, "position": 0, "taken": 0},
                                        "c": {"epoch": 0, "position": 0, "taken": 0}}})
    with pytest.raises(DataError, match="single-dataset run"):
        sampler.load_state({"epoch": 0, "position": 3})
    with pytest.raises(DataError, match="this run has one dataset"):
        PromptSampler(list(range(3)), 2).load_state(sampler.state())
    with pytest.raises(ValueError, match="sum to 1"):
        DomainSampler(sampler.samplers, {"a": Fraction(1, 2), "b": Fraction(1, 3)}, 2)
