"""Supervised objectives: the per-token negative log-likelihood of target tokens (SFT), and its mean over an
eval's batches."""

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


class MeanTokenNLL:
    """The negative log-likelihood per trained token over batches (an eval in chunks)."""

    def __init__(self):
        self.total = 0.0
        self.tokens = 0.0

    def add(self, logprobs: Tensor, mask: Tensor) -> None:
        """[B, T] token log-probs and the [B, T] mask of the tokens that count."""
        self.total -= float((logprobs * mask).sum())
        self.tokens += float(mask.sum())

    @property
    def value(self) -> float:
        return self.total / max(self.tokens, 1.0)

