import re

import pytest

from rollflow.data.char_tokenizer import build_ascii_tokenizer
from rollflow.data.sample import Sample, collate
from rollflow.data.supervised import (
    ConversationEncoder,
    chat_prompt_ids,
    shuffled_batches,
)
from rollflow.errors import DataError


@pytest.fixture(scope="module")
def tokenizer():
    return build_ascii_tokenizer()


def _answers(tokenizer, rows):
    return [ConversationEncoder(tokenizer, response_key="answer").encode(row) for row in rows]


def test_loss_mask_covers_only_the_answer_and_eos(tokenizer):
    sample = _answers(tokenizer, [{"prompt": "23+58", "answer": "81"}])[0]
    tokens = tokenizer.convert_ids_to_tokens(sample.prompt_ids + sample.response_ids)
    assert tokens == ["<|user|>", "2", "3", "+", "5", "8", "<|assistant|>", "8", "1", "<eos>"]
    # the prompt is not trained on (collate masks only response tokens); the answer and <eos> are
    assert [0] * len(sample.prompt_ids) + sample.loss_mask == [0, 0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert sample.prompt_ids == chat_prompt_ids(tokenizer, "23+58")  # what an engine is handed


def test_rows_keep_their_row_and_order(tokenizer):
    rows = [{"prompt": "1+2", "answer": "3", "id": 7}, {"prompt": "10+20", "answer": "30"}]
    samples = _answers(tokenizer, rows)
    assert [sample.row for sample in samples] == rows
    assert tokenizer.decode(samples[1].response_ids) == "30<eos>"


class _TemplateWithoutPrefix:
    """A tokenizer whose full conversation does not start with the prompt's tokens."""

    chat_template = "not jinja: apply_chat_template below stands in for it"

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        return "P" if add_generation_prompt else "Q" + messages[-1]["content"]

    def encode(self, text, add_special_tokens=False):
        return [ord(character) for character in text]


def test_a_template_that_does_not_extend_the_prompt_is_rejected():
    with pytest.raises(DataError, match="does not render a conversation as a token prefix of its continuation"):
        ConversationEncoder(_TemplateWithoutPrefix()).encode({"prompt": "1+2", "response": "3"})


def test_collate_pads_sft_samples_into_the_shared_batch_layout():
    samples = [Sample([5], [6, 7]), Sample([8], [9])]
    batch = collate(samples, pad_token_id=0)
    # prompts of one length: no left padding, so the layout is plain right padding
    assert batch.prompt_length == 1 and batch.response_width == 2
    assert batch.input_ids.tolist() == [[5, 6, 7], [8, 9, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2], [0, 1, 1]]
    assert batch.response_mask.tolist() == [[1, 1], [1, 0]]


def test_add2_chat_samples_collate_without_left_padding(tokenizer):
    # Every add2 prompt renders to 7 tokens, so only the answers (2 or 3 digits, then <eos>) are padded.
    samples = _answers(tokenizer, [{"prompt": "23+58", "answer": "81"}, {"prompt": "99+99", "answer": "198"}])
    batch = collate(samples, tokenizer.pad_token_id)
    assert batch.prompt_length == 7 and batch.response_width == 4
    assert batch.attention_mask.tolist() == [[1] * 10 + [0], [1] * 11]
    assert batch.response_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]


def test_shuffled_batches_are_full_deterministic_and_cover_each_epoch():
    samples = [Sample([index], [1]) for index in range(10)]
    first = shuffled_batches(samples, batch_size=3, seed=0)
    epoch = [next(first) for _ in range(3)]  # 10 // 3 = 3 full batches per epoch, 1 sample dropped
    seen = [sample.prompt_ids[0] for batch in epoch for sample in batch]
    assert all(len(batch) == 3 for batch in epoch) and len(set(seen)) == 9
    again = shuffled_batches(samples, batch_size=3, seed=0)
    assert [next(again) for _ in range(3)] == epoch
    with pytest.raises(ValueError, match="batch_size"):
        next(shuffled_batches(samples, batch_size=11, seed=0))


def test_shuffled_batches_reshuffle_one_order_with_one_generator_each_epoch():
    # The exact order: one random.Random(seed) shuffling the same index list at every epoch's start.
    import random

    rng, order, expected = random.Random(3), list(range(7)), []
    for _ in range(3):
        rng.shuffle(order)
        expected += [order[0:2], order[2:4], order[4:6]]
    batches = shuffled_batches(list(range(7)), batch_size=2, seed=3)
    assert [next(batches) for _ in range(9)] == expected


# ---- ConversationEncoder: rows of whole conversations ---------------------------------------------------

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2"},
        {"role": "assistant", "content": "3"}, {"role": "user", "content": "and 2+2"},
        {"role": "assistant", "content": "4!"}]


def _ids(sample):
    return sample.prompt_ids + sample.response_ids


def _tokens_and_mask(tokenizer, sample):
    """The whole conversation's tokens, and the 0/1 mask over all of them (the prompt part is never trained)."""
    tokens = tokenizer.convert_ids_to_tokens(sample.prompt_ids + sample.response_ids)
    return tokens, [0] * len(sample.prompt_ids) + sample.loss_mask


def test_conversation_mask_is_one_exactly_on_assistant_content_and_eos(tokenizer):
    sample = ConversationEncoder(tokenizer).encode({"messages": CHAT})
    tokens, mask = _tokens_and_mask(tokenizer, sample)
    # The template renders <|system|>Be brief.<|user|>1+2<|assistant|>3<eos><|user|>and 2+2<|assistant|>4!<eos>;
    # the byte-level tokenizer spells the space as "Ġ".
    system = ["<|system|>", "B", "e", "Ġ", "b", "r", "i", "e", "f", "."]
    first_user = ["<|user|>", "1", "+", "2"]
    second_user = ["<|user|>", "a", "n", "d", "Ġ", "2", "+", "2"]
    expected = [*system, *first_user, "<|assistant|>", "3", "<eos>", *second_user, "<|assistant|>", "4", "!", "<eos>"]
    assert tokens == expected
    trained = {15, 16, 26, 27, 28}  # positions of "3", "<eos>" (first answer) and "4", "!", "<eos>" (second)
    assert [tokens[i] for i in sorted(trained)] == ["3", "<eos>", "4", "!", "<eos>"]
    assert mask == [int(i in trained) for i in range(len(tokens))]
    # the headers stay untrained; the prompt part ends with the first assistant header (what an engine is handed)
    assert tokens[14] == tokens[25] == "<|assistant|>" and mask[14] == mask[25] == 0
    assert tokenizer.convert_ids_to_tokens(sample.prompt_ids)[-1] == "<|assistant|>"
    assert sample.prompt_text == "<|system|>Be brief.<|user|>1+2<|assistant|>"
    assert sample.row == {"messages": CHAT}


def test_a_prompt_response_row_is_the_two_turn_chat(tokenizer):
    encoder = ConversationEncoder(tokenizer)
    pair = encoder.encode({"prompt": "23+58", "response": "81"})
    chat = encoder.encode({"messages": [{"role": "user", "content": "23+58"},
                                        {"role": "assistant", "content": "81"}]})
    assert (pair.prompt_ids, pair.response_ids, pair.loss_mask) == (chat.prompt_ids, chat.response_ids, chat.loss_mask)
    assert pair.prompt_ids == chat_prompt_ids(tokenizer, "23+58")  # and the SFT encoding of the same row
    # DPO's chosen / rejected: the row's prompt with a response given instead of its own
    rejected = encoder.encode({"prompt": "23+58", "response": "81"}, response="84")
    assert tokenizer.decode(rejected.response_ids) == "84<eos>" and rejected.prompt_ids == pair.prompt_ids


def test_a_chat_prompt_with_a_separate_response(tokenizer):
    encoder = ConversationEncoder(tokenizer)
    sample = encoder.encode({"prompt": CHAT[:4], "response": "4!"})
    assert _ids(sample) == _ids(encoder.encode({"messages": CHAT}))


def test_without_a_chat_template_a_row_is_prompt_then_response_then_eos(tokenizer):
    sample = ConversationEncoder(tokenizer, apply_chat_template=False).encode({"prompt": "1+2", "response": "3"})
    assert tokenizer.convert_ids_to_tokens(_ids(sample)) == ["1", "+", "2", "3", "<eos>"]
    assert sample.loss_mask == [1, 1]
    with pytest.raises(DataError, match="chat rows need a chat template"):
        ConversationEncoder(tokenizer, apply_chat_template=False).encode({"messages": CHAT})


@pytest.mark.parametrize("row, message", [
    ({"prompt": "1+2"}, "the response (column 'response') is missing"),
    ({"prompt": "1+2", "response": 3}, "is int, not a string"),
    ({"prompt": 12, "response": "3"}, "must be a string or chat turns"),
    ({"messages": [{"role": "assistant", "content": "3"}, {"role": "user", "content": "1+2"}]},
     "starts with an assistant turn"),
    ({"messages": [{"role": "user", "content": "1+2"}, {"role": "function", "content": "3"},
                   {"role": "assistant", "content": "3"}]}, "role: system | user | assistant | tool"),
    ({"messages": [{"role": "user", "content": "1+2"}]}, "no assistant tokens to train on"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "user", "content": "1+2"}, {"role": "system", "content": "late"},
                   {"role": "assistant", "content": "3"}]}, "the chat template cannot render the row"),
])
def test_bad_rows_are_one_line_data_errors(tokenizer, row, message):
    with pytest.raises(DataError, match=re.escape(message)) as caught:
        ConversationEncoder(tokenizer).encode(row)
    assert "\n" not in str(caught.value)


def test_a_conversation_over_max_tokens_is_a_data_error_not_truncated(tokenizer):
    row = {"prompt": "23+58", "response": "81"}  # 7 prompt tokens + "8", "1", "<eos>" = 10 tokens
    assert len(_ids(ConversationEncoder(tokenizer, max_tokens=10).encode(row))) == 10
    with pytest.raises(DataError, match="has 11 tokens, over data.max_tokens=10") as caught:
        ConversationEncoder(tokenizer, max_tokens=10).encode({"prompt": "23+58", "response": "181"})
    assert "\n" not in str(caught.value)


def test_a_non_string_response_names_the_configured_column(tokenizer):
    with pytest.raises(DataError, match="column 'answer'"):
        ConversationEncoder(tokenizer, response_key="answer").encode({"prompt": "1+2", "answer": 3})


CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "Evaluate.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
TOOL_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*3"}}\n</tool_call>'


def test_a_tool_use_row_trains_on_the_calls_and_the_answer_not_on_the_tool_results(tokenizer):
    row = {"tools": [CALCULATOR], "messages": [
        {"role": "user", "content": "12*3"}, {"role": "assistant", "content": TOOL_CALL},
        {"role": "tool", "content": "36"}, {"role": "assistant", "content": "36"}]}
    sample = ConversationEncoder(tokenizer).encode(row)
    # the prompt is what the agentic rollout gives a tool-use env's first turn: the template's tool line first
    assert sample.prompt_text == "<|system|>tools: calculator(expression)\n<|user|>12*3<|assistant|>"
    trained = tokenizer.decode([t for t, m in zip(sample.response_ids, sample.loss_mask) if m])
    assert trained == TOOL_CALL + "<eos>" + "36" + "<eos>"
    untrained = tokenizer.decode([t for t, m in zip(sample.response_ids, sample.loss_mask) if not m])
    assert untrained == "<|user|><tool_response>36</tool_response><|assistant|>"


def test_structured_tool_calls_render_as_the_model_writes_them(tokenizer):
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*3"}}}
    messages = [{"role": "user", "content": "12*3"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    sample = ConversationEncoder(tokenizer).encode({"tools": [CALCULATOR], "messages": messages})
    assert tokenizer.decode(sample.response_ids) == TOOL_CALL + "<eos>"


@pytest.mark.parametrize("row, message", [
    ({"tools": "calculator", "messages": CHAT}, "column 'tools' must be a list of JSON-schema tool specs"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "tool_calls must be a list on an assistant"),
])
def test_malformed_tool_rows_are_one_data_error(tokenizer, row, message):
    with pytest.raises(DataError, match=re.escape(message)):
        ConversationEncoder(tokenizer).encode(row)
