"""Seconds per trainer -> engine weight sync, measured in the real pipeline (`rollflow train`).

Runs the quickstart config as a subprocess for a few short steps on two models and reads the driver's own
`sync/seconds` (trainer export + checksum + transfer + verify + engine load, end to end),
`sync/fetch_seconds_max` (the slowest rollout worker's fetch + verify) and `sync/bytes` per step from
`metrics.jsonl`; the first step is skipped (warm-up) and the median of the others is reported.

* `tiny`: the bundled quickstart model (~1M parameters, 4 MB).
* `qwen2_100m`: a randomly initialized ~100M-parameter Qwen2 (hidden 768, 12 layers, fp32, ~0.4 GB) with
  the bundled char tokenizer, built from `tiny_qwen2_config` into a temp dir (no download).

`--repo` runs another checkout (cwd and PYTHONPATH point at it, and the 100M model is built with its
`tiny_qwen2_config`), so the same bench measures a commit before and after a change. `--checksum` passes
`checks.weight_checksum=<mode>`; without it nothing is passed, so the bench also runs against checkouts
that predate that key.

Usage: python bench/weight_sync.py [--steps 4] [--checksum {full,bucket,off}] [--repo PATH] [--python EXE]
                                   [--models tiny,qwen2_100m]
Prints one JSON line. About 30 s for `tiny` and 1-2 min for `qwen2_100m` on a 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 900  # one pipeline run; the 100M model takes ~1-2 minutes on 2 cores
# hidden 768 / 12 layers / 3072 MLP with 12 query and 4 key-value heads: ~104M parameters; the char
# vocabulary makes the embedding negligible, so nearly all of it is transformer blocks, like a real model
QWEN2_100M = dict(hidden_size=768, num_layers=12, intermediate_size=3072, num_heads=12,
                  num_kv_heads=4, max_positions=64)
# small steps: the bench measures weight sync, not rollout or training
OVERRIDES = ["rollout.groups_per_step=8", "rollout.group_size=2",
             "train.train_micro_batch_size=16", "eval.every_steps=0", "data.eval=null",
             "checks.logprob_parity_samples=0", "output.trackers=[jsonl]"]


def build_qwen2_100m(repo: Path, out_dir: Path) -> None:
    """Save a random ~100M-parameter Qwen2 with the bundled char tokenizer under `out_dir`.

    Args:
        repo: the checkout whose `tiny_qwen2_config` and tokenizer to use.
        out_dir: where the HF model directory goes.
    """
    sys.path.insert(0, str(repo))  # the measured checkout's rollflow, not whichever one is installed
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from rollflow.fresh_model import fresh_qwen2_config

    tokenizer = AutoTokenizer.from_pretrained(repo / "rollflow" / "assets" / "tiny-qwen2-add")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(fresh_qwen2_config(tokenizer, **QWEN2_100M))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def count_params(model_dir: Path) -> int:
    """Parameters stored in the model's safetensors files (tied embeddings are stored, and counted, once)."""
    import math

    from safetensors import safe_open

    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, "pt") as weights:
            total += sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    return total


def run_pipeline(python: str, repo: Path, model_path: str, steps: int, checksum: str | None,
                 output_dir: Path, name: str) -> list[dict]:
    """Run `rollflow train examples/quickstart.yaml` from `repo` and return its per-step metric records.

    Raises:
        RuntimeError: the run failed or timed out (with the tail of its output).
    """
    command = [python, "-m", "rollflow.cli", "train", "examples/quickstart.yaml", f"model.path={model_path}",
               f"train.steps={steps}", f"output.dir={output_dir}", f"name={name}", *OVERRIDES]
    if checksum is not None:
        command.append(f"checks.weight_checksum={checksum}")
    # the measured checkout first on the path, for the driver and (inherited) the Ray workers
    python_path = os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": python_path, "RAY_USAGE_STATS_ENABLED": "0",
           "TOKENIZERS_PARALLELISM": "false"}
    try:
        done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        raise RuntimeError(f"{name}: no result after {RUN_TIMEOUT_S} s: {' '.join(command)}") from error
    if done.returncode != 0:
        raise RuntimeError(f"{name}: exit {done.returncode}: {' '.join(command)}\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")
    lines = (output_dir / name / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "sync/seconds" in record]


def summarize(records: list[dict]) -> dict:
    """Median sync figures over the steps after the first (the first pays one-off warm-up costs)."""
    measured = sorted(records, key=lambda record: record["step"])[1:]
    if not measured:
        raise RuntimeError("need at least 2 steps with a weight sync (--steps 2 or more)")
    median = {key: statistics.median(record[key] for record in measured)
              for key in ("sync/seconds", "sync/fetch_seconds_max", "sync/bytes")}
    return {"sync_seconds": round(median["sync/seconds"], 4),
            "fetch_seconds_max": round(median["sync/fetch_seconds_max"], 4),
            "sync_bytes": int(median["sync/bytes"]), "steps_measured": len(measured),
            "sync_seconds_each": [round(record["sync/seconds"], 4) for record in measured]}


def commit_of(repo: Path) -> str:
    """Short commit of `repo`, with `-dirty` when its tracked files have changes ("unknown" outside git)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                                text=True, timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="training steps per run (the first is skipped)")
    parser.add_argument("--checksum", choices=["full", "bucket", "off"], default=None,
                        help="pass checks.weight_checksum=<mode> (default: pass nothing)")
    parser.add_argument("--repo", type=Path, default=REPO, help="checkout to run the CLI from")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the CLI runs")
    parser.add_argument("--models", default="tiny,qwen2_100m", help="comma-separated: tiny, qwen2_100m")
    args = parser.parse_args(argv)
    repo = args.repo.resolve()
    models = args.models.split(",")
    unknown = sorted(set(models) - {"tiny", "qwen2_100m"})
    if unknown:
        parser.error(f"unknown models {unknown}; valid: tiny, qwen2_100m")

    result = {"bench": "weight_sync", "repo": str(repo), "commit": commit_of(repo),
              "checksum": args.checksum or "not passed", "steps": args.steps}
    with tempfile.TemporaryDirectory(prefix="rollflow-bench-sync-") as scratch:
        scratch = Path(scratch)
        for model in models:
            started = time.perf_counter()
            if model == "tiny":
                model_path, model_dir = "tiny", repo / "rollflow" / "assets" / "tiny-qwen2-add"
            else:
                model_dir = scratch / "qwen2_100m_model"
                model_path = str(model_dir)
                build_qwen2_100m(repo, model_dir)
            records = run_pipeline(args.python, repo, model_path, args.steps, args.checksum, scratch / "runs",
                                   model)
            result[model] = {"params": count_params(model_dir), **summarize(records),
                             "run_seconds": round(time.perf_counter() - started, 1)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
