"""Start-up and per-step fixed costs of a small RLVR run, as one JSON line.

    python bench/step_overhead.py                       # rollflow: 8 x 8 and 64 x 8 on the bundled model
    python bench/step_overhead.py --trl /tmp/trlenv/bin/python   # also TRL's GRPOTrainer on the same job

Runs `rollflow train examples/quickstart.yaml` as a user would (a fresh process, its own local Ray) with
`P` prompts x 8 samples per step and no eval, twice: P = 8 and P = 64. Reports:

- `startup_s`: from launching the command to the start of the first training step (the driver's first
  `step` span in `timeline.json`), at 8 x 8;
- `median_step_s_8x8`, `median_step_s_64x8`: the median `time/step` after the first two steps, and
  `samples_per_s_*` = P * 8 / median step;
- `peak_rss_mb`, `peak_pss_mb`: the peak over the 8 x 8 run of the summed resident memory of the command's
  whole process tree (driver, Ray's services, workers), RSS counting shared library pages once per process,
  PSS splitting them between the processes that share them; `processes` and `threads`: the most seen.

With `--trl PYTHON`, `bench/trl_grpo.py` runs under that interpreter (an environment with TRL installed; TRL
is not a dependency of rollflow) for the same two shapes, and the line adds TRL's numbers and the ratios
(`speedup_*`: rollflow samples/s over TRL's; `memory_ratio`: rollflow peak over TRL's). Timings on a shared
machine are noisy: compare ratios measured in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLES = 8


def tree_pids(root: int) -> list[int]:
    """`root` and every descendant, from /proc/PID/task/*/children."""
    pids, stack = [], [root]
    while stack:
        pid = stack.pop()
        pids.append(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as children:
                    stack.extend(int(child) for child in children.read().split())
        except OSError:
            continue
    return pids


def _kib(path: str, field: str) -> int:
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(field):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


class TreeSampler:
    """Samples a process tree every `interval_s` in a thread: the peaks of summed RSS / PSS, processes, threads."""

    def __init__(self, root: int, interval_s: float = 0.2):
        self.root, self.interval_s = root, interval_s
        self.peak = {"rss_mb": 0.0, "pss_mb": 0.0, "processes": 0, "threads": 0}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.interval_s):
            pids = tree_pids(self.root)
            now = {"rss_mb": sum(_kib(f"/proc/{p}/status", "VmRSS:") for p in pids) / 1024,
                   "pss_mb": sum(_kib(f"/proc/{p}/smaps_rollup", "Pss:") for p in pids) / 1024,
                   "processes": len(pids),
                   "threads": sum(_kib(f"/proc/{p}/status", "Threads:") for p in pids)}
            self.peak = {k: max(self.peak[k], v) for k, v in now.items()}

    def stop(self) -> dict[str, float]:
        self._done.set()
        self._thread.join()
        return {k: round(v, 1) for k, v in self.peak.items()}


def run_rollflow(prompts: int, steps: int, out: Path) -> dict:
    """One `rollflow train` of the quickstart at `prompts` x 8 without eval; its timings and memory."""
    name = f"overhead_{prompts}x{SAMPLES}"
    command = [sys.executable, "-m", "rollflow.cli", "train", str(REPO / "examples" / "quickstart.yaml"),
               f"rollout.prompts_per_step={prompts}", f"rollout.samples_per_prompt={SAMPLES}",
               f"train.steps={steps}", "data.eval=null", "output.trackers=[jsonl]", f"output.dir={out}",
               f"name={name}"]
    launched = time.time()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sampler = TreeSampler(process.pid)
    _, stderr = process.communicate()
    peak = sampler.stop()
    if process.returncode != 0:
        raise SystemExit(f"rollflow train failed ({process.returncode}): {stderr[-2000:]}")
    run_dir = out / name
    trace = json.loads((run_dir / "timeline.json").read_text())
    origin = trace["otherData"]["origin_unix_s"]
    first_step = min(e["ts"] for e in trace["traceEvents"] if e.get("name") == "step" and e["ph"] == "X")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_times = [row["time/step"] for row in rows if "time/step" in row][2:]
    median = statistics.median(step_times)
    return {"startup_s": round(origin + first_step / 1e6 - launched, 2), "median_step_s": round(median, 4),
            "samples_per_s": round(prompts * SAMPLES / median, 1), "wall_s": round(time.time() - launched, 1),
            **{f"peak_{k}" if k.endswith("mb") else k: v for k, v in peak.items()}}


def run_trl(python: str, prompts: int, steps: int) -> dict:
    """`bench/trl_grpo.py` under `python` at `prompts` x 8; its JSON line."""
    result = subprocess.run([python, str(REPO / "bench" / "trl_grpo.py"), "--prompts", str(prompts),
                             "--samples", str(SAMPLES), "--steps", str(steps)],
                            capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"trl_grpo.py failed: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps-small", type=int, default=30, help="steps of the 8 x 8 run")
    parser.add_argument("--steps-large", type=int, default=12, help="steps of the 64 x 8 run")
    parser.add_argument("--trl", metavar="PYTHON", help="also run bench/trl_grpo.py under this interpreter")
    args = parser.parse_args()
    line: dict = {"machine_cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as out:
        small = run_rollflow(8, args.steps_small, Path(out))
        large = run_rollflow(64, args.steps_large, Path(out))
    line.update({"startup_s": small["startup_s"], "median_step_s_8x8": small["median_step_s"],
                 "median_step_s_64x8": large["median_step_s"], "samples_per_s_8x8": small["samples_per_s"],
                 "samples_per_s_64x8": large["samples_per_s"], "peak_rss_mb": small["peak_rss_mb"],
                 "peak_pss_mb": small["peak_pss_mb"], "processes": small["processes"], "threads": small["threads"]})
    if args.trl:
        trl_small = run_trl(args.trl, 8, args.steps_small)
        trl_large = run_trl(args.trl, 64, args.steps_large)
        line["trl"] = {"startup_s": trl_small["startup_s"], "median_step_s_8x8": trl_small["median_step_s"],
                       "median_step_s_64x8": trl_large["median_step_s"],
                       "peak_rss_mb": trl_small["peak_rss_mb"], "peak_pss_mb": trl_small["peak_pss_mb"],
                       "processes": trl_small["processes"], "threads": trl_small["threads"]}
        line["speedup_8x8"] = round(trl_small["median_step_s"] / small["median_step_s"], 2)
        line["speedup_64x8"] = round(trl_large["median_step_s"] / large["median_step_s"], 2)
        line["memory_ratio_rss"] = round(small["peak_rss_mb"] / trl_small["peak_rss_mb"], 2)
        line["memory_ratio_pss"] = round(small["peak_pss_mb"] / trl_small["peak_pss_mb"], 2)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
