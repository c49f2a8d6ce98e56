"""Prefix KV cache of the `hf` engine: the KV of finished sequences, reused by prompts that extend them.

Multi-turn rollouts send, turn after turn, a prompt that is the previous request's prompt + its completion
+ a few new observation tokens. The engine keeps the KV cache of every finished single-sample sequence
(`PrefixCache.insert`) and, when a request is admitted, prefills only the part of its prompt past the
longest cached prefix (`PrefixCache.lookup`, `with_prefixes`).

Which positions have KV: a sequence that finished after sampling `k` tokens fed only its first `k - 1`
to the model, so its cache holds `prompt + tokens[:k - 1]`; that is the key it is stored under. A prompt
reuses the longest common prefix it shares with any entry (a partial match of an entry is as exact as a
whole one: causal attention makes position `j`'s KV depend on tokens `0..j` only), but never all of
itself: at least its last token is prefilled, for the logits of the first sample.

Entries are held on the model's device, as many tokens in all as `max_tokens` (least recently used
evicted first); an entry that is a prefix of a newer one is dropped (the newer one serves every lookup
it would). The KV is valid only for the weights that computed it: the engine calls `clear()` whenever
the weights change, and inserts a sequence only if the cache was not cleared since it was admitted
(`epoch`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice

import torch
from transformers.cache_utils import DynamicCache

LayerKV = tuple[torch.Tensor, torch.Tensor]  # one layer's keys, values: [KV heads, T, head dim]


@dataclass(frozen=True)
class PrefixHit:
    """The first `length` tokens of a prompt and their KV: per layer [KV heads, length, head dim]."""

    length: int
    layers: list[LayerKV]


@dataclass(eq=False)
class _Entry:
    token_ids: tuple[int, ...]  # the tokens whose KV `layers` holds, one column each
    layers: list[LayerKV]


class _Node:
    """A trie node: the token path from the root spells a prefix of `count` entries (one may end here)."""

    __slots__ = ("children", "count", "entry")

    def __init__(self):
        self.children: dict[int, _Node] = {}
        self.count = 0
        self.entry: _Entry | None = None


class PrefixCache:
    """LRU cache of per-sequence KV, looked up by longest common token prefix (a token trie).

    Args:
        max_tokens: most tokens held in all entries together (memory: `max_tokens` x the model's KV bytes
            per token); 0 turns the cache off.

    `stats`: `lookups` (prompts looked up), `hits` (prompts that reused a prefix), `reused_tokens` (prompt
    tokens not prefilled), `invalidations` (`clear()` calls).
    """

    def __init__(self, max_tokens: int = 0):
        if max_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.epoch = 0  # bumped by clear(): sequences admitted before it hold stale KV
        self.cached_tokens = 0
        self._root = _Node()
        self._lru: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()  # least recently used first
        self.stats = {"lookups": 0, "hits": 0, "reused_tokens": 0, "invalidations": 0}

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def __len__(self) -> int:
        return len(self._lru)

    def lookup(self, prompt: list[int]) -> PrefixHit | None:
        """The longest cached prefix of `prompt` that leaves at least its last token to prefill, or None."""
        if not self.enabled:
            return None
        self.stats["lookups"] += 1
        node, length = self._root, 0
        for token in islice(prompt, max(len(prompt) - 1, 0)):
            child = node.children.get(token)
            if child is None:
                break
            node, length = child, length + 1
        if not length:
            return None
        entry = _entry_below(node)  # it shares these `length` tokens with the prompt
        self._lru.move_to_end(entry.token_ids)
        self.stats["hits"] += 1
        self.stats["reused_tokens"] += length
        return PrefixHit(length, [(keys[:, :length], values[:, :length]) for keys, values in entry.layers])

    def insert(self, token_ids: list[int], kv: Callable[[], list[LayerKV]]) -> None:
        """Keep `kv()` (per layer [KV heads, T, head dim]), the KV of exactly the `T` tokens `token_ids`.

        Nothing new is kept (and `kv` is not called) when the sequence alone exceeds `max_tokens` or is a
        prefix of an entry already held (that entry counts as used); entries that are prefixes of it are
        dropped, then the least recently used ones until all fit.
        """
        if not self.enabled or not token_ids or len(token_ids) > self.max_tokens:
            return
        path = [self._root]
        for token in token_ids:
            path.append(path[-1].children.setdefault(token, _Node()))
        end = path[-1]
        if end.children or end.entry is not None:  # the whole path existed: nothing was added
            self._lru.move_to_end(_entry_below(end).token_ids)
            return
        layers = kv()
        if any(keys.shape[1] != len(token_ids) for keys, _ in layers):
            self._prune(token_ids)
            raise ValueError(f"KV of {layers[0][0].shape[1]} positions for {len(token_ids)} tokens")
        covered = [node.entry for node in path[1:-1] if node.entry is not None]  # prefixes of the new one
        end.entry = _Entry(tuple(token_ids), layers)
        for node in path[1:]:
            node.count += 1
        self._lru[end.entry.token_ids] = end.entry
        self.cached_tokens += len(token_ids)
        for entry in covered:
            self._remove(entry)
        while self.cached_tokens > self.max_tokens:
            self._remove(next(iter(self._lru.values())))

    def clear(self) -> None:
        """Drop every entry (the weights changed, or memory is released) and start a new epoch."""
        self._root, self._lru, self.cached_tokens = _Node(), OrderedDict(), 0
        self.epoch += 1
        self.stats["invalidations"] += 1

    def _remove(self, entry: _Entry) -> None:
        del self._lru[entry.token_ids]
        self.cached_tokens -= len(entry.token_ids)
        node = self._root
        for token in entry.token_ids:
            child = node.children[token]
            child.count -= 1
            if not child.count:  # no other entry passes here: cut the rest of the path
                del node.children[token]
                return
            node = child
        node.entry = None

    def _prune(self, token_ids) -> None:
        """Cut the path of `token_ids` where no entry passes any more (nodes an aborted insert added)."""
        node = self._root
        for token in token_ids:
            child = node.children.get(token)
            if child is None:
                return
            if not child.count:
                del node.children[token]
                return
            node = child


def _entry_below(node: _Node) -> _Entry:
    """An entry whose path passes through `node` (a node on some entry's path; every leaf ends one)."""
    while node.entry is None:
        node = next(iter(node.children.values()))
    return node.entry


def with_prefixes(hits: list[PrefixHit | None], attention: torch.Tensor,
                  ) -> tuple[torch.Tensor, torch.Tensor, DynamicCache | None]:
    """The attention mask, position ids and cache that prefill new tokens on top of cached prefixes.

    Row `i` reuses `r_i = hits[i].length` tokens (0 without a hit); `attention` ([A, S]) is the mask of
    its other tokens, left-padded to the `S` input columns. The prefixes are left-padded to `R = max r_i`
    cache columns, so a row's columns read: padding, its prefix, padding, its new tokens (masked columns
    hold zeros or the KV of padding and are never attended to). Position ids continue from each row's
    prefix: `r_i, ..., r_i + s_i - 1`.

    Returns:
        attention mask [A, R + S] (the cache's columns after the forward), position ids [A, S], and the
        prefix cache (per layer [A, KV heads, R, head dim]; None when no row has a hit, and then R = 0).
    """
    reused = [hit.length if hit else 0 for hit in hits]
    positions = (torch.tensor(reused, device=attention.device).unsqueeze(1)
                 + (attention.cumsum(1) - 1).clamp(min=0))  # [A, S]
    width = max(reused)
    if not width:
        return attention, positions, None
    prefix_attention = torch.zeros(len(hits), width, dtype=attention.dtype, device=attention.device)  # [A, R]
    for i, length in enumerate(reused):
        prefix_attention[i, width - length:] = 1
    layers = []
    for layer, (keys, values) in enumerate(next(hit for hit in hits if hit).layers):
        shape = (len(hits), keys.shape[0], width, keys.shape[2])
        all_keys, all_values = keys.new_zeros(shape), values.new_zeros(shape)  # [A, KV heads, R, head dim]
        for i, hit in enumerate(hits):
            if hit:
                all_keys[i, :, width - hit.length:] = hit.layers[layer][0]
                all_values[i, :, width - hit.length:] = hit.layers[layer][1]
        layers.append((all_keys, all_values))
    return torch.cat([prefix_attention, attention], dim=1), positions, DynamicCache(layers)
