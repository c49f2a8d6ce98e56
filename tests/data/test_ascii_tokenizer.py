"""The ASCII character tokenizer, used directly and loaded the way engines load it: `AutoTokenizer` on a
directory whose config.json says `model_type: qwen2` (transformers 5 then builds `Qwen2Tokenizer` from the
saved vocabulary, with its own normalizer, pre-tokenizer and decoder)."""

import pytest
from transformers import AutoTokenizer, Qwen2Config

from rollflow.data.char_tokenizer import (
    ASCII_CHARACTERS,
    ASCII_SPECIAL_TOKENS,
    build_ascii_tokenizer,
    byte_level_alphabet,
)

PRINTABLE = "".join(chr(code) for code in range(32, 127))
WHITESPACE_TEXTS = [" ", "   ", " leading", "trailing ", "  two  spaces  ", "\n", "\n\n\n", "a\nb", "a \n b",
                    "\t", "\t\ta\t", " \t\n \t\n", "What is 7 * 8?", "line one\nline two\n\n  indented\tcol"]
NON_ASCII = ["é", "→", "\r", "😀", "\x00", "\x7f"]


@pytest.fixture(scope="module")
def direct():
    return build_ascii_tokenizer()


@pytest.fixture(scope="module")
def loaded(direct, tmp_path_factory):
    path = tmp_path_factory.mktemp("ascii_tokenizer")
    Qwen2Config(vocab_size=len(direct)).save_pretrained(path)
    direct.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(params=["direct", "qwen2 directory"])
def tokenizer(request, direct, loaded):
    return direct if request.param == "direct" else loaded


def _encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_every_printable_character_is_one_token_and_decodes_back(tokenizer):
    for character in ASCII_CHARACTERS:
        assert tokenizer.decode(_encode(tokenizer, character)) == character
    ids = _encode(tokenizer, PRINTABLE + "\n\t")
    assert len(ids) == len(PRINTABLE) + 2
    assert tokenizer.decode(ids) == PRINTABLE + "\n\t"


@pytest.mark.parametrize("text", WHITESPACE_TEXTS)
def test_spaces_newlines_and_tabs_round_trip_one_token_per_character(tokenizer, text):
    ids = _encode(tokenizer, text)
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("character", NON_ASCII)
def test_other_characters_become_one_fallback_token_per_utf8_byte_and_are_never_dropped(tokenizer, character):
    # Qwen2Tokenizer builds its BPE without an unknown token, so a byte with no token would vanish; every
    # byte outside ASCII_CHARACTERS has a fallback token (ids 103-261) instead.
    ids = _encode(tokenizer, f"a{character}b")
    middle = ids[1:-1]
    assert len(middle) == len(character.encode("utf-8"))
    assert all(103 <= token_id < 262 for token_id in middle)
    assert tokenizer.decode(ids) == f"a{character}b"
    assert tokenizer.decode(_encode(tokenizer, "café → ok\r\n")) == "café → ok\r\n"


def test_text_is_nfc_normalized_so_a_combining_accent_decodes_composed(tokenizer):
    # What Qwen2Tokenizer does on load; ASCII is never changed by NFC (checked above).
    assert tokenizer.decode(_encode(tokenizer, "e\u0301")) == "\u00e9"


def test_loaded_tokenizer_has_the_same_vocabulary_and_ids_as_the_built_one(direct, loaded):
    assert loaded.get_vocab() == direct.get_vocab()
    assert len(loaded) == len(direct) == 262
    text = "<|system|>x<|user|>  café\t→\r\n 7 * 8?<|assistant|>56<eos>"
    assert _encode(loaded, text) == _encode(direct, text)


def test_ids_are_stable_specials_then_characters_then_bytes(tokenizer):
    assert tokenizer.convert_tokens_to_ids(ASCII_SPECIAL_TOKENS) == [0, 1, 2, 3, 4, 5]
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert (tokenizer.pad_token, tokenizer.eos_token, tokenizer.unk_token) == ("<pad>", "<eos>", "<unk>")
    assert tokenizer.bos_token is None
    # Byte-level spellings: space is Ġ (id 6), `~` is itself (id 100), newline Ċ (101), tab ĉ (102).
    assert tokenizer.convert_tokens_to_ids(["Ġ", "!", "~", "Ċ", "ĉ"]) == [6, 7, 100, 101, 102]
    alphabet = byte_level_alphabet()
    assert tokenizer.convert_tokens_to_ids([alphabet[0], alphabet[0xFF]]) == [103, 261]
    assert _encode(tokenizer, ASCII_CHARACTERS) == list(range(6, 103))


def test_special_tokens_are_single_tokens_and_skippable(tokenizer):
    ids = _encode(tokenizer, "<|system|>s<|user|>1 + 2<|assistant|>3<eos>")
    assert ids[:3] == [5, tokenizer.convert_tokens_to_ids("s"), 3]
    assert ids[-3:] == [4, tokenizer.convert_tokens_to_ids("3"), 1]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "s1 + 23"


def test_settings_survive_loading(tokenizer):
    assert tokenizer.padding_side == "left"
    assert tokenizer.clean_up_tokenization_spaces is False
    assert tokenizer.model_max_length == 256
    batch = tokenizer(["1+2", "33 + 4"], padding=True, add_special_tokens=False)
    assert batch["input_ids"][0][:3] == [0, 0, 0]
    assert batch["attention_mask"][0] == [0, 0, 0, 1, 1, 1]


def test_model_max_length_is_set_by_the_builder():
    assert build_ascii_tokenizer(model_max_length=64).model_max_length == 64


def test_chat_template_renders_system_user_and_assistant_turns(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 7 * 8?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|system|>Be brief.<|user|>What is 7 * 8?<|assistant|>"
    conversation = messages[1:] + [{"role": "assistant", "content": "56"}]
    assert tokenizer.apply_chat_template(conversation, tokenize=False) == "<|user|>What is 7 * 8?<|assistant|>56<eos>"


@pytest.mark.parametrize("messages", [
    [{"role": "function", "content": "x"}],
    [{"role": "user", "content": "x"}, {"role": "system", "content": "late"}],
])
def test_chat_template_rejects_other_roles_and_a_system_message_after_the_first(tokenizer, messages):
    with pytest.raises(Exception, match="supports a system message \\(first only\\), user, assistant and tool"):
        tokenizer.apply_chat_template(messages, tokenize=False)


CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "Evaluate.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def test_chat_template_renders_tools_in_one_system_line_and_tool_results_as_one_user_turn(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12*3"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*3"}}}]},
                {"role": "tool", "content": "36"}, {"role": "tool", "content": "x"},
                {"role": "assistant", "content": "36"}]
    text = tokenizer.apply_chat_template(messages, tools=[CALCULATOR], tokenize=False)
    assert text == ('<|system|>Be brief.\ntools: calculator(expression)\n<|user|>12*3<|assistant|><tool_call>\n'
                    '{"name": "calculator", "arguments": {"expression": "12*3"}}\n</tool_call><eos>'
                    '<|user|><tool_response>36</tool_response><tool_response>x</tool_response><|assistant|>36<eos>')
    # without tools, nothing changes: the bundled model's prompts are those it was trained on
    assert tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True) == \
        "<|system|>Be brief.<|user|>12*3<|assistant|>"


@pytest.mark.parametrize("user, answer", [("7 * 8", "56"), ("  spaced  ", " 5 "), ("two\nlines\n", "\n\tx\n")])
def test_generation_prompt_tokens_are_an_exact_prefix_of_the_conversation_tokens(tokenizer, user, answer):
    messages = [{"role": "system", "content": " sys \n"}, {"role": "user", "content": user}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": answer}], tokenize=False)
    prompt_ids, full_ids = _encode(tokenizer, prompt), _encode(tokenizer, full)
    assert full_ids[:len(prompt_ids)] == prompt_ids
    assert tokenizer.decode(full_ids[len(prompt_ids):]) == answer + "<eos>"
    assert full_ids[-1] == tokenizer.eos_token_id
