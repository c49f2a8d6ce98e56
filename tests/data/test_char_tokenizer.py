import pytest
from transformers import AutoTokenizer

from rollflow.data.char_tokenizer import CHARACTERS, build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def test_chat_template_renders_user_and_assistant_turns(tokenizer):
    user = [{"role": "user", "content": "23+58"}]
    prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|user|>23+58<|assistant|>"
    conversation = user + [{"role": "assistant", "content": "81"}]
    assert tokenizer.apply_chat_template(conversation, tokenize=False) == "<|user|>23+58<|assistant|>81<eos>"


def test_chat_template_rejects_roles_it_cannot_render(tokenizer):
    with pytest.raises(Exception, match="only user and assistant"):
        tokenizer.apply_chat_template([{"role": "system", "content": "hi"}], tokenize=False)


def test_one_token_per_character_and_decode_inserts_no_spaces(tokenizer):
    ids = tokenizer.encode("12+3 ab", add_special_tokens=False)
    assert len(ids) == 7
    assert tokenizer.decode(ids) == "12+3 ab"
    assert tokenizer.decode(tokenizer.encode(CHARACTERS, add_special_tokens=False)) == CHARACTERS


def test_special_tokens_are_single_tokens_and_unknown_characters_map_to_unk(tokenizer):
    ids = tokenizer.encode("<|user|>1+2<|assistant|>3<eos>", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == ["<|user|>", "1", "+", "2", "<|assistant|>", "3", "<eos>"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "1+23"
    assert tokenizer.encode("a€b", add_special_tokens=False)[1] == tokenizer.unk_token_id
    assert (tokenizer.pad_token, tokenizer.eos_token) == ("<pad>", "<eos>")
    assert tokenizer.pad_token_id != tokenizer.eos_token_id


def test_batches_are_left_padded(tokenizer):
    batch = tokenizer(["1+2", "33+44"], padding=True, add_special_tokens=False)
    assert tokenizer.padding_side == "left"
    assert batch["input_ids"][0][:2] == [tokenizer.pad_token_id] * 2
    assert batch["attention_mask"] == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]


def test_round_trips_through_save_pretrained_and_auto_tokenizer(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.get_vocab() == tokenizer.get_vocab()
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.padding_side) == (
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
        "left",
    )
    text = "<|user|>23+58<|assistant|>81<eos>"
    assert loaded.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
    assert loaded.decode(loaded.encode("12+3 ab", add_special_tokens=False)) == "12+3 ab"
    prompt = loaded.apply_chat_template(
        [{"role": "user", "content": "7+5"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|user|>7+5<|assistant|>"
