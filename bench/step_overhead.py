"""Start-up and per-step fixed costs of a small RLVR run, as one JSON line.

    python bench/step_overhead.py                       # rollflow: 8 x 8 and 64 x 8 on the bundled model
    python bench/step_overhead.py --trl /tmp/trlenv/bin/python   # also TRL's GRPOTrainer on the same job

Runs `rollflow train examples/quickstart.yaml` as a user would (a fresh process, its own local Ray) with
`P` prompts x 8 samples per step and no eval, twice: P = 8 and P = 64. Reports:

- `startup_s`: from launching the command to the start of the first training step (when the console printed
  step 1, less that step's `time/step`), at 8 x 8;
- `median_step_s_8x8`, `median_step_s_64x8`: the median time between two consecutive steps' console lines
  (all the loop does, logging included, as TRL's is between two `on_step_end`s) after the first three steps,
  and `samples_per_s_*` = P * 8 / median step;
- `peak_rss_mb_*`, `peak_pss_mb_*`: the peak over each run of the summed resident memory of the command's
  whole process tree (driver, Ray's services, workers), RSS counting shared library pages once per process,
  PSS splitting them between the processes that share them; `processes` and `threads`: the most seen (8 x 8).

With `--before CHECKOUT`, the same is measured for the rollflow in that directory (an earlier commit:
`git worktree add /tmp/before REV`), back to back. With `--trl PYTHON`, `bench/trl_grpo.py` runs under that
interpreter (an environment with TRL installed; TRL is not a dependency of rollflow) for the same two shapes,
and the line adds TRL's numbers and the ratios (`speedup_*`: rollflow samples/s over TRL's; `memory_ratio_*`:
rollflow's peak over TRL's). Each timing is the median over `--rounds` interleaved rounds (default 3) that do not sample memory; memory
comes from one more round that does (sampling rollflow's 11 processes every 0.2 s takes ~20% of a core). On
the 2-core development machine one run's 8 x 8 median varies by +-15% from the next: compare ratios measured
in one invocation.
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
    """Samples a process tree every `interval_s` in a thread: the peaks of summed RSS / PSS, processes, threads.
    `interval_s` 0: no sampling. One sample of rollflow's 11 processes costs ~45 ms of kernel time (smaps_rollup
    walks page tables), so timing runs do not sample: it would take 20% of a core from the run it measures."""

    def __init__(self, root: int, interval_s: float = 0.2):
        self.root, self.interval_s = root, interval_s
        self.peak = {"rss_mb": 0.0, "pss_mb": 0.0, "processes": 0, "threads": 0}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if interval_s > 0:
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
        if self.interval_s > 0:
            self._thread.join()
        return {k: round(v, 1) for k, v in self.peak.items()}


def run_rollflow(prompts: int, steps: int, out: Path, code: str | None = None, memory: bool = False) -> dict:
    """One `rollflow train` of the quickstart at `prompts` x 8 without eval; its timings and memory.

    `code`: a checkout of rollflow to run instead of the installed one (put first on PYTHONPATH), to measure an
    earlier version back to back with this one. Start-up is read the same way for any version: the moment the
    console printed step 1, less step 1's own `time/step`.
    """
    name = f"overhead_{prompts}x{SAMPLES}"
    quickstart = Path(code or REPO) / "examples" / "quickstart.yaml"  # each version runs its own quickstart
    command = [sys.executable, "-m", "rollflow.cli", "train", str(quickstart),
               f"rollout.groups_per_step={prompts}", f"rollout.group_size={SAMPLES}",
               f"train.steps={steps}", "data.eval=null", "output.trackers=[console,jsonl]", f"output.dir={out}",
               f"name={name}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [code, os.environ.get("PYTHONPATH")]))}
    launched = time.time()
    # run from the output directory: `python -m` puts the working directory first on sys.path, and this
    # repository's own rollflow/ would shadow `code`
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=out)
    sampler = TreeSampler(process.pid, 0.2 if memory else 0.0)
    printed = []  # when each step's console line appeared
    for line in process.stdout:
        if line.startswith("step ") and not line.startswith("step 0/"):
            printed.append(time.time())
    stderr = process.stderr.read()
    process.wait()
    peak = sampler.stop()
    if process.returncode != 0 or len(printed) < 4:
        raise SystemExit(f"rollflow train failed ({process.returncode}): {stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    first_step = next(row["time/step"] for row in rows if "time/step" in row)
    # a step is the time between two step lines: everything the loop does (logging included), as TRL's
    # median is between two `on_step_end`s
    median = statistics.median([b - a for a, b in zip(printed, printed[1:])][2:])
    return {"startup_s": round(printed[0] - first_step - launched, 2), "median_step_s": round(median, 4),
            "samples_per_s": round(prompts * SAMPLES / median, 1), "wall_s": round(time.time() - launched, 1),
            **{f"peak_{k}" if k.endswith("mb") else k: v for k, v in peak.items()}}


def measure_rollflow(steps_small: int, steps_large: int, code: str | None = None,
                     memory: bool = False) -> tuple[dict, dict]:
    """One round of one version: its 8 x 8 and 64 x 8 runs (a memory round samples the process tree)."""
    with tempfile.TemporaryDirectory() as out:
        return (run_rollflow(8, steps_small, Path(out), code, memory),
                run_rollflow(64, steps_large, Path(out), code, memory))


def summary(rounds: list[tuple[dict, dict]], memory: tuple[dict, dict]) -> dict:
    """One version's numbers: timings are the median over the timing `rounds` of its 8 x 8 and 64 x 8 runs
    (start-up from 8 x 8), memory and process counts come from its `memory` round."""
    def median(shape: int, key: str) -> float:
        return round(statistics.median(runs[shape][key] for runs in rounds), 4)

    return {"startup_s": median(0, "startup_s"), "median_step_s_8x8": median(0, "median_step_s"),
            "median_step_s_64x8": median(1, "median_step_s"), "samples_per_s_8x8": median(0, "samples_per_s"),
            "samples_per_s_64x8": median(1, "samples_per_s"), "peak_rss_mb_8x8": memory[0]["peak_rss_mb"],
            "peak_rss_mb_64x8": memory[1]["peak_rss_mb"], "peak_pss_mb_8x8": memory[0]["peak_pss_mb"],
            "peak_pss_mb_64x8": memory[1]["peak_pss_mb"], "processes": memory[0]["processes"],
            "threads": memory[0]["threads"], "rounds": len(rounds)}


def run_trl(python: str, prompts: int, steps: int, memory: bool = False) -> dict:
    """`bench/trl_grpo.py` under `python` at `prompts` x 8; its JSON line."""
    result = subprocess.run([python, str(REPO / "bench" / "trl_grpo.py"), "--prompts", str(prompts),
                             "--samples", str(SAMPLES), "--steps", str(steps),
                             "--memory-interval", "0.2" if memory else "0"],
                            capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"trl_grpo.py failed: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps-small", type=int, default=30, help="steps of the 8 x 8 run")
    parser.add_argument("--steps-large", type=int, default=12, help="steps of the 64 x 8 run")
    parser.add_argument("--trl", metavar="PYTHON", help="also run bench/trl_grpo.py under this interpreter")
    parser.add_argument("--before", metavar="CHECKOUT",
                        help="also measure the rollflow in this directory (e.g. `git worktree add /tmp/before REV`)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of every version and shape, interleaved; each number is the median over them")
    args = parser.parse_args()
    versions = {"after": lambda memory: measure_rollflow(args.steps_small, args.steps_large, None, memory)}
    if args.before:
        versions["before"] = lambda memory: measure_rollflow(args.steps_small, args.steps_large, args.before, memory)
    if args.trl:
        versions["trl"] = lambda memory: (run_trl(args.trl, 8, args.steps_small, memory),
                                          run_trl(args.trl, 64, args.steps_large, memory))
    memory = {name: measure(True) for name, measure in versions.items()}  # the round that samples memory
    rounds: dict[str, list] = {name: [] for name in versions}
    order = list(versions)
    for round_index in range(args.rounds):  # interleaved, so a slow minute of the machine hits every version alike
        # and rotated: no version always runs first in a round, right after another version's 64 x 8 run
        for name in order[round_index % len(order):] + order[:round_index % len(order)]:
            rounds[name].append(versions[name](False))
    line: dict = {"machine_cpus": os.cpu_count(), **summary(rounds["after"], memory["after"])}
    for name in ("before", "trl"):
        if name in rounds:
            line[name] = summary(rounds[name], memory[name])
    if "trl" in line:
        trl = line["trl"]
        for version, numbers in (("", line), ("before_", line.get("before"))):
            if numbers is None:
                continue
            line[f"{version}vs_trl"] = {
                "startup_ratio": round(numbers["startup_s"] / trl["startup_s"], 2),
                **{f"speedup_{shape}": round(trl[f"median_step_s_{shape}"] / numbers[f"median_step_s_{shape}"], 2)
                   for shape in ("8x8", "64x8")},
                **{f"memory_ratio_{kind}_{shape}": round(numbers[f"peak_{kind}_mb_{shape}"]
                                                         / trl[f"peak_{kind}_mb_{shape}"], 2)
                   for kind in ("rss", "pss") for shape in ("8x8", "64x8")}}
    print(json.dumps(line))


if __name__ == "__main__":
    main()
