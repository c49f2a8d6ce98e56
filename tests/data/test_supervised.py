import pytest

from rollflow.data.char_tokenizer import build_ascii_tokenizer
from rollflow.data.sample import Sample, collate
from rollflow.data.supervised import chat_prompt_ids, encode_sft_rows, encode_sft_sample, shuffled_batches


@pytest.fixture(scope="module")
def tokenizer():
    return build_ascii_tokenizer()


def test_loss_mask_covers_only_the_answer_and_eos(tokenizer):
    sample = encode_sft_sample(tokenizer, "23+58", "81")
    tokens = tokenizer.convert_ids_to_tokens(sample.prompt_ids + sample.response_ids)
    assert tokens == ["<|user|>", "2", "3", "+", "5", "8", "<|assistant|>", "8", "1", "<eos>"]
    # the prompt is not trained on (collate masks only response tokens); the answer and <eos> are
    assert [0] * len(sample.prompt_ids) + sample.loss_mask == [0, 0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert sample.prompt_ids == chat_prompt_ids(tokenizer, "23+58")  # what an engine is handed


def test_rows_keep_their_row_and_order(tokenizer):
    rows = [{"prompt": "1+2", "answer": "3", "id": 7}, {"prompt": "10+20", "answer": "30"}]
    samples = encode_sft_rows(tokenizer, rows)
    assert [sample.row for sample in samples] == rows
    assert tokenizer.decode(samples[1].response_ids) == "30<eos>"


class _TemplateWithoutPrefix:
    """A tokenizer whose full conversation does not start with the prompt's tokens."""

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        return "P" if add_generation_prompt else "Q" + messages[-1]["content"]

    def encode(self, text, add_special_tokens=False):
        return [ord(character) for character in text]


def test_a_template_that_does_not_extend_the_prompt_is_rejected():
    with pytest.raises(ValueError, match="the chat template does not extend the prompt tokens with the answer"):
        encode_sft_sample(_TemplateWithoutPrefix(), "1+2", "3")


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
    samples = encode_sft_rows(tokenizer, [{"prompt": "23+58", "answer": "81"}, {"prompt": "99+99", "answer": "198"}])
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
