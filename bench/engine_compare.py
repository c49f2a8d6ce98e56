"""hf engine against vllm engine on CPU: start-up time, time to first token and tokens/s by concurrency.

Two models: the bundled tiny model (~1M parameters, 256 positions) and a bigger one with random weights
(`rollflow new-model --hidden-size 512 --layers 8 --heads 8 --kv-heads 4 --intermediate-size 2048
--max-positions 512`, tens of millions of parameters), written to a temporary directory unless
`--big-model` names one already written. Every request generates exactly its max_new_tokens
(`min_new_tokens = max_new_tokens`: the tiny model, trained on add2, would otherwise stop after its 2-3
answer tokens), so both engines decode the same number of tokens; the vllm engine then reports
`raw_logprobs` (the same quantity at temperature 1; its default mode refuses `min_new_tokens`).

For each model, each engine is built, measured and closed before the next starts, so they never compete
for the CPU. Both run float32 with `max_batch_size` = the largest concurrency. This process pins torch to
`--threads` threads before building anything: the hf engine decodes in this process, and the vllm engine
binds its CPU worker's OpenMP threads from this process's CPU affinity and torch thread count
(`vllm_engine.cpu_thread_environment`).

- startup_s: wall time of the engine's constructor (model load; for vLLM also its engine-core process).
- ttft_s: time to first token of a lone request, approximated by the latency of one request with
  max_new_tokens=1 (prefill plus one sampled token), median of 3 after a warm-up.
- tokens_per_s: at each `--concurrency` C, C requests (n=1, temperature 1, exactly 32 new tokens for tiny,
  64 for big, less if the positions do not allow it) submitted at once with `asyncio.gather`; generated
  tokens / wall seconds,
  median of `--repeats` after a warm-up. Prompts are the add2 train prompts rendered with the chat template
  (as in bench/engine_throughput.py), cycled to C. generated_tokens is the median count behind each rate.
- ratios: vllm / hf of tokens_per_s, startup_s and ttft_s, for each model both engines ran.

If vLLM cannot be imported the vllm engine is skipped and `skipped` says why.

Usage: python bench/engine_compare.py [--engines hf,vllm] [--models tiny,big] [--concurrency 1,64,512]
       [--repeats 3] [--threads 2] [--big-model PATH]
(vLLM is installed in its own environment here: /tmp/venv-vllm/bin/python bench/engine_compare.py ...)
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from datetime import datetime, timezone

import torch

from rollflow.data.prompts import PromptEncoder, load_rows
from rollflow.engines import create_engine
from rollflow.engines.base import GenerationRequest, SamplingParams
from rollflow.fresh_model import save_fresh_model
from rollflow.models import load_causal_lm, load_tokenizer

NEW_TOKENS = {"tiny": 32, "big": 64}  # max_new_tokens per model (cut to what the positions allow)
BIG_MODEL_SIZES = {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4,
                   "intermediate_size": 2048, "max_positions": 512}
ENGINE_KWARGS = {"vllm": {"logprobs_mode": "raw_logprobs"}}  # allows min_new_tokens at temperature 1
TTFT_REPEATS = 3
MAX_PROMPTS = 512  # distinct add2 prompts; more requests cycle through them


def encoded_prompts(model_path: str, count: int) -> list[list[int]]:
    """Token ids of the first `count` add2 train prompts, rendered with the chat template."""
    encoder = PromptEncoder(load_tokenizer(model_path))
    return [encoder.encode(row).token_ids for row in load_rows(task="add2", limit=count)]


def model_facts(model_path: str) -> tuple[int, int]:
    """(parameters, tied embeddings counted once; max positions) of the model at `model_path`."""
    model = load_causal_lm(model_path)
    return sum(p.numel() for p in model.parameters()), model.config.max_position_embeddings


def make_requests(prompts: list[list[int]], count: int, max_new_tokens: int,
                  tag: str) -> list[GenerationRequest]:
    """`count` single-sample requests over `prompts`, cycled; ids unique per `tag`."""
    params = SamplingParams(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, temperature=1.0, n=1)
    return [GenerationRequest(f"{tag}-{i}", prompts[i % len(prompts)], params) for i in range(count)]


def timed_batch(engine, requests: list[GenerationRequest]) -> tuple[int, float]:
    """Submit `requests` at once and wait for all. Returns (generated tokens, wall seconds)."""
    async def run():
        return await asyncio.gather(*[engine.generate(r) for r in requests])

    start = time.perf_counter()
    completions = asyncio.run(run())
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for c in completions for o in c.outputs), seconds


def measure(engine, prompts: list[list[int]], concurrency: list[int], max_new_tokens: int,
            repeats: int) -> dict:
    """ttft_s (median of `TTFT_REPEATS`) and tokens_per_s per concurrency (median of `repeats`), each
    after one warm-up run that is not counted."""
    latencies = []
    for attempt in range(TTFT_REPEATS + 1):  # run 0 is the warm-up
        _, seconds = timed_batch(engine, make_requests(prompts, 1, 1, f"ttft{attempt}"))
        if attempt:
            latencies.append(seconds)
    rates, counts = {}, {}
    for count in concurrency:
        runs = [timed_batch(engine, make_requests(prompts, count, max_new_tokens, f"c{count}r{attempt}"))
                for attempt in range(repeats + 1)][1:]  # run 0 is the warm-up
        rates[str(count)] = round(statistics.median(tokens / seconds for tokens, seconds in runs), 1)
        counts[str(count)] = round(statistics.median(tokens for tokens, _ in runs))
    return {"ttft_s": round(statistics.median(latencies), 4), "tokens_per_s": rates,
            "generated_tokens": counts}


def run_engine(name: str, model_path: str, prompts: list[list[int]], concurrency: list[int],
               max_new_tokens: int, repeats: int) -> dict:
    """Build engine `name` (timed), measure it and close it. ImportError when its package is missing."""
    start = time.perf_counter()
    engine = create_engine(name, model_path=model_path, dtype="float32", max_batch_size=max(concurrency),
                           seed=0, **ENGINE_KWARGS.get(name, {}))
    startup = time.perf_counter() - start
    try:
        measured = measure(engine, prompts, concurrency, max_new_tokens, repeats)
        return {"startup_s": round(startup, 2), **measured}
    finally:
        engine.close()


def ratios(hf: dict, vllm: dict) -> dict:
    """vllm / hf of tokens/s per concurrency, start-up and time to first token."""
    return {"vllm_over_hf_tokens_per_s": {c: round(vllm["tokens_per_s"][c] / hf["tokens_per_s"][c], 3)
                                          for c in hf["tokens_per_s"]},
            "startup": round(vllm["startup_s"] / hf["startup_s"], 3),
            "ttft": round(vllm["ttft_s"] / hf["ttft_s"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="hf,vllm")
    parser.add_argument("--models", default="tiny,big")
    parser.add_argument("--concurrency", default="1,64,512")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--big-model", help="a model directory written by `rollflow new-model` (default: "
                                            "write one with the sizes above to a temporary directory)")
    args = parser.parse_args()
    engines = args.engines.split(",")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    torch.set_num_threads(args.threads)  # before any engine: the vllm engine sizes its worker's threads by it

    skipped: dict[str, str] = {}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="engine-compare-") as scratch:
        for model in args.models.split(","):
            if model == "tiny":
                path = "tiny"
            elif model == "big":
                path = args.big_model or os.path.join(scratch, "big")
                if not args.big_model:
                    save_fresh_model(path, seed=0, **BIG_MODEL_SIZES)
            else:
                raise SystemExit(f"unknown model {model!r}; choose from tiny, big")
            params, positions = model_facts(path)
            prompts = encoded_prompts(path, min(max(concurrency), MAX_PROMPTS))
            max_new_tokens = min(NEW_TOKENS[model], positions - max(len(p) for p in prompts))
            results[model] = {"params": params, "max_new_tokens": max_new_tokens}
            for name in engines:
                if name in skipped:
                    continue
                try:
                    results[model][name] = run_engine(name, path, prompts, concurrency, max_new_tokens,
                                                      args.repeats)
                except ImportError as err:  # the vllm engine names the install command
                    skipped[name] = str(err).strip().splitlines()[0]
            if "hf" in results[model] and "vllm" in results[model]:
                results[model]["ratios"] = ratios(results[model]["hf"], results[model]["vllm"])

    output = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "threads": args.threads,
              "cpus": len(os.sched_getaffinity(0)), "repeats": args.repeats,
              "models": {m: {k: v for k, v in r.items() if k != "ratios"} for m, r in results.items()},
              "ratios": {m: r["ratios"] for m, r in results.items() if "ratios" in r}}
    if skipped:
        output["skipped"] = skipped
    print(json.dumps(output))


if __name__ == "__main__":
    main()
