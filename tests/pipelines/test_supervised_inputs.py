"""Rows of the supervised pipelines get the representability check RLVR prompts get."""

import pytest

from rollflow.config import load_config
from rollflow.data.char_tokenizer import build_ascii_tokenizer
from rollflow.data.supervised import ConversationEncoder
from rollflow.errors import DataError
from rollflow.pipelines.supervised_inputs import encode_row
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
