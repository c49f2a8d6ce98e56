"""Minimal supervised fine-tuning on chat rows, as plain functions (no Ray, no config objects).

The pieces a driver loop needs, each usable on its own:

    examples = encode_sft_rows(tokenizer, rows)                 # chat template, loss mask on the answer
    batches = shuffled_batches(examples, batch_size=128, seed=0)
    for step in range(steps):
        metrics = sft_train_step(model, optimizer, collate_sft(next(batches), tokenizer.pad_token_id))
    accuracy = greedy_accuracy(model, tokenizer, eval_rows, batch_size=250, max_new_tokens=4)

The loss covers only the assistant's answer tokens and the end-of-turn tokens the chat template appends
(for the char tokenizer: the answer digits and `<eos>`), never the prompt, so the model learns to answer
and to stop, not to predict prompts.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class SFTExample:
    """One tokenized chat example.

    Attributes:
        input_ids: prompt tokens (chat template with generation prompt) followed by the assistant turn.
        loss_mask: 1 on the assistant turn's tokens (answer and end-of-turn), 0 on the prompt;
            same length as `input_ids`.
    """

    input_ids: list[int]
    loss_mask: list[int]


def chat_prompt_text(tokenizer: PreTrainedTokenizerBase, prompt: str) -> str:
    """The chat-formatted text a model sees before answering `prompt` (a single user turn)."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )


def encode_sft_example(tokenizer: PreTrainedTokenizerBase, prompt: str, response: str) -> SFTExample:
    """Tokenize one user prompt and assistant response with the tokenizer's chat template.

    The prompt part is the template with the generation prompt; the rest of the full conversation is
    the assistant turn, and only that part is trained on.

    Args:
        tokenizer: a tokenizer with a chat template.
        prompt: the user message content.
        response: the assistant message content (the reference answer).

    Returns:
        The example; raises `ValueError` if the template does not render the prompt as a token prefix
        of the full conversation (then the loss mask would be ill-defined).
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
    loss_mask = [0] * len(prompt_ids) + [1] * (len(full_ids) - len(prompt_ids))
    return SFTExample(input_ids=full_ids, loss_mask=loss_mask)


def encode_sft_rows(
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[dict],
    prompt_key: str = "prompt",
    response_key: str = "answer",
) -> list[SFTExample]:
    """Tokenize dataset rows (`{"prompt": ..., "answer": ...}`) into SFT examples, in order."""
    return [encode_sft_example(tokenizer, row[prompt_key], row[response_key]) for row in rows]


def collate_sft(examples: Sequence[SFTExample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad examples into a training batch.

    Right padding keeps every sequence starting at position 0, the same positions generation gives a
    left-padded prompt (it derives positions from the attention mask).

    Args:
        examples: B examples.
        pad_token_id: id written into padding positions (masked out of attention and loss).

    Returns:
        `input_ids` [B, T] long, `attention_mask` [B, T] long, `loss_mask` [B, T] float, where T is
        the longest example.
    """
    max_len = max(len(example.input_ids) for example in examples)
    input_ids = torch.full((len(examples), max_len), pad_token_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((len(examples), max_len), dtype=torch.long)  # [B, T]
    loss_mask = torch.zeros((len(examples), max_len), dtype=torch.float32)  # [B, T]
    for index, example in enumerate(examples):
        length = len(example.input_ids)
        input_ids[index, :length] = torch.tensor(example.input_ids)
        attention_mask[index, :length] = 1
        loss_mask[index, :length] = torch.tensor(example.loss_mask, dtype=torch.float32)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def sft_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy averaged over the masked (answer) tokens of the whole batch.

    Args:
        logits: [B, T, V] model outputs; position t predicts token t + 1.
        input_ids: [B, T] token ids.
        loss_mask: [B, T], 1 where the token is a training target.

    Returns:
        Scalar loss: sum of per-target-token negative log-likelihoods / number of target tokens.
    """
    targets = input_ids[:, 1:]  # [B, T-1]
    target_mask = loss_mask[:, 1:]  # [B, T-1]
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # [B, T-1, V]
    target_logprobs = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, T-1]
    return -(target_logprobs * target_mask).sum() / target_mask.sum().clamp(min=1.0)


def sft_train_step(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    max_grad_norm: float | None = 1.0,
) -> dict[str, float]:
    """One optimizer step on one batch from `collate_sft`.

    Args:
        model: a causal LM returning `.logits` [B, T, V].
        optimizer: optimizer over the model's parameters.
        batch: `input_ids` / `attention_mask` / `loss_mask`, each [B, T].
        max_grad_norm: clip the global gradient norm to this value; None disables clipping.

    Returns:
        `loss` (before the step), `grad_norm` (before clipping) and `num_target_tokens`.
    """
    model.train()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # [B, T, V]
    loss = sft_loss(logits, batch["input_ids"], batch["loss_mask"])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    clip_to = max_grad_norm if max_grad_norm is not None else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_to)
    optimizer.step()
    return {
        "loss": loss.item(),
        "grad_norm": grad_norm.item(),
        "num_target_tokens": batch["loss_mask"][:, 1:].sum().item(),
    }


def shuffled_batches(
    examples: Sequence[SFTExample], batch_size: int, seed: int
) -> Iterator[list[SFTExample]]:
    """Endless full batches: each epoch visits every example once in a seed-determined order.

    A last partial batch of an epoch is dropped, so every batch has exactly `batch_size` examples.
    """
    if not 0 < batch_size <= len(examples):
        raise ValueError(
            f"batch_size must be in 1..{len(examples)} (the number of examples), got {batch_size}"
        )
    rng = random.Random(seed)
    order = list(range(len(examples)))
    while True:
        rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield [examples[index] for index in order[start : start + batch_size]]


@torch.inference_mode()
def greedy_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    batch_size: int,
    max_new_tokens: int,
) -> list[list[int]]:
    """Greedy-decode an answer to each prompt with `model.generate` on left-padded batches.

    Args:
        model: a causal LM.
        tokenizer: its tokenizer (chat template, pad and eos tokens).
        prompts: user message contents; the chat template with generation prompt is applied.
        batch_size: prompts per `generate` call.
        max_new_tokens: generation budget per prompt.

    Returns:
        One list of generated token ids per prompt, in order, ending at (and including) the first eos
        token, or `max_new_tokens` long when no eos was produced.
    """
    was_training = model.training
    model.eval()
    eos_id = tokenizer.eos_token_id
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos_id,
    )
    completions: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        texts = [chat_prompt_text(tokenizer, prompt) for prompt in prompts[start : start + batch_size]]
        encoded = tokenizer(
            texts, padding=True, padding_side="left", add_special_tokens=False, return_tensors="pt"
        )
        sequences = model.generate(**encoded, generation_config=config)  # [b, P + N], N <= max_new_tokens
        for row in sequences[:, encoded["input_ids"].shape[1] :].tolist():
            completions.append(row[: row.index(eos_id) + 1] if eos_id in row else row)
    model.train(was_training)
    return completions


def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[dict],
    batch_size: int,
    max_new_tokens: int,
) -> float:
    """Fraction of rows whose greedy completion, decoded without special tokens and stripped, equals
    `row["answer"]` exactly.

    Args:
        rows: `{"prompt": ..., "answer": ...}` dicts.
        batch_size, max_new_tokens: as in `greedy_completions`.

    Returns:
        Accuracy in [0, 1].
    """
    completions = greedy_completions(
        model, tokenizer, [row["prompt"] for row in rows], batch_size, max_new_tokens
    )
    correct = sum(
        tokenizer.decode(ids, skip_special_tokens=True).strip() == row["answer"]
        for ids, row in zip(completions, rows)
    )
    return correct / len(rows)
