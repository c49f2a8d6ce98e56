"""Multi-turn episodes through the `hf` engine, their requests arriving staggered or in lockstep (no Ray).

`--episodes` episodes of `--turns` turns each. A turn is one greedy request of exactly `--new-tokens`
tokens (`min_new_tokens` keeps EOS out, so every run does the same work and must give the same tokens),
then an env step that sleeps a log-normal delay (median `--median-s`, shape `--sigma`, drawn per episode
and turn from a seeded generator: the same draws in every run); the next prompt is the previous prompt +
its completion + `--observation-tokens` observation tokens. The defaults (a 13-token first prompt, 4 new
and 14 observation tokens a turn) match the 3x3 FrozenLake episodes of `bench/agentic_async.py`. `async`:
every episode loops on its own, so requests arrive one by one. `lockstep`: a turn's requests of all
episodes are submitted together, and the next turn starts once every episode's env step is done (the
synchronous baseline).

Each `--engine-kwargs` JSON dict builds one engine (default: `admit_wait_steps` 0, arrivals join at the
next token, against the engine's defaults). Per median, every engine runs both modes `--repeats` times,
interleaved, after a warm-up, on the bundled tiny model with one torch thread. Each run starts with an
empty prefix cache and a frozen garbage collector (`gc.freeze()`: a full collection over the ~400k objects
torch and transformers hold takes ~0.3 s and would land in a random run).

Usage: python bench/engine_staggered.py [--episodes 64] [--turns 6] [--median-s 0.001 0.02] [--sigma 1.0]
       [--repeats 3] [--engine-kwargs '{"admit_wait_steps": 0}' '{}']
Prints one JSON line per median and engine: median wall and CPU seconds of each mode, what the engine did
in the last run (forwards = prefills + decode steps; merges = admissions into a running batch), mean and
p90 request latency and queueing, the async / lockstep wall ratio, and whether every run gave the same
tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import random
import statistics
import time

import torch

from rollflow.engines.base import GenerationRequest, SamplingParams
from rollflow.engines.hf import HFEngine
from rollflow.models import load_tokenizer

MODEL = "rollflow/assets/tiny-qwen2-add"
MODES = ("lockstep", "async")


def texts(model_path: str, episodes: int, turns: int, prompt_tokens: int,
          observation_tokens: int) -> tuple[list, list]:
    """Token ids of each episode's first prompt and of its `turns - 1` observations."""
    tokenizer = load_tokenizer(model_path)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    firsts = [(encode(f"Episode {i}: reach the goal at {i % 7}, {i % 5}. PO_ ___ __G. ") * 8)[:prompt_tokens]
              for i in range(episodes)]
    observations = [[(encode(f"obs {i}.{t}: ok, moved. ") * 4)[:observation_tokens] for t in range(turns - 1)]
                    for i in range(episodes)]
    return firsts, observations


def latencies(episodes: int, turns: int, median_s: float, sigma: float, seed: int = 0) -> list[list[float]]:
    """Env step delays [episode][turn]: log-normal with median `median_s` and shape `sigma`."""
    rng = random.Random(seed)
    return [[median_s * math.exp(sigma * rng.gauss(0.0, 1.0)) for _ in range(turns)] for _ in range(episodes)]


async def episode(engine: HFEngine, first: list[int], observations: list[list[int]], delays: list[float],
                  params: SamplingParams, tag: str, barrier: asyncio.Barrier | None,
                  metadata: list[dict]) -> list[list[int]]:
    """The tokens sampled at each turn of one episode; appends each completion's metadata to `metadata`."""
    prompt, answers = list(first), []
    for turn, delay in enumerate(delays):
        if barrier is not None:
            await barrier.wait()
        request = GenerationRequest(f"{tag}-t{turn}", list(prompt), params)
        completion = await asyncio.wait_for(engine.generate(request), timeout=600)
        answers.append(completion.outputs[0].token_ids)
        metadata.append(completion.metadata)
        await asyncio.sleep(delay)  # the env step
        if turn + 1 < len(delays):
            prompt = prompt + answers[-1] + observations[turn]
    return answers


def run(engine: HFEngine, firsts, observations, delays, new_tokens: int, lockstep: bool) -> tuple[list, dict]:
    """Every episode once. Returns (answers, wall and CPU seconds, latencies and what the engine did)."""
    params = SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens, temperature=0.0)
    engine.prefix_cache.clear()  # every run starts cold, like a rollout step after a weight update
    gc.collect()
    gc.freeze()
    before = dict(engine.stats)
    metadata: list[dict] = []

    async def main():
        barrier = asyncio.Barrier(len(firsts)) if lockstep else None
        return await asyncio.gather(*[episode(engine, first, obs, d, params, f"e{i}", barrier, metadata)
                                      for i, (first, obs, d) in enumerate(zip(firsts, observations, delays))])

    start, cpu = time.perf_counter(), time.process_time()
    answers = asyncio.run(main())
    result = {"wall_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu}
    done = {key: engine.stats[key] - before[key]
            for key in ("prefills", "waves", "decode_steps", "prefill_tokens")}
    seconds = [m["seconds"] for m in metadata]
    result.update({
        "forwards": done["prefills"] + done["decode_steps"], "prefills": done["prefills"],
        "merges": done["prefills"] - done["waves"], "decode_steps": done["decode_steps"],
        "prefill_tokens": done["prefill_tokens"],
        "request_mean_s": statistics.mean(seconds), "request_p90_s": statistics.quantiles(seconds, n=10)[-1],
        "queue_mean_s": statistics.mean(m["queue_seconds"] for m in metadata)})
    return answers, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=13)
    parser.add_argument("--observation-tokens", type=int, default=14)
    parser.add_argument("--median-s", type=float, nargs="+", default=[0.001, 0.02])
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine-kwargs", type=json.loads, nargs="+", default=[{"admit_wait_steps": 0}, {}])
    args = parser.parse_args()
    torch.set_num_threads(1)
    firsts, observations = texts(args.model, args.episodes, args.turns, args.prompt_tokens,
                                 args.observation_tokens)
    engines = [HFEngine(args.model, **kwargs) for kwargs in args.engine_kwargs]
    for engine in engines:  # warm-up
        run(engine, firsts[:4], observations[:4], latencies(4, 2, 0.001, 0.0), args.new_tokens, False)
    for median_s in args.median_s:
        delays = latencies(args.episodes, args.turns, median_s, args.sigma)
        runs = [{mode: [] for mode in MODES} for _ in engines]
        answers = []
        for _ in range(args.repeats):
            for engine, results in zip(engines, runs):
                for mode in MODES:
                    tokens, result = run(engine, firsts, observations, delays, args.new_tokens,
                                         mode == "lockstep")
                    results[mode].append(result)
                    answers.append(tokens)
        for kwargs, results in zip(args.engine_kwargs, runs):
            line = {"episodes": args.episodes, "turns": args.turns, "median_s": median_s, "sigma": args.sigma,
                    "engine_kwargs": kwargs, "repeats": args.repeats,
                    "prefill_tokens": results["async"][-1]["prefill_tokens"]}
            for mode in MODES:
                line[f"{mode}_wall_s"] = round(statistics.median(r["wall_s"] for r in results[mode]), 3)
                line[f"{mode}_cpu_s"] = round(statistics.median(r["cpu_s"] for r in results[mode]), 3)
                line[mode] = {key: round(value, 4) for key, value in results[mode][-1].items()
                              if key not in ("wall_s", "cpu_s")}
            line["async_over_lockstep_wall"] = round(line["async_wall_s"] / line["lockstep_wall_s"], 3)
            line["same_tokens"] = all(tokens == answers[0] for tokens in answers)
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
