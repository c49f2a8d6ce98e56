"""What `rollout.deterministic` costs: the quickstart's step time with it on and off, in one Ray session.

Runs the quickstart config (64 prompts x 8 samples, tiny model) for `--steps` steps with
`rollout.deterministic=true` and `false`, alternating `--repeats` times so machine noise hits both alike,
and prints the median step time of each (steps after the first two: warm-up) and their ratio. With
`--engine-workers 2` the engines are two workers, where deterministic mode also gives up least-loaded routing.

Usage: python bench/deterministic_rollout.py [--steps 12] [--repeats 2] [--engine-workers 1]
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from rollflow.cluster.ray_session import start_ray, stop_ray
from rollflow.config import load_config
from rollflow.pipelines.rlvr import run_rlvr

QUICKSTART = str(Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml")


def step_times(deterministic: bool, steps: int, engine_workers: int, out: str) -> tuple[list[float], list[float]]:
    name = f"det_{deterministic}"
    config = load_config(QUICKSTART, [
        f"train.steps={steps}", f"rollout.deterministic={str(deterministic).lower()}", "eval.every_steps=0",
        "data.eval.limit=64", "output.trackers=[jsonl]", f"roles.actor_infer.num_workers={engine_workers}",
        f"name={name}", f"output.dir={out}"])
    run_rlvr(config, manage_ray=False)
    rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["time/rollout"] for row in rows if row["step"] > 2], [row["time/step"] for row in rows
                                                                       if row["step"] > 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--engine-workers", type=int, default=1)
    args = parser.parse_args()
    start_ray(num_cpus=2)
    rollout: dict[bool, list[float]] = {True: [], False: []}
    step: dict[bool, list[float]] = {True: [], False: []}
    try:
        with tempfile.TemporaryDirectory() as out:
            for _ in range(args.repeats):
                for deterministic in (True, False):
                    r, s = step_times(deterministic, args.steps, args.engine_workers, out)
                    rollout[deterministic] += r
                    step[deterministic] += s
    finally:
        stop_ray()
    med = {k: {"rollout_s": statistics.median(rollout[k]), "step_s": statistics.median(step[k])} for k in (True, False)}
    print(json.dumps({
        "engine_workers": args.engine_workers, "steps_measured": len(step[True]),
        "deterministic": med[True], "not_deterministic": med[False],
        "step_time_ratio_det_over_nondet": med[True]["step_s"] / med[False]["step_s"],
        "rollout_time_ratio_det_over_nondet": med[True]["rollout_s"] / med[False]["rollout_s"],
    }))


if __name__ == "__main__":
    main()
