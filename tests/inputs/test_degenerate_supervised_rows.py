"""Supervised rows that train on nothing or teach the model to answer nothing (issue #26) are one line naming
the dataset and row, or with `data.drop_degenerate_rows` are dropped with one warning a dataset: a DPO pair
whose chosen and rejected are the same tokens (loss constant, gradient 0), an empty chosen or rejected, an
empty SFT / distillation response, a chat whose assistant turns are all empty, and whitespace the template
turns into no token. Whitespace that does become tokens is a real response, and a real difference."""

from __future__ import annotations

import json

import pytest

from rollflow.cli import EXIT_USER_ERROR
from rollflow.config import load_config
from rollflow.data.char_tokenizer import ASCII_CHAT_TEMPLATE, build_ascii_tokenizer
from rollflow.data.supervised import ConversationEncoder
from rollflow.errors import DataError
from rollflow.inputs.conversations import encode_dataset, encode_row, load_supervised_inputs

SOURCE = "data.train (DIR/d.jsonl)"
WHERE = f"{SOURCE} row 3"
SFT = load_config(None, ["pipeline=sft", "data.train.task=add2"])
DPO = load_config(None, ["pipeline=dpo", "data.train.path=pairs.jsonl"])
DISTILL = load_config(None, ["pipeline=distill", "data.train.task=add2", "roles.reference.model_path=tiny"])
DROPPING_DPO = load_config(None, ["pipeline=dpo", "data.train.path=pairs.jsonl", "data.drop_degenerate_rows=true"])
PAIR_MUST_DIFFER = "a pair must differ (DPO learns nothing from it)"
NON_EMPTY_PAIR = "a pair needs two non-empty responses"
ANSWERS_NOTHING = "training on it teaches the model to answer nothing"


@pytest.fixture(scope="module")
def encoder():
    return ConversationEncoder(build_ascii_tokenizer())


@pytest.fixture(scope="module")
def trimming_encoder():
    """The ASCII tokenizer with a template that trims each turn's content, as many real templates do (Llama 3's,
    for one): whitespace around a response, or a response of only whitespace, renders as no token."""
    tokenizer = build_ascii_tokenizer()
    tokenizer.chat_template = ASCII_CHAT_TEMPLATE.replace("message['content']", "(message['content'] | trim)")
    return ConversationEncoder(tokenizer)


def _error(encoder, row, config) -> str:
    with pytest.raises(DataError) as raised:
        encode_row(encoder, row, WHERE, config)
    return str(raised.value)


# ---- DPO pairs ----------------------------------------------------------------------------------------------

def test_a_pair_whose_chosen_is_its_rejected_is_refused(encoder):
    message = _error(encoder, {"prompt": "1+2", "chosen": "3", "rejected": "3"}, DPO)
    assert message == f"{WHERE}: chosen and rejected are the same text; {PAIR_MUST_DIFFER}"


def test_a_pair_of_texts_that_encode_to_the_same_tokens_is_refused(trimming_encoder):
    # the template trims "3 " to "3": the two rows the model sees are one and the same
    message = _error(trimming_encoder, {"prompt": "1+2", "chosen": "3", "rejected": "3 "}, DPO)
    assert message == f"{WHERE}: chosen and rejected encode to the same tokens ('3' and '3 '); {PAIR_MUST_DIFFER}"


def test_a_pair_that_differs_in_whitespace_the_tokenizer_keeps_is_a_real_pair(encoder):
    chosen, rejected = encode_row(encoder, {"prompt": "1+2", "chosen": "3", "rejected": " 3"}, WHERE, DPO)
    assert chosen.response_ids != rejected.response_ids  # ' 3' is two tokens, '3' one: the loss is not constant


def test_an_empty_chosen_is_refused(encoder):
    message = _error(encoder, {"prompt": "1+2", "chosen": "", "rejected": "4"}, DPO)
    assert message == f"{WHERE}: the chosen response (column 'chosen') is empty; {NON_EMPTY_PAIR}"


def test_an_empty_rejected_is_refused(encoder):
    message = _error(encoder, {"prompt": "1+2", "chosen": "3", "rejected": ""}, DPO)
    assert message == f"{WHERE}: the rejected response (column 'rejected') is empty; {NON_EMPTY_PAIR}"


def test_a_rejected_of_whitespace_the_template_drops_is_refused(trimming_encoder):
    message = _error(trimming_encoder, {"prompt": "1+2", "chosen": "3", "rejected": " \n"}, DPO)
    assert message == (f"{WHERE}: the rejected response (column 'rejected') is only whitespace (' \\n'), which "
                       f"encodes to no token; {NON_EMPTY_PAIR}")


def test_the_columns_named_are_the_configured_ones(encoder):
    config = load_config(None, ["pipeline=dpo", "data.train.path=p.jsonl", "data.chosen_key=good",
                                "data.rejected_key=bad"])
    message = _error(encoder, {"prompt": "1+2", "good": "3", "bad": ""}, config)
    assert message == f"{WHERE}: the rejected response (column 'bad') is empty; {NON_EMPTY_PAIR}"


# ---- SFT and distillation rows ------------------------------------------------------------------------------

def test_an_empty_sft_response_is_refused(encoder):
    message = _error(encoder, {"prompt": "1+2", "response": ""}, SFT)
    assert message == f"{WHERE}: the response (column 'response') is empty; {ANSWERS_NOTHING}"


def test_an_empty_distillation_response_is_refused(encoder):
    message = _error(encoder, {"prompt": "1+2", "response": ""}, DISTILL)
    assert message == f"{WHERE}: the response (column 'response') is empty; {ANSWERS_NOTHING}"


def test_a_response_of_whitespace_the_template_drops_is_refused(trimming_encoder):
    message = _error(trimming_encoder, {"prompt": "1+2", "response": "   "}, SFT)
    assert message == (f"{WHERE}: the response (column 'response') is only whitespace ('   '), which encodes to "
                       f"no token; {ANSWERS_NOTHING}")


def test_whitespace_a_tokenizer_drops_is_refused_without_a_template_too():
    class DroppingSpaces:  # a tokenizer with no token for a space (no chat template: text, response, EOS)
        chat_template = None
        eos_token_id = 0
        unk_token_id = None

        def encode(self, text, add_special_tokens=False):
            return [ord(character) for character in text if not character.isspace()]

        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(token) for token in ids if token)

    message = _error(ConversationEncoder(DroppingSpaces()), {"prompt": "1+2", "response": "\t"}, SFT)
    assert message == (f"{WHERE}: the response (column 'response') is only whitespace ('\\t'), which encodes to "
                       f"no token; {ANSWERS_NOTHING}")


def test_a_response_of_whitespace_that_becomes_tokens_is_a_response(encoder):
    sample = encode_row(encoder, {"prompt": "1+2", "response": " "}, WHERE, SFT)
    assert encoder.tokenizer.decode(sample.response_ids) == " <eos>"  # the ASCII tokenizer keeps the space


def test_a_chat_whose_assistant_turns_are_all_empty_is_refused(encoder):
    chat = [{"role": "user", "content": "1+2"}, {"role": "assistant", "content": ""},
            {"role": "user", "content": "and 2+2?"}, {"role": "assistant", "content": ""}]
    message = _error(encoder, {"messages": chat}, SFT)
    assert message == f"{WHERE}: every assistant turn (column 'messages') is empty; {ANSWERS_NOTHING}"


def test_a_chat_of_blank_assistant_turns_is_refused(trimming_encoder):
    chat = [{"role": "user", "content": "1+2"}, {"role": "assistant", "content": " "}]
    message = _error(trimming_encoder, {"messages": chat}, SFT)
    assert message == (f"{WHERE}: every assistant turn (column 'messages') is empty or only whitespace, which "
                       f"encodes to no token; {ANSWERS_NOTHING}")


def test_a_chat_with_one_answered_turn_trains_on_it(encoder):
    chat = [{"role": "user", "content": "1+2"}, {"role": "assistant", "content": ""},
            {"role": "user", "content": "and 2+2?"}, {"role": "assistant", "content": "4"}]
    assert encode_row(encoder, {"messages": chat}, WHERE, SFT).loss_mask.count(1) == 3  # <eos>, 4, <eos>


def test_only_the_response_of_a_prompt_of_turns_counts(encoder):
    # an earlier assistant turn of the prompt is context: an empty response is still empty
    prompt = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"},
              {"role": "user", "content": "1+2"}]
    message = _error(encoder, {"prompt": prompt, "response": ""}, SFT)
    assert message == f"{WHERE}: the response (column 'response') is empty; {ANSWERS_NOTHING}"


# ---- a dataset: refused at the first degenerate row, or its degenerate rows dropped -------------------------

PAIRS = [{"prompt": f"{n}+1", "chosen": str(n + 1), "rejected": str(n + 2)} for n in range(5)]


def test_without_the_setting_the_first_degenerate_row_stops_the_run(encoder):
    rows = PAIRS[:2] + [{"prompt": "1+1", "chosen": "2", "rejected": "2"}, {"prompt": "1+1", "chosen": "",
                                                                             "rejected": "2"}]
    with pytest.raises(DataError) as raised:
        encode_dataset(encoder, rows, SOURCE, DPO)
    assert str(raised.value) == f"{SOURCE} row 3: chosen and rejected are the same text; {PAIR_MUST_DIFFER}"


def test_the_setting_drops_degenerate_rows_with_one_warning_that_counts_them(encoder):
    same = {"prompt": "1+1", "chosen": "2", "rejected": "2"}
    empty = {"prompt": "1+1", "chosen": "", "rejected": "2"}
    rows = [PAIRS[0], same, PAIRS[1], empty, PAIRS[2], same]
    kept = encode_dataset(encoder, rows, SOURCE, DROPPING_DPO)
    assert kept.warning == (f"{SOURCE}: dropped 3 of 6 degenerate rows, as data.drop_degenerate_rows says "
                            "(first: row 2: chosen and rejected are the same text)")
    assert kept.dropped == 3 and kept.rows == PAIRS[:3] and len(kept.items) == 3
    assert [encoder.tokenizer.decode(chosen.response_ids) for chosen, _ in kept.items] == ["1<eos>", "2<eos>",
                                                                                          "3<eos>"]


def test_the_setting_drops_nothing_from_good_data(encoder):
    kept = encode_dataset(encoder, PAIRS, SOURCE, DROPPING_DPO)
    assert (kept.warning, kept.dropped, kept.rows) == (None, 0, PAIRS)


def test_the_setting_never_drops_a_malformed_row(encoder):
    with pytest.raises(DataError, match=r"row 2: a preference row needs a string 'rejected' column"):
        encode_dataset(encoder, [PAIRS[0], {"prompt": "1+1", "chosen": "2"}], SOURCE, DROPPING_DPO)


def test_a_dataset_of_only_degenerate_rows_is_an_error_even_when_dropping(encoder):
    rows = [{"prompt": "1+1", "chosen": "2", "rejected": ""}, {"prompt": "1+2", "chosen": "3", "rejected": "3"}]
    with pytest.raises(DataError) as raised:
        encode_dataset(encoder, rows, SOURCE, DROPPING_DPO)
    assert str(raised.value) == (f"{SOURCE}: all 2 rows are degenerate (first: row 1: the rejected response "
                                 "(column 'rejected') is empty); data.drop_degenerate_rows would leave none")


# ---- the driver's check: train and eval sets, the batch size after drops ------------------------------------

def _sft_files(tmp_path, train: list[dict], eval_rows: list[dict] | None, *overrides: str):
    for name, rows in (("train.jsonl", train), ("eval.jsonl", eval_rows)):
        if rows is not None:
            (tmp_path / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    eval_set = f"data.eval={{path: '{tmp_path}/eval.jsonl'}}" if eval_rows is not None else "data.eval=null"
    return load_config(None, ["pipeline=sft", "model.path=tiny", f"data.train={{path: '{tmp_path}/train.jsonl'}}",
                              eval_set, "train.batch_size=2", f"output.dir={tmp_path}/runs", *overrides])


GOOD = [{"prompt": f"{n}+1", "response": str(n + 1)} for n in range(3)]


def test_an_eval_set_gets_the_same_check(tmp_path):
    config = _sft_files(tmp_path, GOOD, [GOOD[0], {"prompt": "1+1", "response": ""}])
    with pytest.raises(DataError) as raised:
        load_supervised_inputs(config, ["actor_train"])
    assert str(raised.value) == (f"data.eval ({tmp_path}/eval.jsonl) row 2: the response (column 'response') is "
                                 f"empty; {ANSWERS_NOTHING}")


def test_dropping_warns_once_per_dataset_and_keeps_the_rest(tmp_path):
    blank = {"prompt": "1+1", "response": ""}
    config = _sft_files(tmp_path, [*GOOD, blank], [blank, GOOD[0], blank], "data.drop_degenerate_rows=true")
    inputs = load_supervised_inputs(config, ["actor_train"])
    assert (len(inputs.train), len(inputs.eval)) == (3, 1)
    first = "row 4: the response (column 'response') is empty"
    assert inputs.warnings[:2] == [
        f"data.train ({tmp_path}/train.jsonl): dropped 1 of 4 degenerate rows, as data.drop_degenerate_rows says "
        f"(first: {first})",
        f"data.eval ({tmp_path}/eval.jsonl): dropped 2 of 3 degenerate rows, as data.drop_degenerate_rows says "
        "(first: row 1: the response (column 'response') is empty)"]


def test_rows_left_fewer_than_a_batch_say_how_many_were_dropped(tmp_path):
    blank = {"prompt": "1+1", "response": ""}
    config = _sft_files(tmp_path, [GOOD[0], blank, blank], None, "data.drop_degenerate_rows=true")
    with pytest.raises(DataError) as raised:
        load_supervised_inputs(config, ["actor_train"])
    assert str(raised.value) == (f"data.train ({tmp_path}/train.jsonl) has 1 rows left after dropping 2 degenerate "
                                 "rows, fewer than train.batch_size=2; lower the batch size or add rows")


# ---- the real command line ----------------------------------------------------------------------------------

def test_rollflow_dpo_refuses_a_pair_of_one_text_in_one_line(tmp_path, cli):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(row) + "\n" for row in [
        *PAIRS[:2], {"prompt": "1+1", "chosen": "2", "rejected": "2"}]))
    # `train.epochs` makes the driver check the rows before it starts any worker (the step count waits on them)
    result = cli("dpo", "examples/dpo.yaml", f"data.train={{path: {tmp_path}/d.jsonl}}", "data.eval=null",
                 "eval.greedy_accuracy=false", "train={epochs: 1, batch_size: 2}",
                 f"output.dir={tmp_path}/runs")
    assert result.returncode == EXIT_USER_ERROR, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        f"rollflow: error: data.train ({tmp_path}/d.jsonl) row 3: chosen and rejected are the same text; "
        f"{PAIR_MUST_DIFFER}"]
