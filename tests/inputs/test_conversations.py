"""Rows of the supervised pipelines get the representability check RLVR prompts get; the validation split
carved from the train rows (`data.validation_fraction`)."""

from types import SimpleNamespace

import pytest

from rollflow.config import load_config
from rollflow.data.char_tokenizer import build_ascii_tokenizer
from rollflow.data.supervised import ConversationEncoder
from rollflow.errors import DataError
from rollflow.inputs.conversations import EncodedDataset, carve_validation, encode_row
from tests.data.test_prompt_checks import _dropping_tokenizer

SFT = load_config(None, ["pipeline=sft", "data.train.task=add2"])
DPO = load_config(None, ["pipeline=dpo", "data.train.path=pairs.jsonl"])


def test_a_tokenizer_that_drops_a_character_of_a_response_is_a_data_error():
    row = {"prompt": "What is 1 + 1?", "response": "deux, é"}
    assert encode_row(ConversationEncoder(build_ascii_tokenizer()), row, "data.train row 3", SFT)  # bytes: kept
    with pytest.raises(DataError, match=r"^data.train row 3: the tokenizer cannot represent 'é' "):
        encode_row(ConversationEncoder(_dropping_tokenizer()), row, "data.train row 3", SFT)


def test_each_dpo_response_is_checked_against_its_own_text():
    encoder = ConversationEncoder(_dropping_tokenizer())
    chosen, rejected = encode_row(encoder, {"prompt": "1+2", "chosen": "3", "rejected": "4"}, "row 1", DPO)
    assert encoder.tokenizer.decode(rejected.response_ids) == "4<eos>"
    with pytest.raises(DataError, match="cannot represent 'ü'"):
        encode_row(encoder, {"prompt": "1+2", "chosen": "3", "rejected": "ü"}, "row 2", DPO)


def _dataset(count: int) -> EncodedDataset:
    return EncodedDataset([f"item{i}" for i in range(count)], [{"prompt": str(i)} for i in range(count)], 2, None)


def test_the_carved_split_is_seeded_disjoint_and_keeps_the_file_order():
    train, validation = carve_validation(_dataset(400), 0.1, seed=0, source=None)
    assert len(validation.items) == 40 and len(train.items) == 360
    assert not set(train.items) & set(validation.items)
    assert sorted(train.items + validation.items, key=lambda item: int(item[4:])) == _dataset(400).items
    assert train.items == sorted(train.items, key=lambda item: int(item[4:]))  # the file's order
    assert [row["prompt"] for row in validation.rows] == [item[4:] for item in validation.items]  # rows follow
    assert carve_validation(_dataset(400), 0.1, seed=0, source=None)[1].items == validation.items
    assert carve_validation(_dataset(400), 0.1, seed=1, source=None)[1].items != validation.items
    assert train.dropped == 2  # what the degenerate-row count says stays with the training part


def test_carving_all_but_nothing_is_a_data_error():
    with pytest.raises(DataError, match=r"data.train \(rows.jsonl\) has 1 rows: too few to carve data.validation_fraction=0.5"):
        carve_validation(_dataset(1), 0.5, seed=0, source=SimpleNamespace(path="rows.jsonl", task=None))
