"""Next-token sampling of the `hf` engine: pure functions over a batch's logits.

Reported logprobs are log-softmax(logits / temperature) of the chosen token (temperature 1 for greedy
rows), before top-k / top-p filtering and before the `min_new_tokens` mask: the quantity the trainer
recomputes, knowing neither.

Rows draw either with `torch.multinomial` from one generator, or (in a batch with seeded rows) by inverse
CDF from a uniform each row drew in advance for each of its positions (`draw_uniforms`), so that a seeded
row's draw depends on nothing else in the batch, nor on when it joined it.
"""

from __future__ import annotations

import torch

from rollflow.engines.base import SamplingParams


@torch.no_grad()
def sample_tokens(logits: torch.Tensor, temperatures: torch.Tensor, greedy: torch.Tensor, *,
                  all_greedy: bool = False, filter_params: list[SamplingParams] | None = None,
                  stop_ids: torch.Tensor | None = None, stop_blocked: torch.Tensor | None = None,
                  uniforms: torch.Tensor | None = None,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose one token per row and report its logprob.

    Args:
        logits: [B, V] next-token logits.
        temperatures: [B] each row's temperature; 1 for greedy rows (their logprobs are of the raw logits).
        greedy: [B] rows that take the argmax instead of drawing.
        all_greedy: every row is greedy, so nothing is drawn (a Python bool: the caller knows it without
            reading `greedy` back from the device at every token).
        filter_params: each row's SamplingParams when some row has `top_k > 0` or `top_p < 1`: rows draw
            from their top-k / top-p set (`filter_top_k_top_p`). None: no row filters.
        stop_ids: [B, S] each row's EOS and stop ids, padded with -1; with `stop_blocked`, [B] rows that
            may not stop yet (`min_new_tokens`), whose stop ids are never chosen, greedy or drawn. None: no
            row is blocked (and `stop_blocked` is None too).
        uniforms: [B] one uniform in [0, 1) per row: rows draw by inverse CDF, the first token whose
            cumulative probability exceeds it. None: rows draw with `torch.multinomial` from `generator`.
        generator: the generator `torch.multinomial` draws from (torch's default one when None).

    Returns:
        tokens [B] and their logprobs [B] (log-softmax(logits / temperature), unfiltered, unmasked).

    Raises:
        FloatingPointError: NaN logprobs (non-finite logits), which would make greedy rows emit garbage and
            sampled rows crash `torch.multinomial` (a device-side assert on CUDA, which poisons the process).
    """
    if (stop_ids is None) != (stop_blocked is None):
        raise ValueError("stop_ids and stop_blocked go together")
    scaled = logits / temperatures.unsqueeze(1)  # [B, V]; greedy rows carry temperature 1
    log_probs = torch.log_softmax(scaled, dim=-1)  # [B, V]
    if bool(torch.isnan(log_probs).any()):
        raise FloatingPointError("the model's logits are not finite (non-finite weights?)")
    allowed = scaled  # [B, V] what rows choose from
    if stop_ids is not None:
        allowed = _ban_stop_ids(scaled, stop_ids, stop_blocked)
        tokens = allowed.argmax(-1)  # [B] greedy choice
    else:
        tokens = log_probs.argmax(-1)  # [B] greedy choice
    if not all_greedy:
        if filter_params is not None:
            probs = torch.softmax(filter_top_k_top_p(allowed, filter_params), dim=-1)  # [B, V]
        elif stop_ids is not None:
            probs = torch.softmax(allowed, dim=-1)  # [B, V]
        else:
            probs = log_probs.exp()  # [B, V]
        if uniforms is not None:  # inverse CDF: the first token whose cumulative probability exceeds u
            cdf = probs.cumsum(-1)  # [B, V]
            u = uniforms.unsqueeze(1) * cdf[:, -1:]  # [B, 1], below the total
            draws = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=probs.shape[1] - 1)  # [B]
        else:
            draws = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # [B]
        tokens = torch.where(greedy, tokens, draws)  # [B]
    return tokens, log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1)


def filter_top_k_top_p(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask logits outside each row's top-k / top-p set with -inf. [S, V] -> [S, V].

    Top-k keeps the logits at least the k-th largest (ties with it included); top-p then keeps the fewest
    most likely tokens whose probability reaches `top_p`, the token that crosses it included.
    """
    if all(p.top_k == 0 and p.top_p >= 1.0 for p in params):
        return scaled
    out = scaled.clone()
    for row, p in enumerate(params):
        if p.top_k > 0:
            kth = torch.topk(out[row], min(p.top_k, out.shape[1])).values[-1]
            out[row][out[row] < kth] = float("-inf")
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(out[row], descending=True)
            cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)
            drop = cumulative - torch.softmax(sorted_logits, -1) > p.top_p  # keep the token that crosses p
            out[row][order[drop]] = float("-inf")
    return out


def draw_uniforms(max_new_tokens: list[int], generators: list[torch.Generator | None], width: int,
                  engine_generator: torch.Generator) -> torch.Tensor:
    """[N, width] sampling uniforms: row `i`'s uniform for its position `t` at `[i, t]` (zeros past its limit).

    A seeded row (one with a generator) draws its `max_new_tokens[i]` uniforms from its own generator, so
    its t-th token uses the t-th draw of its seed whatever batch it is in; unseeded rows draw, in row
    order, from the engine's generator.
    """
    uniforms = torch.zeros(len(max_new_tokens), width, device=engine_generator.device)
    for i, (limit, generator) in enumerate(zip(max_new_tokens, generators)):
        uniforms[i, :limit] = torch.rand(limit, generator=generator or engine_generator,
                                         device=engine_generator.device)
    return uniforms


def _ban_stop_ids(scaled: torch.Tensor, stop_ids: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """`scaled` ([B, V]) with the stop ids ([B, S], -1 padded) of `blocked` rows ([B]) set to -inf."""
    banned = blocked & (stop_ids[:, 0] >= 0)  # [B] blocked rows that have a stop id at all
    # Padding slots point at the row's first stop id and get the same value, so no column receives two
    # different values from one scatter (which would be nondeterministic).
    index = torch.where(stop_ids >= 0, stop_ids, stop_ids[:, :1].clamp(min=0))  # [B, S]
    values = scaled.gather(1, index).masked_fill(banned.unsqueeze(1), float("-inf"))  # [B, S]
    return scaled.scatter(1, index, values)
