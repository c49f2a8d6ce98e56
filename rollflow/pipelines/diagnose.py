"""`rollflow diagnose RUN_DIR`: where a training run's step time went, and which lever would shorten it.

It reads the run directory only (`config.yaml`, `metrics.jsonl`): nothing starts. Per step (the median over the
steps after the first two, which start workers and fill the pipeline) it splits the step into the trainer's
wait for the rollout (`time/rollout`), of which the wait for the batch's last tenth of groups
(`rollout/tail_wait_seconds`) and for rewards with nothing left generating (`time/reward_wait`), training
(`time/train`), the weight sync (`sync/seconds`) and the rest (reference / old logprobs, advantages,
checkpoints, logging). Then it names the levers that fit what it found:

* the engines share the trainer's devices: asynchronous training cannot overlap them; give the engines devices
  of their own first;
* synchronous, disaggregated, rollout and training both sizeable: asynchronous training (`max_staleness: 1`)
  overlaps them;
* synchronous, a rollout that mostly waits (for rewards with nothing generating, or for the batch's last tenth):
  asynchronous training overlaps the waits, which leave most devices idle, even where the engines now share the
  trainer's devices (they need a device of their own for it, which on a CPU machine may share a core);
* either way the predicted asynchronous step is max(rollout - its tail, train) + sync + the rest: the next
  step's groups generate while the trainer trains and while this step's last groups finish;
* the trainer is the bottleneck (rollout hidden or short): asynchronous training has nothing more to hide;
* a long tail: tail batching (`overprovision`) when synchronous, partial rollout (which asynchronous runs get)
  otherwise;
* a rollout wait that is not the tail: more engines;
* reward waits: more reward concurrency;
* exact old logprobs (`algorithm.old_logprobs: exact`) taking a sizeable part of the step: what `current` saves;
* colocated roles' offload / onload between phases taking a quarter of the step: devices of their own;
* for a simulated run (`cluster.device: sim`) with a lever to act on, the planner's predicted gain: read from the
  `plan.json` beside the run directory when `rollflow plan` made the run, else the `rollflow plan` command that
  simulates the placements.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from rollflow.config import load_config
from rollflow.errors import ConfigError
from rollflow.trackers.durable_files import read_records

WARMUP_STEPS = 2  # worker start, the first sync, an asynchronous run filling its pipeline
SHARE = 0.25  # a part of the step worth acting on


@dataclass
class Diagnosis:
    """Median seconds of a step and of each of its parts, and the levers, most useful first."""

    steps: int
    step_s: float
    parts: dict[str, float]
    max_staleness: int
    shared_devices: str  # why the engines share the trainer's devices ("" when they do not)
    levers: list[str] = field(default_factory=list)

    def report(self) -> str:
        lines = [f"{self.steps} steps measured (after the first {WARMUP_STEPS}); median step {self.step_s:.3f} s:"]
        for name, seconds in self.parts.items():
            lines.append(f"  {name:<42} {seconds:8.3f} s  {seconds / self.step_s:6.1%}" if self.step_s else
                         f"  {name:<42} {seconds:8.3f} s")
        lines.append("what would help:" if self.levers else "nothing stands out")
        lines += [f"  - {lever}" for lever in self.levers]
        return "\n".join(lines)


def _median(rows: list[dict], key: str) -> float:
    values = [row[key] for row in rows if key in row]
    return statistics.median(values) if values else 0.0


def _shared_devices(config) -> str:
    """Why the engines run on the trainer's devices, or "" when they have devices of their own."""
    infer, train = config.roles.actor_infer, config.roles.actor_train
    if infer.hybrid:
        return "the engine runs inside actor_train's worker (roles.actor_infer.hybrid)"
    if infer.device_mapping is None or train.device_mapping is None:
        return "actor_train and actor_infer have no device_mapping: they share the machine"
    shared = sorted(set(infer.device_mapping) & set(train.device_mapping))
    if shared:
        return f"actor_train and actor_infer share devices {shared}"
    return ""


def diagnose(run_dir: Path) -> Diagnosis:
    """Read `run_dir` and say where its steps' time went and what would shorten them.

    Raises:
        ConfigError: not a run directory of a pipeline with a rollout, or too few steps to measure.
    """
    run_dir = Path(run_dir)
    metrics, config_file = run_dir / "metrics.jsonl", run_dir / "config.yaml"
    if not metrics.is_file() or not config_file.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no metrics.jsonl and config.yaml in it)")
    config = load_config(config_file)
    if getattr(config, "rollout", None) is None:
        raise ConfigError(f"{run_dir} is a {config.pipeline} run: it has no rollout to diagnose")
    rows = read_records(metrics)  # a run still writing (or killed mid-line) has a torn last line: left out
    steps = [row for row in rows if row.get("step", 0) > WARMUP_STEPS and "time/step" in row]
    if not steps:
        raise ConfigError(f"{run_dir}: no step after the first {WARMUP_STEPS} to measure; run more steps")
    step_s = _median(steps, "time/step")
    rollout, tail = _median(steps, "time/rollout"), _median(steps, "rollout/tail_wait_seconds")
    reward_wait, train, sync = _median(steps, "time/reward_wait"), _median(steps, "time/train"), _median(
        steps, "sync/seconds")
    rest = max(0.0, step_s - rollout - train - sync)
    old, reference = _median(steps, "time/old_logprobs"), _median(steps, "time/reference")
    parts = {"waiting for the rollout": rollout, "  of which the last tenth of groups": min(tail, rollout),
             "  of which rewards, nothing generating": min(reward_wait, rollout), "training": train,
             "weight sync": sync, "the rest (logprobs, advantages, logs)": rest}
    for key, name, seconds in (("time/old_logprobs", "old logprobs", old),
                               ("time/reference", "reference logprobs", reference)):
        if any(key in row for row in steps):  # runs from before these were logged lack them
            parts[f"  of which {name}"] = min(seconds, rest)
    # colocated roles moving off and onto their devices between phases (`time/<phase>_offload_onload`)
    switching = statistics.median(sum(v for k, v in row.items() if k.endswith("_offload_onload")) for row in steps)
    if switching:
        parts["  of which offload / onload between phases"] = min(switching, rest)
    k = config.rollout.max_staleness
    diagnosis = Diagnosis(len(steps), step_s, parts, k, _shared_devices(config))
    diagnosis.levers = _levers(diagnosis, rollout, tail, reward_wait, train, sync, rest)
    diagnosis.levers += _cost_levers(step_s or 1.0, switching, old, config.algorithm.old_logprobs == "exact", k)
    planner = _planner_line(run_dir, config) if diagnosis.levers else None
    if planner:
        diagnosis.levers.append(planner)
    return diagnosis


def _cost_levers(step: float, switching: float, old: float, exact: bool, k: int) -> list[str]:
    """What the rest of the step is spent on, where it is worth acting on: colocated roles moving between phases,
    exact old logprobs."""
    levers = []
    if switching / step >= SHARE:
        levers.append(f"colocated roles moving off and onto their devices between phases take {switching:.3f} s of "
                      f"the step ({switching / step:.0%}): engines on devices of their own (roles.*.device_mapping, "
                      "disaggregated) do not move, and then asynchronous training (rollout.max_staleness: 1) can "
                      "overlap them with the trainer")
    if exact and old / step >= SHARE / 2:
        levers.append(f"exact old logprobs cost {old:.3f} s a step ({old / step:.0%}: a forward pass per policy "
                      f"version that sampled the batch); algorithm.old_logprobs: current saves it, at the price of "
                      f"the staleness correction ({'fine at' if k <= 1 else 'risky at'} max_staleness {k}: "
                      "docs/async.md)")
    return levers


def _planner_line(run_dir: Path, config) -> str | None:
    """What the planner predicts for a simulated run: the placements `rollflow plan` simulated, when the run is one
    of them (its `plan.json` beside the run directory), else the command that simulates them. None for a run on
    real devices (the planner simulates a hardware profile, not this machine)."""
    plan_file = run_dir.parent / "plan.json"
    try:
        result = json.loads(plan_file.read_text()) if plan_file.is_file() else None
        if result:
            found = {c["name"]: c for c in result["candidates"]}
            best, synchronous = found[result["best"]], next(c for c in found.values() if c["max_staleness"] == 0)
            over = {name: c["samples_per_s"] / synchronous["samples_per_s"] for name, c in found.items()}
            line = (f"the planner's simulation ({plan_file}) of {len(found)} placements on {result['gpus']} "
                    f"{result['profile']} GPUs: the fastest is {best['describe']}, {over[best['name']]:.2f}x the "
                    "synchronous one")
            this = found.get(run_dir.name)
            if this is not None and this is not best:
                line += f"; this run ({this['describe']}) is {over[this['name']]:.2f}x"
            return line
    except (OSError, ValueError, KeyError, TypeError, StopIteration, ZeroDivisionError):
        pass  # not a plan's run, or a plan.json cut short or of another shape: as if there were none
    if config.cluster.device != "sim":
        return None
    gpus = config.cluster.num_devices
    return (f"to predict each lever's gain on this simulated cluster: rollflow plan {run_dir / 'config.yaml'} "
            f"--gpus {gpus if gpus else 'N'} --profile {config.cluster.sim.profile} simulates the synchronous and "
            "asynchronous placements (K = 1, 2) and names the fastest")


def _levers(d: Diagnosis, rollout: float, tail: float, reward_wait: float, train: float, sync: float,
            rest: float) -> list[str]:
    levers, step = [], d.step_s or 1.0
    rollout_bound, train_bound = rollout / step >= SHARE, train / step >= SHARE
    waits = min(rollout, reward_wait + tail)  # what the rollout spends waiting rather than generating
    predicted = max(rollout - min(tail, rollout), train, 1e-9) + sync + rest  # the step with K = 1
    gain = (f"predicted step {predicted:.3f} s, {step / predicted:.2f}x (if training keeps its time, and before "
            "staleness's cost in learning per step)")
    if d.max_staleness == 0 and rollout_bound and waits / step >= SHARE:
        placement = (f"give actor_infer a device of its own ({d.shared_devices}; roles.*.device_mapping, on a CPU "
                     "machine one that shares a core) and set rollout.max_staleness: 1" if d.shared_devices
                     else "rollout.max_staleness: 1")
        levers.append(f"asynchronous training: the rollout waits {waits:.3f} s of the step for rewards and its last "
                      f"groups, with most devices idle, so training ({train:.3f} s) and the next step's groups can "
                      f"run meanwhile: {placement}; {gain}")
    elif d.max_staleness == 0 and d.shared_devices and rollout_bound and train_bound:
        levers.append(f"asynchronous training cannot help as placed: {d.shared_devices}, so generating and "
                      "training cannot overlap; give actor_infer devices of its own (roles.*.device_mapping), "
                      "then set rollout.max_staleness: 1")
    elif d.max_staleness == 0 and rollout_bound and train_bound:
        levers.append(f"asynchronous training (rollout.max_staleness: 1) overlaps the rollout ({rollout:.3f} s) "
                      f"with training ({train:.3f} s): {gain}")
    if train_bound and not rollout_bound:
        why = ("the rollout is already hidden behind training" if d.max_staleness
               else "the rollout is short beside training")
        levers.append(f"the trainer is the bottleneck ({train / step:.0%} of the step): {why}, so asynchronous "
                      "training has nothing more to hide; more or faster trainer devices (or fewer optimizer "
                      "steps per step) would")
    if rollout_bound and tail / step >= SHARE / 2:
        if d.max_staleness == 0:
            levers.append(f"a long tail: the last tenth of groups holds the step {tail:.3f} s; tail batching "
                          "(rollout.overprovision: 1.25) trains on the first groups that finish, or asynchronous "
                          "training with partial rollout keeps the engines busy meanwhile")
        else:
            levers.append(f"a long tail: the last tenth of groups holds the step {tail:.3f} s; partial rollout "
                          "(rollout.partial_rollout: continue) lets long samples finish on newer weights, and a "
                          "larger rollout.max_staleness lets more steps generate meanwhile")
    if reward_wait / step >= SHARE / 2:
        levers.append(f"rewards: the step waits {reward_wait:.3f} s for scores with nothing left generating; more "
                      "reward concurrency (reward.num_threads, or more roles.reward workers for model rewards)")
    elif rollout_bound and tail / step < SHARE / 2 and not (d.max_staleness == 0 and train_bound):
        levers.append(f"the rollout itself is the bottleneck ({rollout / step:.0%} of the step, not its tail): "
                      "more engines (roles.actor_infer.num_workers / devices)")
    if sync / step >= SHARE:
        levers.append(f"the weight sync takes {sync / step:.0%} of the step: the broadcast transport "
                      "(cluster.weight_sync_transport: broadcast) or larger buckets")
    return levers
