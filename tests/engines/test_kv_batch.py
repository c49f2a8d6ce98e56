"""KV-cache surgery of the `hf` engine's decode batch (`kv_batch.py`) on tiny hand-written caches.

A cache here has one layer, one KV head and head dim 1, so a row's keys read as a list: key = token value,
value = key + 100. Padding columns are zeros.
"""

from types import SimpleNamespace

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from rollflow.engines.base import SamplingParams
from rollflow.engines.kv_batch import (
    DecodeBatch,
    concat_left_padded,
    is_mergeable,
    pad_left,
    pad_right,
    repeat_requests,
    row_kv,
    select_rows,
)


def _cache(*rows: list[float]) -> DynamicCache:
    """One layer; row `i`'s keys are `rows[i]` ([B, 1 head, L, 1]), its values the keys + 100."""
    keys = torch.tensor(rows, dtype=torch.float32)[:, None, :, None]  # [B, 1, L, 1]
    return DynamicCache([(keys, keys + 100)])


def _keys(cache) -> list[list[float]]:
    return cache.layers[0].keys[:, 0, :, 0].tolist()  # [B, L]


def test_pad_left_and_right():
    mask = torch.tensor([[1, 1]])
    assert pad_left(mask, 4).tolist() == [[0, 0, 1, 1]]
    assert pad_left(mask, 2) is mask
    keys = torch.ones(1, 1, 2, 1)  # [B, H, L, D]: padded along L
    assert pad_left(keys, 3)[0, 0, :, 0].tolist() == [0.0, 1.0, 1.0]
    assert pad_right(torch.tensor([[5, 6]]), 4, -1).tolist() == [[5, 6, -1, -1]]


def test_repeat_requests_gives_each_sample_a_row_of_its_prompt():
    # Requests 0 (n = 2) and 1 (n = 1): rows [0, 0, 1] of the prefill.
    cache = _cache([1, 2], [3, 4])
    logits, attention = torch.tensor([[0.5], [0.25]]), torch.tensor([[1, 1], [0, 1]])
    logits, attention = repeat_requests(cache, logits, attention, [2, 1])
    assert _keys(cache) == [[1, 2], [1, 2], [3, 4]]
    assert logits.tolist() == [[0.5], [0.5], [0.25]]
    assert attention.tolist() == [[1, 1], [1, 1], [0, 1]]
    # Every n = 1: nothing to repeat, the inputs come back.
    single = _cache([1, 2])
    one_logits, one_attention = logits[:1], attention[:1]
    same_logits, same_attention = repeat_requests(single, one_logits, one_attention, [1])
    assert same_logits is one_logits and same_attention is one_attention
    assert _keys(single) == [[1, 2]]


def test_concat_left_pads_the_narrower_cache_and_rows_keep_their_kv():
    # Running: one row with 3 columns. Joining: two rows with 2 columns, the second a 1-token prompt
    # left-padded (its column 0 masked). Joined rows get one more masked column on the left.
    cache, attention = _cache([1, 2, 3]), torch.tensor([[1, 1, 1]])
    joining, joining_attention = _cache([7, 8], [0, 9]), torch.tensor([[1, 1], [0, 1]])
    attention = concat_left_padded(cache, attention, joining, joining_attention)
    assert attention.tolist() == [[1, 1, 1], [0, 1, 1], [0, 0, 1]]
    assert _keys(cache) == [[1, 2, 3], [0, 7, 8], [0, 0, 9]]
    # Values move with their keys; column 1 of row 2 is its prompt's padding (value 0 + 100), still masked.
    assert cache.layers[0].values[:, 0, :, 0].tolist() == [[101, 102, 103], [0, 107, 108], [0, 100, 109]]
    # A row's KV is what it attends to: [KV heads, T, head dim].
    assert [row_kv(cache, attention, i)[0][0][0, :, 0].tolist() for i in range(3)] == [[1, 2, 3], [7, 8], [9]]
    assert row_kv(cache, attention, 1)[0][1][0, :, 0].tolist() == [107, 108]


def test_select_rows_drops_the_leading_columns_no_kept_row_attends_to():
    attention = torch.tensor([[1, 1, 1], [0, 1, 1], [0, 0, 1]])
    cache = _cache([1, 2, 3], [0, 7, 8], [0, 0, 9])
    kept = select_rows(cache, attention, torch.tensor([2, 1]), drop_columns=True)
    # Rows 2 and 1 (in that order) attend from column 1 on: column 0 goes.
    assert kept.tolist() == [[0, 1], [1, 1]]
    assert _keys(cache) == [[0, 9], [7, 8]]
    # Without dropping (a cache whose layers cannot be sliced), the columns stay.
    cache = _cache([1, 2, 3], [0, 7, 8], [0, 0, 9])
    kept = select_rows(cache, attention, torch.tensor([2]), drop_columns=False)
    assert kept.tolist() == [[0, 0, 1]] and _keys(cache) == [[0, 0, 9]]


def test_only_plain_full_attention_layers_are_mergeable():
    assert is_mergeable(_cache([1, 2]))
    sliding = _cache([1, 2])
    sliding.layers[0] = DynamicSlidingWindowLayer(sliding_window=4)
    assert not is_mergeable(sliding)
    empty = _cache([1, 2])
    empty.layers[0] = DynamicLayer()  # never filled
    assert not is_mergeable(empty)


def _row(max_new_tokens, seed=None, **params):
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return SimpleNamespace(params=SamplingParams(max_new_tokens=max_new_tokens, **params), generator=generator)


def test_a_batch_merges_rows_then_drops_the_finished_ones():
    engine_generator = torch.Generator().manual_seed(0)
    running = DecodeBatch.build([_row(2), _row(3, temperature=0)], torch.zeros(2, 5), _cache([1, 2], [0, 3]),
                                torch.tensor([[1, 1], [0, 1]]), eos_ids=[4], engine_generator=engine_generator)
    # Buffers are max_new_tokens + 1 scratch column wide; greedy rows carry temperature 1.
    assert running.tokens.shape == (2, 4) and running.uniforms is None
    assert running.temperatures.tolist() == [1.0, 1.0] and running.greedy.tolist() == [False, True]
    assert running.stop_ids.tolist() == [[4], [4]] and running.positions.tolist() == [2, 1]
    running.active[0] = False  # row 0 finished
    running.running = 1

    joining = DecodeBatch.build([_row(5, seed=3, stop_token_ids=(6, 2))], torch.ones(1, 5), _cache([7, 8, 9]),
                                torch.tensor([[1, 1, 1]]), eos_ids=[4], engine_generator=engine_generator)
    running.merge(joining, engine_generator)
    # The finished row left; the running row is left-padded to the joining row's 3 columns.
    assert running.attention.tolist() == [[0, 0, 1], [1, 1, 1]]
    assert _keys(running.cache) == [[0, 0, 3], [7, 8, 9]]
    assert running.running == 2 and running.any_seeded
    # Output buffers padded on the right to the wider width (6), stop ids with -1.
    assert running.tokens.shape == (2, 6)
    assert running.stop_ids.tolist() == [[4, -1, -1], [2, 4, 6]]
    # A seeded row joined: the running row gets uniforms too; the seeded row's are its seed's own draws.
    assert running.uniforms.shape == (2, 6)
    assert torch.equal(running.uniforms[1, :5], torch.rand(5, generator=torch.Generator().manual_seed(3)))
    assert [kv[0][0][0, :, 0].tolist() for kv in (running.row_kv(0), running.row_kv(1))] == [[3], [7, 8, 9]]
