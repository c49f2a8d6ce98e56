"""Asynchronous training vs synchronous, and tail batching vs plain batches, on a long-tail RLVR workload.

The workload is the quickstart (GRPO on the bundled tiny model, two-digit addition, 64 prompts x 8 samples
a step, held-out greedy accuracy on 200 sums) with a long tail: a tenth of each step's prompts (domain
`long`, the same task) must generate at least `--long-tokens` tokens before they may stop (`min_new_tokens`),
about 9x the median response of 3.6 tokens, as long reasoning chains are in real RLVR. Their answers are
followed by filler, so they score 0: they cost generation time and teach nothing, which is what a tail does
to a synchronous step.

Runs, each for the same number of steps (so the same number of trained samples), in one process one after
another:

* `sync`: today's synchronous mode, trainer and engine colocated on both cores (trainer 2 threads).
* `async`: `rollout.max_staleness: K`, the trainer on core 0 and the engine on core 1, generating while the
  trainer trains (TIS correction on).
* `tail`: synchronous, colocated, with `rollout.overprovision` (launch 1.25x the prompts, train on the first
  64 groups that finish, abort the rest) and long rounds for the aborted prompts.

Samples/s = trained samples / the sum of the steps' wall time (`time/step`; start-up and the initial eval
excluded). Prints one JSON line.

Usage: python bench/async_speedup.py [--steps 40] [--max-staleness 2] [--long-tokens 32] [--only sync,async]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import yaml

from rollflow.config import load_config
from rollflow.pipelines.rlvr import run_rlvr

ROOT = Path(__file__).resolve().parent.parent


def base_config(steps: int, long_tokens: int) -> dict:
    config = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    config["data"] = {"domains": {
        "short": {"train": {"task": "add2"}, "eval": {"task": "add2", "split": "eval", "limit": 200},
                  "share": 0.9, "max_new_tokens": 6},
        "long": {"train": {"task": "add2"}, "share": 0.1, "min_new_tokens": long_tokens},
    }}
    config["rollout"]["max_new_tokens"] = long_tokens + 8
    config["eval"] = {"every_steps": 0, "max_new_tokens": 6}
    config["train"]["steps"] = steps
    config["output"] = {"trackers": ["console", "jsonl"]}
    return config


def variants(max_staleness: int) -> dict[str, dict]:
    return {
        "sync": {},
        "async": {"rollout": {"max_staleness": max_staleness},
                  "roles": {"actor_train": {"num_cpus": 1, "device_mapping": [0]},
                            "actor_infer": {"num_cpus": 1, "device_mapping": [1]}}},
        "tail": {"rollout": {"overprovision": 1.25, "deterministic": False}},
    }


def merged(base: dict, change: dict) -> dict:
    out = dict(base)
    for key, value in change.items():
        out[key] = merged(base.get(key, {}), value) if isinstance(value, dict) else value
    return out


def run(name: str, config: dict, workdir: Path) -> dict[str, float]:
    config = merged(config, {"name": name, "output": {"dir": str(workdir)}})
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    final = run_rlvr(load_config(path))
    records = [json.loads(line) for line in (workdir / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/step" in r]
    trained = sum(r.get("train/usable_samples", 0.0) for r in steps)
    seconds = sum(r["time/step"] for r in steps)
    staleness = [r["staleness/mean"] for r in steps if "staleness/mean" in r]
    return {"samples_per_s": trained / seconds, "step_s_median": statistics.median(r["time/step"] for r in steps),
            "accuracy": final.get("eval/accuracy", float("nan")),
            "initial_accuracy": final.get("initial_eval/accuracy", float("nan")),
            "mean_staleness": statistics.fmean(staleness) if staleness else 0.0,
            "long_rounds": sum(r.get("rollout/long_round", 0.0) for r in steps),
            "trained_samples": trained}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--long-tokens", type=int, default=32)
    parser.add_argument("--only", default="sync,async,tail")
    args = parser.parse_args()
    base = base_config(args.steps, args.long_tokens)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, change in variants(args.max_staleness).items():
            if name in args.only.split(","):
                results[name] = run(name, merged(base, change), Path(tmp))
    out = {"steps": args.steps, "long_tokens": args.long_tokens, "max_staleness": args.max_staleness,
           **{name: {k: round(v, 4) for k, v in r.items()} for name, r in results.items()}}
    if "sync" in results:
        for name in ("async", "tail"):
            if name in results:
                out[f"{name}_vs_sync_samples_per_s"] = round(results[name]["samples_per_s"]
                                                             / results["sync"]["samples_per_s"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
