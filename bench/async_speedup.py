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

`--workload io_bound` is a rollout that waits rather than computes, where asynchronous training pays on this
machine: the quickstart scored by `http_judge` against a local judge server (a thread of this process) that
answers each sample after a log-normal delay (median `--judge-delay-s`, as an LLM judge behind an API would)
with the quickstart's own verdict (`math_answer`: 10 for a right sum, 0 otherwise), 128 requests in flight.
`sync` is the quickstart's hybrid engine; `async` (`max_staleness` `--max-staleness`, default 1) puts the trainer
on both cores (devices 0 and 1) and the engine worker on a third device that shares core 0
(`cluster.num_devices: 3`): the engine's short decode and the judge's waiting overlap the trainer's step. Both runs train `--steps` steps and are
evaluated on the same 200 held-out sums; the line has `io_bound_async_speedup` and both accuracies, and the
same for `async_exact` (`algorithm.old_logprobs: exact`). `--runs-dir` keeps the runs' directories, for
`rollflow diagnose DIR/sync` (docs/async.md).

Usage: python bench/async_speedup.py [--steps 40] [--max-staleness 2] [--long-tokens 32] [--only sync,async]
       python bench/async_speedup.py --workload io_bound [--steps 120] [--judge-delay-s 0.3] [--runs-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

from rollflow.config import load_config
from rollflow.pipelines.rlvr import run_rlvr
from rollflow.rewards.math import math_answer

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


SEPARATOR = "\u241f"  # between the prompt, the completion and the answer in the judge's prompt


class DelayedJudge(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat-completions endpoint that answers after a log-normal delay with the
    quickstart's verdict on the sum: "10" when `math_answer` says the completion is right, else "0"."""

    median_s, sigma = 0.3, 0.5
    rng = random.Random(0)
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802 (the http.server name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _, completion, answer = body["messages"][-1]["content"].split(SEPARATOR)
        with self.lock:
            delay = self.median_s * math.exp(self.sigma * self.rng.gauss(0.0, 1.0))
        time.sleep(delay)
        verdict = "10" if math_answer(completion, answer=answer) == 1.0 else "0"
        reply = json.dumps({"choices": [{"message": {"role": "assistant", "content": verdict}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args) -> None:  # quiet
        pass


def io_bound_config(steps: int, url: str) -> dict:
    config = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    config["data"]["eval"] = {"task": "add2", "split": "eval", "limit": 200}
    # math_answer first, at weight 0: the accuracy metrics read the first function; the judge is the reward
    config["reward"] = {"functions": [{"name": "math_answer", "weight": 0.0}, {"name": "http_judge", "kwargs": {
        "base_url": url, "model": "judge", "template": SEPARATOR.join(["{prompt}", "{completion}", "{answer}"]),
        "max_score": 10, "max_concurrency": 128, "timeout_s": 60, "max_tokens": 2}}]}
    config["train"]["steps"] = steps
    config["eval"] = {"every_steps": 0}
    config["output"] = {"trackers": ["console", "jsonl"]}
    return config


IO_BOUND_VARIANTS = {
    "sync": {},
    "async": {"cluster": {"num_devices": 3, "num_cpus": 3},  # device 2 is core 0 again: it shares the trainer's cores
              "roles": {"actor_train": {"num_cpus": 2, "device_mapping": [0, 1]},
                        "actor_infer": {"hybrid": False, "num_cpus": 1, "device_mapping": [2]}}},
}
# `async_exact`: `async` with exact old logprobs (each token's under its sampling version's weights: TIS on the
# discrepancy alone, the PPO clip on the staleness; docs/async.md)
EXACT = {"algorithm": {"old_logprobs": "exact"}}


def io_bound(args) -> dict:
    """Sync against async on the judge-scored quickstart (see the module docstring)."""
    DelayedJudge.median_s, DelayedJudge.sigma = args.judge_delay_s, args.judge_sigma
    server = ThreadingHTTPServer(("127.0.0.1", 0), DelayedJudge)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    results = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            runs = Path(args.runs_dir or tmp)
            asynchronous = merged(IO_BOUND_VARIANTS["async"], {"rollout": {"max_staleness": args.max_staleness}})
            variants = {"sync": IO_BOUND_VARIANTS["sync"], "async": asynchronous,
                        "async_exact": merged(asynchronous, EXACT)}
            for name, change in variants.items():
                if name not in args.only.split(","):
                    continue
                results[name] = run(name, merged(io_bound_config(args.steps, url), change), runs)
    finally:
        server.shutdown()
    out = {"workload": "io_bound", "steps": args.steps, "max_staleness": args.max_staleness,
           "judge_delay_s": args.judge_delay_s, "judge_sigma": args.judge_sigma,
           **{name: {k: round(v, 4) for k, v in r.items()} for name, r in results.items()}}
    if "sync" in results:
        for name, speedup, gap in (("async", "io_bound_async_speedup", "accuracy_gap"),
                                   ("async_exact", "exact_speedup", "exact_accuracy_gap")):
            if name in results:
                out[speedup] = round(results[name]["samples_per_s"] / results["sync"]["samples_per_s"], 3)
                out[gap] = round(results[name]["accuracy"] - results["sync"]["accuracy"], 4)
    return out


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
            "rollout_s_median": statistics.median(r["time/rollout"] for r in steps),
            "train_s_median": statistics.median(r.get("time/train", 0.0) for r in steps),
            "accuracy": final.get("eval/accuracy", float("nan")),
            "initial_accuracy": final.get("initial_eval/accuracy", float("nan")),
            "mean_staleness": statistics.fmean(staleness) if staleness else 0.0,
            "long_rounds": sum(r.get("rollout/long_round", 0.0) for r in steps),
            "trained_samples": trained}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--max-staleness", type=int, default=None, help="K; default 2 (io_bound: 1)")
    parser.add_argument("--long-tokens", type=int, default=32)
    parser.add_argument("--only", default=None, help="default: sync,async,tail (io_bound: sync,async,async_exact)")
    parser.add_argument("--workload", choices=("long_tail", "io_bound"), default="long_tail")
    parser.add_argument("--runs-dir", default=None,
                        help="io_bound: keep the run directories here (for `rollflow diagnose`); default: a temporary one")
    parser.add_argument("--judge-delay-s", type=float, default=0.3, help="io_bound: median judge latency")
    parser.add_argument("--judge-sigma", type=float, default=0.5, help="io_bound: log-normal shape of it")
    args = parser.parse_args()
    if args.max_staleness is None:
        args.max_staleness = 1 if args.workload == "io_bound" else 2
    if args.only is None:
        args.only = "sync,async,async_exact" if args.workload == "io_bound" else "sync,async,tail"
    if args.workload == "io_bound":
        print(json.dumps(io_bound(args)))
        return
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
