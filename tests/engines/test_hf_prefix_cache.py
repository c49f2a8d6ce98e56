"""The `hf` engine's prefix KV cache: multi-turn prompts reuse the KV of the previous turn's sequence and
sample exactly what a full prefill does."""

import asyncio

import pytest
import torch

from rollflow.engines.base import GenerationRequest, SamplingParams
from rollflow.engines.hf import HFEngine
from rollflow.engines.prefix_cache import PrefixCache

FIRST_PROMPTS = [[3, 20, 21, 5], [3, 22, 5], [3, 23, 24, 25, 26, 5], [3, 27, 28, 5]]
OBSERVATIONS = [[40, 41, 42], [43, 44], [45, 46, 47, 48]]  # appended after turn t's completion


def _engines(model_dir, cache_tokens=10_000):
    """(no cache, with cache), EOS ignored so every sample runs `max_new_tokens`; arrivals join a running
    batch at the next token (`admit_wait_steps=0`), so later turns join batches still decoding."""
    engines = (HFEngine(model_dir, seed=0, admit_wait_steps=0),
               HFEngine(model_dir, seed=1, prefix_cache_tokens=cache_tokens, admit_wait_steps=0))
    for engine in engines:
        engine.eos_ids = []
    return engines


async def _conversation(engine, index, params, turns=3):
    """`turns` requests, each prompt the previous prompt + its completion + an observation."""
    prompt, completions = list(FIRST_PROMPTS[index]), []
    for turn in range(turns):
        request = GenerationRequest(f"c{index}t{turn}", list(prompt), params)
        completions.append(await asyncio.wait_for(engine.generate(request), timeout=30))
        prompt = prompt + completions[-1].outputs[0].token_ids + OBSERVATIONS[turn]
    return completions


def _assert_same_samples(expected, actual):
    for a, b in zip(expected, actual, strict=True):
        for out_a, out_b in zip(a.outputs, b.outputs, strict=True):
            assert out_a.token_ids == out_b.token_ids
            assert max(abs(x - y) for x, y in zip(out_a.logprobs, out_b.logprobs)) < 1e-5


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_conversation_reusing_the_previous_turns_kv_samples_what_full_prefills_do(random_model_dir,
                                                                                     temperature):
    """Turn t > 0 prefills only the previous turn's last sampled token (whose KV was never computed) and
    the observation; tokens and logprobs equal those of a full prefill."""
    off, on = _engines(random_model_dir)
    params = SamplingParams(max_new_tokens=5, temperature=temperature, seed=7)
    expected = asyncio.run(_conversation(off, 0, params))
    actual = asyncio.run(_conversation(on, 0, params))
    _assert_same_samples(expected, actual)
    # Turn 1's prompt: 4 + 5 + 3 tokens, of which 4 + 4 reused; turn 2's: 12 + 5 + 2, 12 + 4 reused.
    assert [c.metadata["prefix_reused_tokens"] for c in actual] == [0, 8, 16]
    assert [c.metadata["prefill_tokens"] for c in actual] == [4, 4, 3]
    assert [c.metadata["prefix_reused_tokens"] for c in expected] == [0, 0, 0]
    stats = on.prefix_cache_stats()
    assert (stats["prefilled_tokens"], stats["reused_tokens"]) == (4 + 4 + 3, 8 + 16)
    assert (stats["hits"], stats["lookups"]) == (2, 3)
    # One entry: each turn's sequence extends the previous one, which it replaces (4+5+3+5+2+5-1 tokens).
    assert (stats["entries"], stats["cached_tokens"]) == (1, 23)
    assert off.prefix_cache_stats()["prefilled_tokens"] == 4 + 12 + 19


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_interleaved_conversations_join_the_running_batch_with_their_prefixes(random_model_dir, temperature):
    """Four conversations with different answer lengths run concurrently: later turns join a batch that is
    still decoding other conversations (their prefix, padding and new tokens merged into it) and every
    sample equals the no-cache run's."""
    off, on = _engines(random_model_dir)

    async def all_conversations(engine):
        return await asyncio.gather(*[
            _conversation(engine, i, SamplingParams(max_new_tokens=limit, temperature=temperature, seed=i))
            for i, limit in enumerate((2, 6, 3, 5))])

    expected, actual = asyncio.run(all_conversations(off)), asyncio.run(all_conversations(on))
    for a, b in zip(expected, actual):
        _assert_same_samples(a, b)
    assert on.stats["waves"] < on.stats["prefills"]  # some turns joined a running batch
    stats = on.prefix_cache_stats()
    assert stats["hits"] == 8 and stats["entries"] == 4
    assert stats["prefilled_tokens"] + stats["reused_tokens"] == off.prefix_cache_stats()["prefilled_tokens"]


def test_prompts_with_nothing_new_or_mixed_hits_and_samples_sharing_a_prefix_match_full_prefills(
        random_model_dir):
    """A prompt that is exactly the cached sequence still prefills its last token; the first prompt again
    (a prefix of the entry) reuses all but its last token; another prompt reuses just the first token it
    shares, in the same forward; an n = 2 request reuses its prefix too and does not enter the cache."""
    off, on = _engines(random_model_dir)
    first = GenerationRequest("first", FIRST_PROMPTS[0], SamplingParams(max_new_tokens=5, temperature=0.0))

    async def main(engine):
        completion = await engine.generate(first)
        held = FIRST_PROMPTS[0] + completion.outputs[0].token_ids[:-1]  # what has KV: 8 tokens
        seeded = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3)
        requests = [GenerationRequest("held", held, seeded),
                    GenerationRequest("first_again", FIRST_PROMPTS[0], seeded),
                    GenerationRequest("fresh", FIRST_PROMPTS[1], seeded),
                    GenerationRequest("group", held + [50, 51],
                                      SamplingParams(max_new_tokens=4, n=2, seed=4))]
        later = await asyncio.wait_for(asyncio.gather(*[engine.generate(r) for r in requests]), timeout=30)
        return [completion, *later]

    expected, actual = asyncio.run(main(off)), asyncio.run(main(on))
    _assert_same_samples(expected, actual)
    assert [c.metadata["prefix_reused_tokens"] for c in actual] == [0, 7, 3, 1, 8]
    assert [c.metadata["prefill_tokens"] for c in actual] == [4, 1, 1, 2, 2]
    assert on.stats["prefills"] == 2  # the four later requests were prefilled together
    # "held" replaces the entry it extends; "fresh" and "first_again" add theirs; the group adds none.
    assert sorted(len(e) for e in on.prefix_cache._lru) == [3 + 4 - 1, 4 + 4 - 1, 8 + 4 - 1]


def test_update_weights_sleep_and_close_empty_the_cache_and_stale_sequences_never_enter(random_model_dir):
    _, engine = _engines(random_model_dir)
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    asyncio.run(_conversation(engine, 0, params, turns=2))
    assert engine.prefix_cache_stats()["reused_tokens"] == 8 and len(engine.prefix_cache) == 1
    weights = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    engine.update_weights(weights, version=1)
    assert len(engine.prefix_cache) == 0 and engine.prefix_cache_stats()["invalidations"] == 1
    completions = asyncio.run(_conversation(engine, 0, params, turns=2))
    assert [c.metadata["prefix_reused_tokens"] for c in completions] == [0, 8]  # turn 0 starts afresh

    async def update_mid_generation():  # this sequence's KV mixes two weight versions: it stays out
        task = asyncio.ensure_future(engine.generate(GenerationRequest("r", FIRST_PROMPTS[2], params)))
        while engine.stats["tokens"] < before + 2:
            await asyncio.sleep(0)
        engine.update_weights(weights, version=2)
        return await asyncio.wait_for(task, timeout=30)

    before = engine.stats["tokens"]
    asyncio.run(update_mid_generation())
    assert len(engine.prefix_cache) == 0
    asyncio.run(_conversation(engine, 1, params, turns=1))
    assert len(engine.prefix_cache) == 1
    engine.sleep()
    assert len(engine.prefix_cache) == 0
    engine.wake()
    asyncio.run(_conversation(engine, 1, params, turns=1))
    engine.close()
    assert len(engine.prefix_cache) == 0


def test_the_engine_keeps_at_most_prefix_cache_tokens(random_model_dir):
    """Entries of 4 + 8 - 1 = 11 tokens with room for 20: each new one evicts the previous."""
    _, engine = _engines(random_model_dir, cache_tokens=20)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    for index in (0, 1, 3):
        asyncio.run(_conversation(engine, index, params, turns=1))
        assert engine.prefix_cache.cached_tokens <= 20 and len(engine.prefix_cache) == 1


# ---- the cache itself ----------------------------------------------------------------------------------
def _kv(token_ids):
    """A callable giving one layer's fake KV whose column j holds token j's id: [1 KV head, T, 1]."""
    column = torch.tensor(token_ids, dtype=torch.float32).reshape(1, -1, 1)
    return lambda: [(column, -column)]


def _reused(cache, prompt):
    hit = cache.lookup(prompt)
    if hit is None:
        return None
    keys, values = hit.layers[0]
    assert keys.flatten().tolist() == prompt[:hit.length] and torch.equal(values, -keys)
    return hit.length


def test_lookup_takes_the_longest_common_prefix_and_leaves_a_token_to_prefill():
    cache = PrefixCache(max_tokens=100)
    cache.insert([1, 2, 3, 4], _kv([1, 2, 3, 4]))
    cache.insert([1, 2, 7], _kv([1, 2, 7]))
    assert _reused(cache, [1, 2, 3, 4, 5]) == 4  # a whole entry
    assert _reused(cache, [1, 2, 3, 9]) == 3  # part of one
    assert _reused(cache, [1, 2, 7, 8]) == 3
    assert _reused(cache, [1, 2, 3, 4]) == 3  # exactly an entry: its last token is prefilled again
    assert _reused(cache, [1]) is None and _reused(cache, [5, 1, 2]) is None and _reused(cache, []) is None
    assert cache.stats == {"lookups": 7, "hits": 4, "reused_tokens": 13, "invalidations": 0}
    with pytest.raises(ValueError, match="KV of 2 positions for 5 tokens"):
        cache.insert([1, 2, 3, 4, 5], _kv([1, 2]))
    assert _reused(cache, [1, 2, 3, 4, 5, 6]) == 4  # the refused entry left no trace
    cache.insert([1, 2, 3, 4], lambda: pytest.fail("held already: its KV is not copied"))
    assert PrefixCache(0).lookup([1, 2, 3]) is None and not PrefixCache(0).enabled


def test_insert_drops_prefixes_of_the_new_entry_then_the_least_recently_used_to_fit():
    cache = PrefixCache(max_tokens=10)
    cache.insert([1, 2], _kv([1, 2]))
    cache.insert([1, 2, 3, 4], _kv([1, 2, 3, 4]))  # [1, 2] is a prefix of it: dropped
    assert list(cache._lru) == [(1, 2, 3, 4)] and cache.cached_tokens == 4
    cache.insert([1, 2, 3], _kv([1, 2, 3]))  # a prefix of a held entry: nothing new
    cache.insert([5, 6, 7], _kv([5, 6, 7]))
    assert list(cache._lru) == [(1, 2, 3, 4), (5, 6, 7)] and cache.cached_tokens == 7
    assert _reused(cache, [1, 2, 9]) == 2  # [1, 2, 3, 4] is now the most recently used
    cache.insert([8, 9, 10, 11], _kv([8, 9, 10, 11]))  # 11 tokens > 10: the least recent, [5, 6, 7], goes
    assert list(cache._lru) == [(1, 2, 3, 4), (8, 9, 10, 11)] and cache.cached_tokens == 8
    assert _reused(cache, [5, 6, 7, 8]) is None and _reused(cache, [8, 9, 10, 11, 12]) == 4
    cache.insert(list(range(20, 31)), _kv(list(range(20, 31))))  # longer than the whole cache: not kept
    assert cache.cached_tokens == 8
    cache.insert([1, 2, 3, 5, 6, 7, 8], _kv([1, 2, 3, 5, 6, 7, 8]))  # shares [1, 2, 3]: evicts both others
    assert list(cache._lru) == [(1, 2, 3, 5, 6, 7, 8)] and cache.cached_tokens == 7
    assert _reused(cache, [1, 2, 3, 4, 5]) == 3  # the trie lost [1, 2, 3, 4]'s branch with it
    assert _reused(cache, [8, 9, 10]) is None
    epoch = cache.epoch
    cache.clear()
    assert cache.epoch == epoch + 1 and cache.cached_tokens == 0 and _reused(cache, [1, 2, 3, 4]) is None
