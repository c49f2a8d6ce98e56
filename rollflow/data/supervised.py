"""Supervised fine-tuning data: chat rows as `Sample`s, and an endless shuffled batch iterator.

A chat row (`{"prompt": ..., "answer": ...}`) becomes one `Sample` whose `prompt_ids` are the chat template
with the generation prompt and whose `response_ids` are the rest of the full conversation: the assistant's
answer and the end-of-turn tokens the template appends (for the char tokenizer, the answer digits and
`<eos>`). Every response token is trained on and no prompt token is, so the model learns to answer and
to stop, not to predict prompts. The samples then take the one training path every pipeline takes:

    samples = encode_sft_rows(tokenizer, rows)
    batches = shuffled_batches(samples, batch_size=128, seed=0)
    metrics = backend.train_step(collate(next(batches), tokenizer.pad_token_id), OBJECTIVES["nll"]())
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

from rollflow.data.sample import Sample

Item = TypeVar("Item")


def chat_prompt_text(tokenizer, prompt: str) -> str:
    """The chat-formatted text a model sees before answering `prompt` (a single user turn).

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        prompt: the user message content.

    Returns:
        The rendered template with the generation prompt.
    """
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The token ids of `chat_prompt_text(tokenizer, prompt)`: what an engine is handed to answer `prompt`,
    and the `prompt_ids` of an SFT sample.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        prompt: the user message content.

    Returns:
        Token ids, no special tokens added beyond the template's own.
    """
    return tokenizer.encode(chat_prompt_text(tokenizer, prompt), add_special_tokens=False)


def encode_sft_sample(tokenizer, prompt: str, response: str, row: dict[str, Any] | None = None) -> Sample:
    """Tokenize one user prompt and assistant response with the tokenizer's chat template.

    The prompt part is the template with the generation prompt; the rest of the full conversation is the
    assistant turn, the sample's response, and all of it is trained on (`loss_mask` all ones).

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        prompt: the user message content.
        response: the assistant message content (the reference answer).
        row: the dataset row, kept on the sample (`Sample.row`).

    Returns:
        The sample. Raises `ValueError` if the template does not render the prompt as a token prefix of
        the full conversation (then the loss mask would be ill-defined).
    """
    prompt_text = chat_prompt_text(tokenizer, prompt)
    full_text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], tokenize=False
    )
    prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=False)
    full_ids = tokenizer.encode(full_text, add_special_tokens=False)
    if full_ids[: len(prompt_ids)] != prompt_ids or len(full_ids) == len(prompt_ids):
        raise ValueError(
            f"the chat template does not extend the prompt tokens with the answer: {prompt_text!r} vs {full_text!r}"
        )
    response_ids = full_ids[len(prompt_ids) :]
    return Sample(prompt_ids=prompt_ids, response_ids=response_ids, loss_mask=[1] * len(response_ids),
                  prompt_text=prompt_text, row=dict(row or {}))


def encode_sft_rows(
    tokenizer,
    rows: Sequence[dict[str, Any]],
    prompt_key: str = "prompt",
    response_key: str = "answer",
) -> list[Sample]:
    """Tokenize dataset rows (`{"prompt": ..., "answer": ...}`) into SFT samples, in order.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        rows: dataset rows.
        prompt_key: the column holding the user message.
        response_key: the column holding the reference answer.

    Returns:
        One sample per row (see `encode_sft_sample`), each keeping its row.
    """
    return [encode_sft_sample(tokenizer, row[prompt_key], row[response_key], row) for row in rows]


def shuffled_batches(items: Sequence[Item], batch_size: int, seed: int) -> Iterator[list[Item]]:
    """Endless full batches: each epoch visits every item once in a seed-determined order.

    One `random.Random(seed)` reshuffles the same index list at the start of every epoch. A last partial
    batch of an epoch is dropped, so every batch has exactly `batch_size` items.

    Args:
        items: what to batch (samples, rows).
        batch_size: items per batch, in 1..len(items).
        seed: the shuffle seed.

    Returns:
        An endless iterator of `batch_size`-item lists. Raises `ValueError` (on the first `next`) for a
        batch size outside 1..len(items).
    """
    if not 0 < batch_size <= len(items):
        raise ValueError(f"batch_size must be in 1..{len(items)} (the number of items), got {batch_size}")
    rng = random.Random(seed)
    order = list(range(len(items)))
    while True:
        rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield [items[index] for index in order[start : start + batch_size]]
