"""The `hf` engine's running decode batch: its rows' KV cache, aligned by left padding, and their buffers.

Rows join (`DecodeBatch.merge`) and leave (`DecodeBatch.select`) between tokens. Every row's cache columns
end at the same column, the last one of the batch; shorter rows are left-padded with masked columns, and
explicit position ids (kept by the engine) make each row's computation what it would be alone. The cache
surgery is done by the functions below on any transformers cache whose layers hold plain key / value
tensors ([B, KV heads, L, head dim]): repeating a prompt's row for each of its samples
(`repeat_requests`), selecting rows and dropping columns no row attends to (`select_rows`), concatenating
two caches (`concat_left_padded`), and copying one row's KV out (`row_kv`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers.cache_utils import DynamicLayer

from rollflow.engines.base import SamplingParams
from rollflow.engines.prefix_cache import LayerKV
from rollflow.engines.sampling import draw_uniforms


class BatchRow(Protocol):
    """What the batch reads of one of its rows (the engine's row type carries more)."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def generator(self) -> torch.Generator | None: ...


@dataclass
class DecodeBatch:
    """The running decode batch. Batch position `b` is row `rows[b]` in every tensor.

    The KV cache and `attention` span `L` columns shared by all rows: each row's prompt is left-padded so
    that it ends where the rows that were already running had their last token when it joined; padding
    columns are masked out (and dropped once no row needs them), and explicit position ids make every
    row's computation what it would be alone. Output buffers are `W` wide: each row's `max_new_tokens`
    plus one scratch column, which rows that finished but still sit in the batch write into.
    """

    rows: list[BatchRow]
    cache: object  # transformers Cache: per layer keys / values [B, KV heads, L, head dim]
    mergeable: bool  # rows can join: the cache's keys and values can be padded and concatenated
    logits: torch.Tensor  # [B, V] logits of each row's next token
    last_tokens: torch.Tensor  # [B] each row's last sampled token, until it is fed to the model
    attention: torch.Tensor  # [B, L] 1 where the cache column holds one of the row's tokens
    positions: torch.Tensor  # [B] position id of the token each row feeds next
    rope_deltas: torch.Tensor  # [B] multimodal rotary models: a row's text position is positions + delta
    lengths: torch.Tensor  # [B] tokens sampled so far (the output index of the next one)
    active: torch.Tensor  # [B] still generating
    temperatures: torch.Tensor  # [B] (1 for greedy rows)
    greedy: torch.Tensor  # [B]
    limits: torch.Tensor  # [B] max_new_tokens
    min_tokens: torch.Tensor  # [B] min_new_tokens
    stop_ids: torch.Tensor  # [B, S] EOS + stop ids, padded with -1
    tokens: torch.Tensor  # [B, W]
    logprobs: torch.Tensor  # [B, W]
    versions: torch.Tensor  # [B, W] policy version when each token was sampled
    uniforms: torch.Tensor | None  # [B, W] sampling uniforms, while a row is seeded
    running: int = 0  # active rows (a Python int: admission reads it at every token)
    started: float = field(default_factory=time.perf_counter)
    params: list[SamplingParams] = field(default_factory=list)  # of each row
    all_greedy: bool = False
    needs_filter: bool = False
    any_seeded: bool = False
    any_min_tokens: bool = False

    # Per-row tensors that rows are selected from and concatenated along their first dim.
    ROW_TENSORS = ("logits", "last_tokens", "positions", "rope_deltas", "lengths", "active", "temperatures", "greedy",
                   "limits", "min_tokens")
    # Per-row tensors whose second dim is padded on the right (with this value) when batches merge.
    RIGHT_PADDED = {"stop_ids": -1, "tokens": 0, "logprobs": 0.0, "versions": 0, "uniforms": 0.0}

    @classmethod
    def build(cls, rows: list[BatchRow], logits: torch.Tensor, cache, attention: torch.Tensor,
              eos_ids: list[int], engine_generator: torch.Generator,
              rope_deltas: torch.Tensor | None = None) -> DecodeBatch:
        """The batch of freshly prefilled `rows`: [N, V] logits, [N, P] attention of their prompts, and for a
        multimodal rotary model the [N] rope deltas of their prefill (`rollflow.models.vision_inputs`)."""
        device = logits.device
        stops = [sorted(set(eos_ids) | set(row.params.stop_token_ids)) for row in rows]
        stop_ids = torch.full((len(rows), max(1, max(len(s) for s in stops))), -1, dtype=torch.long)
        for i, ids in enumerate(stops):
            stop_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        temperatures = torch.tensor([row.params.temperature for row in rows], device=device)
        limits = torch.tensor([row.params.max_new_tokens for row in rows], device=device)
        width = int(limits.max()) + 1  # + the scratch column
        batch = cls(rows=rows, cache=cache, mergeable=is_mergeable(cache),
                    logits=logits, last_tokens=torch.zeros(len(rows), dtype=torch.long, device=device),
                    attention=attention, positions=attention.sum(1),
                    rope_deltas=(torch.zeros(len(rows), dtype=torch.long, device=device) if rope_deltas is None
                                 else rope_deltas.to(device)),
                    lengths=torch.zeros(len(rows), dtype=torch.long, device=device),
                    active=torch.ones(len(rows), dtype=torch.bool, device=device),
                    temperatures=torch.where(temperatures == 0, torch.ones_like(temperatures), temperatures),
                    greedy=temperatures == 0, limits=limits,
                    min_tokens=torch.tensor([row.params.min_new_tokens for row in rows], device=device),
                    stop_ids=stop_ids.to(device),
                    tokens=torch.zeros(len(rows), width, dtype=torch.long, device=device),
                    logprobs=torch.zeros(len(rows), width, device=device),
                    versions=torch.zeros(len(rows), width, dtype=torch.long, device=device),
                    uniforms=None, running=len(rows))
        batch.refresh_flags()
        if batch.any_seeded:
            batch.uniforms = _row_uniforms(rows, width, engine_generator)
        return batch

    def refresh_flags(self) -> None:
        """Batch-wide facts sampling branches on, computed once per batch change instead of per token."""
        self.params = [row.params for row in self.rows]
        self.all_greedy = all(p.temperature == 0 for p in self.params)
        self.needs_filter = any(p.top_k > 0 or p.top_p < 1.0 for p in self.params)
        self.any_seeded = any(row.generator is not None for row in self.rows)
        self.any_min_tokens = any(p.min_new_tokens > 0 for p in self.params)
        if not self.any_seeded:
            self.uniforms = None

    def record(self, tokens: torch.Tensor, logprobs: torch.Tensor, version: int) -> None:
        """Write each row's sampled token ([B]), its logprob ([B]) and `version` at the row's own position."""
        index = (torch.arange(len(self.rows), device=tokens.device), self.lengths)
        self.tokens[index] = tokens
        self.logprobs[index] = logprobs
        self.versions[index] = version
        self.lengths += self.active
        self.last_tokens = tokens

    def row_kv(self, i: int) -> list[LayerKV]:
        """Row `i`'s keys and values in the `T` cache columns it attends to: per layer
        [KV heads, T, head dim]."""
        return row_kv(self.cache, self.attention, i)

    def select(self, keep: torch.Tensor) -> None:
        """Keep only batch rows `keep` ([B'] indices), and drop cache columns no kept row attends to."""
        self.rows = [self.rows[i] for i in keep.tolist()]
        for name in self.ROW_TENSORS + tuple(self.RIGHT_PADDED):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[keep])
        self.attention = select_rows(self.cache, self.attention, keep, drop_columns=self.mergeable)
        self.running = int(self.active.sum())
        self.refresh_flags()

    def merge(self, joining: DecodeBatch, engine_generator: torch.Generator) -> None:
        """Add the rows of `joining` (freshly prefilled) to this batch, dropping its finished rows.

        The shorter of the two caches is left-padded to the longer one's width `L` (masked columns), so
        every row's last cache column is column `L - 1` and the next token of every row goes to column `L`.
        """
        if self.running < len(self.rows):
            self.select(torch.nonzero(self.active).flatten())
        if self.any_seeded != joining.any_seeded:  # every row of a batch with a seeded row needs uniforms
            unseeded = joining if self.any_seeded else self
            unseeded.uniforms = _row_uniforms(unseeded.rows, unseeded.tokens.shape[1], engine_generator)
        for name, value in self.RIGHT_PADDED.items():
            ours, theirs = getattr(self, name), getattr(joining, name)
            if ours is not None:
                width = max(ours.shape[1], theirs.shape[1])
                setattr(self, name, torch.cat([pad_right(ours, width, value), pad_right(theirs, width, value)]))
        for name in self.ROW_TENSORS:
            setattr(self, name, torch.cat([getattr(self, name), getattr(joining, name)]))
        self.attention = concat_left_padded(self.cache, self.attention, joining.cache, joining.attention)
        self.rows = self.rows + joining.rows
        self.running += joining.running
        self.refresh_flags()


def _row_uniforms(rows: list[BatchRow], width: int, engine_generator: torch.Generator) -> torch.Tensor:
    """[N, width] sampling uniforms of `rows` (`sampling.draw_uniforms`)."""
    return draw_uniforms([row.params.max_new_tokens for row in rows], [row.generator for row in rows], width,
                         engine_generator)


def is_mergeable(cache) -> bool:
    """Whether `cache`'s rows can be padded and concatenated: every layer is a plain full-attention one
    holding its own keys / values (no sliding window, linear attention or layers sharing another layer's
    cache)."""
    return all(type(layer) is DynamicLayer and layer.is_initialized for layer in cache.layers)


def repeat_requests(cache, logits: torch.Tensor, attention: torch.Tensor,
                    samples: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Give each of the `n` samples of a request its own row of the prefill it shares with the others.

    Row `i` of `cache` (in place), `logits` ([R, V]) and `attention` ([R, P]) is request `i`'s prompt,
    prefilled once; it is repeated `samples[i]` times, so the samples of a request are consecutive rows.

    Returns:
        logits [N, V] and attention [N, P], N = sum(samples) (the inputs themselves when every n is 1).
    """
    if len(samples) == sum(samples):
        return logits, attention
    request_of_row = torch.tensor([i for i, n in enumerate(samples) for _ in range(n)],
                                  device=logits.device)  # [N]
    cache.batch_select_indices(request_of_row)
    return logits[request_of_row], attention[request_of_row]  # [N, V], [N, P]


def row_kv(cache, attention: torch.Tensor, i: int) -> list[LayerKV]:
    """Row `i`'s keys and values in the `T` cache columns it attends to (`attention` [B, L] is 1 there):
    per layer [KV heads, T, head dim]."""
    columns = torch.nonzero(attention[i]).flatten()  # [T]
    return [(layer.keys[i].index_select(1, columns), layer.values[i].index_select(1, columns))
            for layer in cache.layers]


def select_rows(cache, attention: torch.Tensor, keep: torch.Tensor, drop_columns: bool) -> torch.Tensor:
    """Keep rows `keep` ([B'] indices) of `cache` (in place) and of `attention` ([B, L]); with
    `drop_columns` (a mergeable cache), also drop the leading columns no kept row attends to.

    Returns:
        the kept rows' attention, [B', L - dropped columns].
    """
    cache.batch_select_indices(keep)
    attention = attention[keep]  # [B', L]
    if drop_columns:
        start = int(torch.nonzero(attention.any(0))[0])  # first column a row attends to
        if start:
            attention = attention[:, start:]  # [B', L - start]
            map_cache(cache, lambda states: states[:, :, start:])
    return attention


def concat_left_padded(cache, attention: torch.Tensor, joining_cache,
                       joining_attention: torch.Tensor) -> torch.Tensor:
    """Append the rows of `joining_cache` to `cache` (in place), the narrower one left-padded with zeros.

    Both caches must be mergeable (`is_mergeable`). `attention` ([B, L]) and `joining_attention` ([J, L'])
    are left-padded the same way (masked columns).

    Returns:
        the attention of every row, [B + J, max(L, L')].
    """
    length = max(attention.shape[1], joining_attention.shape[1])
    attention = torch.cat([pad_left(attention, length), pad_left(joining_attention, length)])
    for ours, theirs in zip(cache.layers, joining_cache.layers):
        ours.keys = torch.cat([pad_left(ours.keys, length), pad_left(theirs.keys, length)])
        ours.values = torch.cat([pad_left(ours.values, length), pad_left(theirs.values, length)])
    return attention


def pad_left(states: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad dim 2 of keys / values ([B, H, L, D]) or dim 1 of a mask ([B, L]) on the left to `length`."""
    dim = 2 if states.dim() == 4 else 1
    missing = length - states.shape[dim]
    if not missing:
        return states
    shape = list(states.shape)
    shape[dim] = missing
    return torch.cat([states.new_zeros(shape), states], dim=dim)


def pad_right(buffer: torch.Tensor, width: int, value: float) -> torch.Tensor:
    """Pad a [B, W] buffer on the right with `value` to `width` columns."""
    if buffer.shape[1] == width:
        return buffer
    return torch.nn.functional.pad(buffer, (0, width - buffer.shape[1]), value=value)


def map_cache(cache, transform) -> None:
    """Replace every layer's keys and values ([B, KV heads, L, head dim]) with `transform` of them."""
    for layer in cache.layers:
        layer.keys, layer.values = transform(layer.keys), transform(layer.values)
