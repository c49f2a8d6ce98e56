"""Replay an SFT run's validation evals through the early-stopping rule and through the rule before issue #44.

    python bench/early_stopping_replay.py runs/small_sft [--patience 5]

Reads `metrics.jsonl` (a run that kept `val/accuracy` or `val/loss` at every eval; best run with early stopping
off, `train.early_stopping_patience=null`, so that every eval is there) and prints, for each rule, the step
the run would have stopped at and the best checkpoint it would have kept, with that step's `eval/accuracy`:

- `before #44`: a new best only when the metric is strictly better (a tie goes to the first, so an accuracy
  that sits at 0 keeps step 0); patience counts evals without a new best.
- `now`: `rollflow.pipelines.supervised.BestCheckpoint` itself: a tie in accuracy goes to the lower
  `val/loss`, and patience counts evals without a record of any validation metric.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path
from types import SimpleNamespace

from rollflow.pipelines.supervised import BestCheckpoint


class _NoSave:
    """`groups["actor_train"]` that saves nothing: the replay only follows the choices."""

    def call(self, method: str, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)


def replay_before(evals: list[dict], metric: str, patience: int) -> tuple[int, int]:
    """(stop step, best step) under the rule before #44."""
    sign = -1.0 if metric == "val/loss" else 1.0
    best_step, best, since = None, math.nan, 0
    for row in evals:
        if best_step is None or sign * (row[metric] - best) > 0:
            best_step, best, since = row["step"], row[metric], 0
            continue
        since += 1
        if since >= patience:
            return row["step"], best_step
    return evals[-1]["step"], best_step


def replay_now(evals: list[dict], metric: str, patience: int) -> tuple[int, int]:
    """(stop step, best step) under `BestCheckpoint` as it is."""
    with tempfile.TemporaryDirectory() as scratch:
        config = SimpleNamespace(run_dir=Path(scratch),
                                 train=SimpleNamespace(best_checkpoint_metric=metric, early_stopping_patience=patience))
        best = BestCheckpoint(config)
        for row in evals:
            if best.update(row["step"], row, {"actor_train": _NoSave()}):
                return row["step"], best.step
        return evals[-1]["step"], best.step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--patience", type=int, default=5, help="evals (default 5, examples/small_data/sft.yaml's)")
    parser.add_argument("--metric", default="val/accuracy", choices=["val/accuracy", "val/loss"])
    args = parser.parse_args()
    rows = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [row for row in rows if args.metric in row]
    if not evals:
        parser.error(f"{args.run_dir / 'metrics.jsonl'} has no {args.metric}")
    accuracy = {row["step"]: row.get("eval/accuracy", math.nan) for row in evals}
    print(f"{len(evals)} evals, steps {evals[0]['step']}..{evals[-1]['step']}; {args.metric}, patience {args.patience}")
    for name, replay in (("before #44", replay_before), ("now", replay_now)):
        stop, best = replay(evals, args.metric, args.patience)
        print(f"{name:11} stops after step {stop:5}; best checkpoint step {best:5}: eval/accuracy {accuracy[best]:.3f}")


if __name__ == "__main__":
    main()
