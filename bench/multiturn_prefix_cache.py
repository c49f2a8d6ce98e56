"""Multi-turn rollouts through the `hf` engine with its prefix KV cache off and on.

`--conversations` conversations run concurrently (one `asyncio.gather`), each `--turns` requests long: the
first prompt is a ~20-token task text, and every later prompt is the previous prompt + its completion +
`--observation-tokens` tokens of an observation text (the env's reply). Each turn samples exactly
`--new-tokens` tokens greedily (`min_new_tokens` keeps EOS out), so both runs do the same work and must
give the same tokens. The two runs alternate `--repeats` times on the bundled tiny model (one torch
thread) after a warm-up; the median wall time of each is reported.

Usage: python bench/multiturn_prefix_cache.py [--conversations 32] [--turns 6] [--observation-tokens 4]
       [--new-tokens 4] [--repeats 3]
Prints one JSON line: prompt tokens prefilled and reused, wall seconds, and the off / on ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from rollflow.engines.base import GenerationRequest, SamplingParams
from rollflow.engines.hf import HFEngine
from rollflow.models import load_tokenizer

MODEL = "rollflow/assets/tiny-qwen2-add"


def texts(model_path: str, conversations: int, turns: int, observation_tokens: int) -> tuple[list, list]:
    """Token ids of each conversation's first prompt (~20 tokens) and of its `turns - 1` observations."""
    tokenizer = load_tokenizer(model_path)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    firsts = [encode(f"Task {i}: add {i + 17} and {3 * i + 25} =") for i in range(conversations)]
    observations = [[(encode(f"obs {i}.{t}: result ok, next step please. ") * 4)[:observation_tokens]
                     for t in range(turns - 1)] for i in range(conversations)]
    return firsts, observations


async def conversation(engine: HFEngine, first: list[int], observations: list[list[int]], turns: int,
                       params: SamplingParams, tag: str) -> list[list[int]]:
    """The token ids sampled at each turn of one conversation."""
    prompt, answers = list(first), []
    for turn in range(turns):
        request = GenerationRequest(f"{tag}-t{turn}", list(prompt), params)
        completion = await asyncio.wait_for(engine.generate(request), timeout=600)
        answers.append(completion.outputs[0].token_ids)
        if turn + 1 < turns:
            prompt = prompt + answers[-1] + observations[turn]
    return answers


def run(engine: HFEngine, firsts, observations, turns: int, new_tokens: int) -> tuple[list, float, dict]:
    """All conversations at once. Returns (answers, wall seconds, the prefill counts this run added)."""
    params = SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens, temperature=0.0)
    before = engine.prefix_cache_stats()

    async def main():
        return await asyncio.gather(*[conversation(engine, first, obs, turns, params, f"c{i}")
                                      for i, (first, obs) in enumerate(zip(firsts, observations))])

    start = time.perf_counter()
    answers = asyncio.run(main())
    seconds = time.perf_counter() - start
    after = engine.prefix_cache_stats()
    engine.prefix_cache.clear()  # every repeat starts cold, like a new rollout step after a weight update
    return answers, seconds, {k: after[k] - before[k] for k in ("prefilled_tokens", "reused_tokens", "hits")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--observation-tokens", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-tokens", type=int, default=1_000_000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    firsts, observations = texts(args.model, args.conversations, args.turns, args.observation_tokens)
    engines = {"off": HFEngine(args.model), "on": HFEngine(args.model, prefix_cache_tokens=args.cache_tokens)}
    for engine in engines.values():  # warm-up
        run(engine, firsts[:2], observations[:2], 2, args.new_tokens)
    seconds = {name: [] for name in engines}
    answers, counts = {}, {}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            answers[name], wall, counts[name] = run(engine, firsts, observations, args.turns, args.new_tokens)
            seconds[name].append(wall)
    wall = {name: statistics.median(values) for name, values in seconds.items()}
    off, on = counts["off"], counts["on"]
    print(json.dumps({
        "conversations": args.conversations, "turns": args.turns, "new_tokens": args.new_tokens,
        "observation_tokens": args.observation_tokens,
        "first_prompt_tokens": statistics.mean(len(f) for f in firsts),
        "prefilled_tokens_off": off["prefilled_tokens"], "prefilled_tokens_on": on["prefilled_tokens"],
        "reused_tokens_on": on["reused_tokens"], "hits_on": on["hits"],
        "prefill_ratio_off_over_on": round(off["prefilled_tokens"] / on["prefilled_tokens"], 2),
        "wall_s_off": round(wall["off"], 3), "wall_s_on": round(wall["on"], 3),
        "wall_ratio_off_over_on": round(wall["off"] / wall["on"], 3),
        "wall_s_all_off": [round(s, 3) for s in seconds["off"]],
        "wall_s_all_on": [round(s, 3) for s in seconds["on"]],
        "same_tokens": answers["off"] == answers["on"], "threads": 1, "repeats": args.repeats,
    }))


if __name__ == "__main__":
    main()
