"""hf engine decode throughput against transformers' `model.generate`, and continuous batching on a stream.

Both sides sample (temperature 1, no top-k / top-p) the same prompts in one batch of
`prompts x samples` sequences, with the same model (`generate` gets its own copy, with transformers'
default attention), max_new_tokens and one torch thread; a warm-up run
is excluded and the median of `--repeats` runs is reported. Only generated tokens are counted, the same
way on both sides: every token up to and including the first EOS (or up to max_new_tokens).

Two configs: the RL default of the bundled task (add2 prompts, 6 new tokens, EOS allowed) and a long one
(EOS ignored on both sides, so both produce exactly prompts x samples x long_tokens tokens). The long
config stays within the tiny model's 64 positions: 7 prompt tokens + 56 new ones.

A third scenario streams requests in: `--prompts` requests of `--samples` samples arriving one by one
(seeded Poisson arrivals, mean `--interval-ms` apart), a `--long-fraction` of them forced 8x longer
(`min_new_tokens = max_new_tokens = 8 x --tokens`, the long tail of an RL rollout; 7 + 48 positions fit
the tiny model's 64), the others with `--tokens` new tokens and EOS allowed. The same stream runs with
continuous batching on and off (waves), alternating, and reports generated tokens per second (first
arrival to last completion) and the mean and 90th-percentile request latency (arrival to completion) of
each, median of `--repeats` after a warm-up. Requests are seeded, so both modes generate the same tokens.

Usage: python bench/engine_throughput.py [--prompts 64] [--samples 8] [--tokens 6] [--long-tokens 56]
       [--interval-ms 10] [--long-fraction 0.1]
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import replace

import torch

from rollflow.data.prompts import PromptEncoder, load_rows
from rollflow.engines.base import GenerationRequest, SamplingParams
from rollflow.engines.hf import HFEngine, left_pad
from rollflow.models import load_causal_lm, load_tokenizer


def encoded_prompts(model_path: str, count: int) -> list[list[int]]:
    """Token ids of the first `count` add2 train prompts, rendered with the chat template."""
    encoder = PromptEncoder(load_tokenizer(model_path))
    return [encoder.encode(row).token_ids for row in load_rows(task="add2", limit=count)]


def engine_run(engine: HFEngine, prompts: list[list[int]], samples: int,
               tokens: int) -> tuple[int, float, float]:
    """One batch through the engine. Returns (generated tokens, wall seconds, CPU seconds)."""
    params = SamplingParams(max_new_tokens=tokens, temperature=1.0, n=samples)
    requests = [GenerationRequest(f"p{i}", prompt, params) for i, prompt in enumerate(prompts)]

    async def run():
        return await asyncio.gather(*[engine.generate(r) for r in requests])

    start, cpu_start = time.perf_counter(), time.process_time()
    completions = asyncio.run(run())
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return sum(len(o.token_ids) for c in completions for o in c.outputs), seconds, cpu_seconds


def generate_run(model, prompts: list[list[int]], samples: int, tokens: int, pad_id: int,
                 eos_ids: list[int] | None) -> tuple[int, float, float]:
    """One batch through `model.generate` (left-padded, sampling). Returns (tokens, wall s, CPU s).

    `eos_ids=None` disables EOS so every row runs to `tokens`.
    """
    rows = [p for p in prompts for _ in range(samples)]
    input_ids, attention = left_pad(rows, pad_id, torch.device("cpu"))  # the engine's own padding
    width = input_ids.shape[1]
    start, cpu_start = time.perf_counter(), time.process_time()
    with torch.no_grad():
        output = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=True,
                                temperature=1.0, top_k=None, top_p=None, max_new_tokens=tokens,
                                min_new_tokens=0, eos_token_id=eos_ids, pad_token_id=pad_id)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    generated = output[:, width:]  # [N, <= tokens]
    return sum(_generated_length(row, eos_ids) for row in generated.tolist()), seconds, cpu_seconds


def _generated_length(row: list[int], eos_ids: list[int] | None) -> int:
    """Tokens up to and including the first EOS; generate pads the rest of a finished row."""
    for position, token in enumerate(row):
        if eos_ids and token in eos_ids:
            return position + 1
    return len(row)


def measure(engine: HFEngine, reference, prompts, samples: int, tokens: int, repeats: int,
            ignore_eos: bool) -> dict:
    """Median tokens/s of the engine and of model.generate on identical work (warm-up excluded).

    The two sides alternate within each repeat, so both see the same machine load. Rates are given per
    wall-clock second and per CPU second of this (single-threaded) process; the CPU-time rate is the
    steadier one on a machine shared with other work.
    """
    eos_ids = None if ignore_eos else list(engine.eos_ids)
    saved_eos = engine.eos_ids
    if ignore_eos:
        engine.eos_ids = []  # the engine has no ignore_eos option; an empty EOS set is the same thing
    rates: dict[str, list[float]] = {"engine": [], "generate": [], "engine_cpu": [], "generate_cpu": []}
    counts = set()
    try:
        for attempt in range(repeats + 1):  # run 0 is the warm-up
            runs = {"engine": engine_run(engine, prompts, samples, tokens),
                    "generate": generate_run(reference, prompts, samples, tokens, engine.pad_id, eos_ids)}
            for side, (count, seconds, cpu_seconds) in runs.items():
                counts.add(count)
                if attempt:
                    rates[side].append(count / seconds)
                    rates[f"{side}_cpu"].append(count / cpu_seconds)
    finally:
        engine.eos_ids = saved_eos
    if ignore_eos:
        assert counts == {len(prompts) * samples * tokens}, counts
    median = {name: statistics.median(values) for name, values in rates.items()}
    return {"engine_tokens_per_s": round(median["engine"]),
            "generate_tokens_per_s": round(median["generate"]),
            "ratio": round(median["engine"] / median["generate"], 3),
            "engine_tokens_per_cpu_s": round(median["engine_cpu"]),
            "generate_tokens_per_cpu_s": round(median["generate_cpu"]),
            "cpu_ratio": round(median["engine_cpu"] / median["generate_cpu"], 3)}


def stream_requests(prompts: list[list[int]], samples: int, tokens: int, long_fraction: float,
                    seed: int = 0) -> list[GenerationRequest]:
    """One seeded request per prompt; `long_fraction` of them (chosen at random) forced to 8x `tokens`."""
    rng = random.Random(seed)
    long = set(rng.sample(range(len(prompts)), round(long_fraction * len(prompts))))
    short = SamplingParams(max_new_tokens=tokens, temperature=1.0, n=samples)
    forced = SamplingParams(max_new_tokens=8 * tokens, min_new_tokens=8 * tokens, temperature=1.0, n=samples)
    return [GenerationRequest(f"s{i}", prompt, replace(forced if i in long else short, seed=i))
            for i, prompt in enumerate(prompts)]


def stream_run(engine: HFEngine, requests: list[GenerationRequest], interval_s: float,
               seed: int = 0) -> tuple[int, float, float, list[float]]:
    """Submit `requests` at seeded Poisson arrival times. Returns (generated tokens, wall seconds from the
    first arrival to the last completion, CPU seconds of this process meanwhile, each request's latency
    from its arrival to its completion)."""
    rng = random.Random(seed)
    arrivals = [0.0]
    for _ in requests[1:]:
        arrivals.append(arrivals[-1] + rng.expovariate(1 / interval_s))

    async def one(request, arrived):
        completion = await engine.generate(request)
        return completion, time.perf_counter() - arrived

    async def run():
        start = time.perf_counter()
        tasks = []
        for request, arrival in zip(requests, arrivals):
            await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
            tasks.append(asyncio.ensure_future(one(request, time.perf_counter())))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start

    cpu_start = time.process_time()
    results, seconds = asyncio.run(run())
    cpu_seconds = time.process_time() - cpu_start
    count = sum(len(o.token_ids) for completion, _ in results for o in completion.outputs)
    return count, seconds, cpu_seconds, [latency for _, latency in results]


def measure_stream(engine: HFEngine, requests: list[GenerationRequest], interval_s: float,
                   repeats: int) -> dict:
    """Tokens/s and mean / p90 request latency of one stream with continuous batching on and off.

    The two modes alternate within each repeat (same machine load); medians over repeats, warm-up excluded.
    Tokens per CPU second measure the work each mode spends per token (idle waits for arrivals cost none).
    """
    modes = {"continuous": True, "waves": False}
    runs: dict[str, dict[str, list[float]]] = {
        mode: {"rate": [], "cpu_rate": [], "mean": [], "p90": [], "tokens": []} for mode in modes}
    try:
        for attempt in range(repeats + 1):  # run 0 is the warm-up
            for mode, continuous in modes.items():
                engine.continuous_batching = continuous
                count, seconds, cpu_seconds, latencies = stream_run(engine, requests, interval_s)
                if attempt:
                    runs[mode]["rate"].append(count / seconds)
                    runs[mode]["cpu_rate"].append(count / cpu_seconds)
                    runs[mode]["mean"].append(statistics.mean(latencies))
                    runs[mode]["p90"].append(statistics.quantiles(latencies, n=10)[-1])
                    runs[mode]["tokens"].append(count)
    finally:
        engine.continuous_batching = True
    result = {}
    for mode, values in runs.items():
        median = {name: statistics.median(v) for name, v in values.items()}
        result[mode] = {"tokens": round(median["tokens"]), "tokens_per_s": round(median["rate"]),
                        "tokens_per_cpu_s": round(median["cpu_rate"]),
                        "mean_latency_s": round(median["mean"], 3), "p90_latency_s": round(median["p90"], 3)}
    continuous, waves = result["continuous"], result["waves"]
    result["throughput_ratio"] = round(continuous["tokens_per_s"] / waves["tokens_per_s"], 3)
    result["cpu_ratio"] = round(continuous["tokens_per_cpu_s"] / waves["tokens_per_cpu_s"], 3)
    for name in ("mean_latency_s", "p90_latency_s"):  # waves / continuous: how many times faster
        result[f"{name[:-2]}_speedup"] = round(waves[name] / continuous[name], 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=6)
    parser.add_argument("--long-tokens", type=int, default=56)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--interval-ms", type=float, default=10.0)
    parser.add_argument("--long-fraction", type=float, default=0.1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    prompts = encoded_prompts(args.model, args.prompts)
    engine = HFEngine(args.model, max_batch_size=args.prompts * args.samples, seed=0)
    reference = load_causal_lm(args.model)  # the same weights with transformers' own attention for generate
    short = measure(engine, reference, prompts, args.samples, args.tokens, args.repeats, ignore_eos=False)
    long = measure(engine, reference, prompts, args.samples, args.long_tokens, args.repeats, ignore_eos=True)
    requests = stream_requests(prompts, args.samples, args.tokens, args.long_fraction)
    stream = measure_stream(engine, requests, args.interval_ms / 1000, args.repeats)
    print(json.dumps({"model": args.model, "batch": args.prompts * args.samples, "threads": 1,
                      "repeats": args.repeats,
                      f"short_{args.tokens}_tokens": short, f"long_{args.long_tokens}_tokens": long,
                      "stream": {"requests": len(requests), "samples": args.samples,
                                 "interval_ms": args.interval_ms, "long_fraction": args.long_fraction,
                                 "long_tokens": 8 * args.tokens, **stream}}))


if __name__ == "__main__":
    main()
