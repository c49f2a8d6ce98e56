"""Supervised objectives: the per-token negative log-likelihood of target tokens (SFT)."""

from __future__ import annotations

import torch
from torch import Tensor


def token_nll(logits: Tensor, tokens: Tensor) -> Tensor:
    """Negative log-likelihood of each target token: `-log softmax(logits)[token]`.

    Computed as cross-entropy (log-softmax, then the target's entry), so an SFT step gives bit for bit the
    gradient of the textbook `-(log_softmax(logits).gather(tokens) * mask).sum() / mask.sum()`.

    Args:
        logits: [B, T, V], row b column t predicts `tokens[b, t]`.
        tokens: [B, T] target token ids (padding included; mask the result).

    Returns:
        [B, T] float per-token loss (>= 0).
    """
    batch, width, vocab = logits.shape
    flat = torch.nn.functional.cross_entropy(logits.reshape(batch * width, vocab).float(),
                                             tokens.reshape(batch * width), reduction="none")  # [B * T]
    return flat.view(batch, width)  # [B, T]
