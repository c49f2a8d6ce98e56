"""The real control plane against simulated GPUs: where asynchronous training, partial rollout and tail
batching pay, how the rollout scales to 64 engines, and where the driver saturates.

Every run is the real pipeline through Ray: the driver, the roles' Ray actors, the rollout core, the staleness
bound, the weight-sync protocol (small real payloads, checksummed) and the metrics; only the model math is
replaced by the `sim` engine and the `sim` backend, which sleep what the hardware profile says (`cluster.device:
sim`, docs/simulation.md; the placements and overrides are `rollflow plan`'s, rollflow/pipelines/plan.py). The
RLVR workload is GRPO, 64 groups of 8 a step, responses drawn from the profile's long tail (median 300 simulated
tokens, 99th percentile 20x that, capped at 8,192).

* `sync`: the trainer and 16 engines colocated on 16 GPUs (offload / onload between phases);
* `async_k1`, `async_k2`: 8 GPUs train, 8 engines generate ahead by at most K steps (`max_staleness`), new
  weights reaching running samples between tokens (`partial_rollout: continue`); `async_k1_resubmit`: the same
  with `resubmit` (a weight update aborts what generates; each sample continues from its tokens);
* `tail`: `sync` with tail batching (`overprovision: 1.25`: the first 64 of 80 groups train, the cut ones wait
  for a long round every 4th step);
* `agentic_*`: 8 FrozenLake groups of 8 six-turn episodes on 8 GPUs, each env step a log-normal delay (median
  1 simulated second, `--env-sigma` 1.5: the 99th percentile 33x the median): `lockstep` (every turn waits for
  every episode) against env-level asynchrony with 2 spare episodes per group (`async`), and with the trainer on
  2 GPUs of its own and the next steps' groups playing ahead (`async_k1`, `async_k2`);
* `scale_8`, `scale_64`: `sync` with 8 and with 64 engines, 64 groups per 8 engines (weak scaling);
* `driver`: 16,384 samples a step with (almost) no GPU time (`time_scale` 1e6): a step is what the control
  plane costs on this machine's 2 cores, sampled by py-spy when it is installed.

Throughput is trained samples per simulated second over the steps after the first two (wall time x
`time_scale`); every variant trains the same samples a step. The asynchronous runs keep the staleness bound at
admission (`rollout.staleness_control: admission`, the default: nothing is dropped); `async_k1_drop` and
`async_k2_drop` keep it the old way, dropping groups that finished too old (`stale_dropped_frac`), which drops
the long responses first: `trained_length_ratio` is the mean trained response length over sync's.
The driver's own CPU time is multiplied by `time_scale` too (it is not simulated), so the GPU parts run at 10:
its ~0.1-0.3 s of wall time a step is then 1-3 simulated seconds of a ~80 s step.

Usage: python bench/simulated_cluster.py [--only async,partial,tail,agentic,scaling,driver] [--steps 10]
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from rollflow.cluster.ray_session import start_ray, stop_ray
from rollflow.config import load_config
from rollflow.pipelines.agentic import run_agentic
from rollflow.pipelines.plan import Candidate, devices, simulated_overrides, throughput
from rollflow.pipelines.rlvr import run_rlvr

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = str(ROOT / "examples" / "quickstart.yaml")
PROFILE = "h800-7b"
TOKEN_SCALE = 16  # simulated tokens per payload token
MAX_TOKENS = 8192  # simulated response limit
# Seeds per group (by its index in the stream of keys): every RLVR variant below draws the same response lengths
# for the same groups, so their trained response lengths compare what each variant trains, not sampling noise.
SAME_DRAWS = "rollout.deterministic=true"


def agentic_overrides(gpus: int, time_scale: float, steps: int, median_s: float, sigma: float,
                      train_gpus: int | None = None) -> list[str]:
    """A simulated agentic run on `gpus` GPUs, colocated, or `train_gpus` of them for the trainer and the rest
    for engines of their own (see the module docstring)."""
    train, infer = (devices(0, gpus), devices(0, gpus)) if train_gpus is None else (
        devices(0, train_gpus), devices(train_gpus, gpus - train_gpus))
    return [
        "pipeline=agentic", "env.id=frozenlake", "env.kwargs={size: 4, max_turns: 6}", "env.max_turns=6",
        f"env.simulated_latency={{median_s: {median_s / time_scale}, sigma: {sigma}}}", "env.step_timeout_s=600",
        "rollout.groups_per_step=8", "rollout.group_size=8", "rollout.samples=trajectory",
        f"rollout.max_new_tokens={512 // TOKEN_SCALE}", "rollout.deterministic=false", "roles.env.num_workers=2",
        "cluster.device=sim", f"cluster.num_devices={gpus}", f"cluster.sim.time_scale={time_scale}",
        f"cluster.sim.token_scale={TOKEN_SCALE}", "roles.actor_infer.engine=sim", "roles.actor_train.backend=sim",
        "roles.actor_infer.engine_kwargs={lengths: {median: 100, tail_ratio: 4}}",
        f"roles.actor_train.device_mapping={train}", f"roles.actor_infer.device_mapping={infer}",
        f"roles.actor_infer.num_workers={gpus if train_gpus is None else gpus - train_gpus}",
        "roles.actor_train.num_cpus=1", f"train.steps={steps}", "train.train_micro_batch_size=512",
        "eval.episodes=0", "output.trackers=[jsonl]", "checks.logprob_parity_samples=0", "output.save_every_steps=0",
    ]


@contextlib.contextmanager
def sampled(path: Path):
    """py-spy samples this process (the driver: its main thread and the rollout core's) into `path` (raw
    collapsed stacks) for the block; nothing when py-spy is not installed (`pip install py-spy`)."""
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        yield False
        return
    recorder = subprocess.Popen([py_spy, "record", "-p", str(os.getpid()), "-f", "raw", "-r", "50", "-o",
                                 str(path), "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield True
    finally:
        recorder.send_signal(signal.SIGINT)
        recorder.wait(timeout=60)


def where_the_driver_spends(path: Path, top: int = 10) -> dict:
    """From py-spy's raw stacks: the share of the driver's busy samples inside each rollflow function
    (inclusive), and in each leaf function (self), the `top` of each."""
    inclusive: collections.Counter = collections.Counter()
    leaves: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames, samples = stack.split(";"), int(count)
        total += samples
        leaves[frames[-1]] += samples
        for frame in dict.fromkeys(f for f in frames if "rollflow/" in f and "bench/" not in f):
            inclusive[frame] += samples

    def shares(counter):
        return [[frame.replace(str(ROOT) + "/", ""), round(n / total, 3)] for frame, n in counter.most_common(top)]

    return {"samples": total, "rollflow_inclusive": shares(inclusive), "leaf_self": shares(leaves)}


class Bench:
    """The runs, one after another in one Ray session, each in a run directory of its own under `out`."""

    def __init__(self, out: Path, steps: int, time_scale: float):
        self.out, self.steps, self.time_scale = out, steps, time_scale
        self.runs: dict[str, dict] = {}

    def run(self, name: str, run, config: str | None, overrides: list[str], time_scale: float) -> dict:
        run(load_config(config, [*overrides, f"name={name}", f"output.dir={self.out}"]), manage_ray=False)
        self.runs[name] = throughput(self.out / name, time_scale, token_scale=TOKEN_SCALE)
        print(name, json.dumps(self.runs[name]), file=sys.stderr, flush=True)
        return self.runs[name]

    def rlvr(self, name: str, candidate: Candidate, *extra: str, steps: int | None = None,
             time_scale: float | None = None) -> dict:
        scale = time_scale or self.time_scale
        overrides = simulated_overrides(candidate, PROFILE, scale, TOKEN_SCALE, MAX_TOKENS, steps or self.steps)
        return self.run(name, run_rlvr, QUICKSTART, [*overrides, *extra], scale)

    def ratio(self, name: str, baseline: str) -> float:
        return self.runs[name]["samples_per_s"] / self.runs[baseline]["samples_per_s"]

    def length_ratio(self, name: str, baseline: str) -> float:
        """The mean trained response of `name` over `baseline`'s (the same length distribution: 1 when nothing
        favours a length)."""
        return self.runs[name]["trained_response_len"] / self.runs[baseline]["trained_response_len"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated parts (default all)")
    parser.add_argument("--steps", type=int, default=10, help="steps a run (the first 2 are warm-up)")
    parser.add_argument("--time-scale", type=float, default=10.0)
    parser.add_argument("--gpus", type=int, default=16, help="simulated GPUs of the RLVR comparisons")
    parser.add_argument("--env-median-s", type=float, default=1.0, help="median env step, simulated seconds")
    parser.add_argument("--env-sigma", type=float, default=1.5, help="log-normal shape of the env step's latency")
    parser.add_argument("--driver-samples", type=int, default=16384, help="samples a step of the driver run")
    args = parser.parse_args()
    parts = set(filter(None, args.only.split(","))) or {"async", "partial", "tail", "agentic", "scaling", "driver"}
    gpus, half = args.gpus, args.gpus // 2
    result: dict = {"profile": PROFILE, "time_scale": args.time_scale, "token_scale": TOKEN_SCALE, "gpus": gpus}
    bench = Bench(Path(tempfile.mkdtemp(prefix="simulated_cluster_")), args.steps, args.time_scale)
    start_ray(num_cpus=2)
    try:
        if parts & {"async", "partial", "tail"}:
            bench.rlvr("sync", Candidate(gpus, gpus, True, 0), SAME_DRAWS)
        if parts & {"async", "partial"}:
            for k in (1, 2):
                bench.rlvr(f"async_k{k}", Candidate(half, gpus - half, False, k), SAME_DRAWS)
            result["async_speedup"] = {f"k{k}": bench.ratio(f"async_k{k}", "sync") for k in (1, 2)}
            result["stale_dropped_frac"] = {f"k{k}": bench.runs[f"async_k{k}"]["stale_fraction"] for k in (1, 2)}
            result["trained_length_ratio"] = {f"k{k}": bench.length_ratio(f"async_k{k}", "sync") for k in (1, 2)}
        if "async" in parts:  # the old way of keeping the bound, beside: drop what finished too old
            for k in (1, 2):
                bench.rlvr(f"async_k{k}_drop", Candidate(half, gpus - half, False, k), SAME_DRAWS,
                           "rollout.staleness_control=drop")
            result["drop_mode"] = {
                "async_speedup": {f"k{k}": bench.ratio(f"async_k{k}_drop", "sync") for k in (1, 2)},
                "stale_dropped_frac": {f"k{k}": bench.runs[f"async_k{k}_drop"]["stale_fraction"] for k in (1, 2)},
                "trained_length_ratio": {f"k{k}": bench.length_ratio(f"async_k{k}_drop", "sync") for k in (1, 2)}}
        if "partial" in parts:
            bench.rlvr("async_k1_resubmit", Candidate(half, gpus - half, False, 1), SAME_DRAWS,
                       "rollout.partial_rollout=resubmit")
            result["partial_rollout_speedup"] = {"continue": bench.ratio("async_k1", "sync"),
                                                 "resubmit": bench.ratio("async_k1_resubmit", "sync")}
        if "tail" in parts:
            bench.rlvr("tail", Candidate(gpus, gpus, True, 0), SAME_DRAWS, "rollout.overprovision=1.25",
                       "rollout.long_round_every=4")
            result["tail_batching_speedup"] = bench.ratio("tail", "sync")
        if "agentic" in parts:
            scale, latency = 40.0, (args.env_median_s, args.env_sigma)  # env waits are sleeps: a faster clock is fine
            modes = {"lockstep": (None, ["rollout.lockstep=true"]),
                     "async": (None, ["rollout.group_redundancy=2"]),
                     "async_k1": (2, ["rollout.group_redundancy=2", "rollout.max_staleness=1"]),
                     "async_k2": (2, ["rollout.group_redundancy=2", "rollout.max_staleness=2"])}
            for mode, (train_gpus, extra) in modes.items():
                overrides = agentic_overrides(8, scale, args.steps, *latency, train_gpus=train_gpus)
                bench.run(f"agentic_{mode}", run_agentic, None, [*overrides, *extra], scale)
            result["agentic_async_speedup"] = {mode: bench.ratio(f"agentic_{mode}", "agentic_lockstep")
                                               for mode in modes if mode != "lockstep"}
            result["agentic_env_latency"] = {"median_s": latency[0], "sigma": latency[1]}
        if "scaling" in parts:
            for engines in (8, 64):  # weak scaling: 64 groups of 8 samples per 8 engines
                bench.rlvr(f"scale_{engines}", Candidate(engines, engines, True, 0),
                           f"rollout.groups_per_step={8 * engines}", f"train.train_micro_batch_size={64 * engines}")
            result["scaling_efficiency"] = bench.ratio("scale_64", "scale_8") / 8
        if "driver" in parts:
            samples = args.driver_samples
            with sampled(bench.out / "driver.txt") as profiled:
                # a time_scale of 1e6 leaves no GPU time: in wall seconds (`throughput` at scale 1), a step is
                # what the control plane costs
                overrides = simulated_overrides(Candidate(16, 16, True, 0), PROFILE, 1e6, TOKEN_SCALE, MAX_TOKENS, 5)
                bench.run("driver", run_rlvr, QUICKSTART, [*overrides, f"rollout.groups_per_step={samples // 8}",
                                                           f"train.train_micro_batch_size={samples}"], 1.0)
            step = bench.runs["driver"]
            result["driver_overhead_ms_per_sample"] = 1000 * step["step_s"] / samples
            result["driver_saturation_samples_per_s"] = samples / step["step_s"]
            result["driver_step_wall_s"] = {key: step[key] for key in ("step_s", "rollout_s", "train_s")}
            if profiled:
                result["driver_profile"] = where_the_driver_spends(bench.out / "driver.txt")
        result["runs"] = bench.runs
    finally:
        stop_ray()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
