"""Exact old logprobs (`algorithm.old_logprobs: exact`) against the step-start approximation (`current`) on the
asynchronous quickstart (examples/async.yaml: max_staleness 1, partial rollout `continue`, the trainer on core 0
and the engine on core 1, TIS on).

With `current` the PPO ratio's old logprobs are the trainer's at the start of the step, so the TIS ratio
exp(old - engine) of a token sampled one version earlier holds its staleness as well as the engine-trainer
discrepancy. With `exact` each token's old logprob is taken under the weights of the version that sampled it:
the TIS ratio holds only the discrepancy (float noise here: the hf engine runs the trainer's model code), and
the staleness term pi_current / pi_old is logged on its own.

Both runs train `--steps` steps from the same seed, one after the other in this process, and print one JSON
line: per run the mean over steps of |log TIS ratio| (`train_infer_log_ratio_abs_mean`), the staleness term
(`staleness_log_ratio_abs_mean`, exact only), the share of stale tokens, the seconds per step and the final
held-out accuracy; then exact's step time over current's.

Usage: python bench/old_logprobs.py [--steps 30] [--max-staleness 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from rollflow.config import load_config
from rollflow.pipelines.rlvr import run_rlvr

ROOT = Path(__file__).resolve().parent.parent


def _mean(rows: list[dict], key: str) -> float | None:
    values = [row[key] for row in rows if key in row]
    return round(statistics.fmean(values), 6) if values else None


def run(mode: str, steps: int, max_staleness: int, out: Path) -> dict:
    config = load_config(str(ROOT / "examples" / "async.yaml"), [
        f"name={mode}", f"output.dir={out}", f"train.steps={steps}", f"rollout.max_staleness={max_staleness}",
        f"algorithm.old_logprobs={mode}", "output.trackers=[jsonl]", f"eval.every_steps={steps}",
        "data.eval.limit=200"])
    run_rlvr(config)
    rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_rows = rows[1:]
    return {
        "train_infer_log_ratio_abs_mean": _mean(steps_rows, "actor/train_infer_log_ratio_abs_mean"),
        "staleness_log_ratio_abs_mean": _mean(steps_rows, "actor/staleness_log_ratio_abs_mean"),
        "stale_token_frac": _mean(steps_rows, "actor/stale_token_frac"),
        "staleness_mean": _mean(steps_rows, "staleness/mean"),
        "step_seconds": _mean(steps_rows, "time/step"),
        "eval_accuracy_start": rows[0].get("eval/accuracy"),
        "eval_accuracy_end": rows[-1].get("eval/accuracy"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--max-staleness", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {mode: run(mode, args.steps, args.max_staleness, Path(tmp)) for mode in ("current", "exact")}
    line = {"steps": args.steps, "max_staleness": args.max_staleness, **results,
            "exact_step_time_ratio": round(results["exact"]["step_seconds"] / results["current"]["step_seconds"], 3)}
    print(json.dumps(line))


if __name__ == "__main__":
    main()
