"""Per-token logprobs of a `Batch`'s response tokens under a causal LM (one forward pass)."""

from __future__ import annotations

import torch

from rollflow.data.sample import Batch


def model_logits(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Logits that predict each response token.

    Returns:
        [B, T, V] logits; row b, column t predicts response token t (input column P + t).
    """
    prompt_width, response_width = batch.prompt_length, batch.response_width
    output = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    )
    return output.logits[:, prompt_width - 1 : prompt_width + response_width - 1].float()  # [B, T, V]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log-softmax(logits / temperature) gathered at `tokens`.

    Args:
        logits: [B, T, V].
        tokens: [B, T] token ids.
        temperature: sampling temperature the engine used (> 0).

    Returns:
        [B, T] logprobs.
    """
    scaled = logits / temperature  # [B, T, V]
    picked = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B, T]
    return picked - torch.logsumexp(scaled, dim=-1)  # [B, T]


def response_tokens(batch: Batch) -> torch.Tensor:
    """[B, T] response token ids (padding included; mask with `response_mask`)."""
    return batch.input_ids[:, batch.prompt_length :]


def response_logprobs(model: torch.nn.Module, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    """Logprobs of the batch's response tokens under the causal LM `model` (one forward pass).

    Returns:
        [B, T] logprobs (padding included; mask with `response_mask`).
    """
    return token_logprobs(model_logits(model, batch), response_tokens(batch), temperature)  # [B, T]
