"""`rollflow plan`: before renting GPUs, simulate an RLVR config on N GPUs of a hardware profile and recommend
how to split them between training and rollout, and the staleness bound.

Each candidate placement is a few steps of the real RLVR pipeline on a simulated cluster (`cluster.device:
sim`: the `sim` engine and backend sleep what the profile says; docs/simulation.md): synchronous with the
trainer and the engines colocated on every GPU, and asynchronous (`max_staleness` 1 and 2) with the GPUs split
between the trainer and engines of their own. The config's rollout and training settings are kept (groups and
samples a step, the response limit, the algorithm); its prompts are replaced by the add2 task's (the engines
see `token_scale` simulated tokens per prompt character) and response lengths come from a distribution or a
real run's samples. Throughput is trained samples per simulated second over the steps after the first two.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollflow.cluster.ray_session import start_ray, stop_ray
from rollflow.config import RLVRConfig, dump_config, load_config
from rollflow.errors import ConfigError
from rollflow.pipelines.rlvr import run_rlvr
from rollflow.sim.profiles import PROFILES, length_distribution

WARMUP_STEPS = 2  # steps before throughput counts: the asynchronous pipeline fills up


@dataclass(frozen=True)
class Candidate:
    """One placement: `train_gpus` for the trainer and `rollout_gpus` engines (one GPU each), colocated (the
    same GPUs, time-shared) or disjoint, with `max_staleness`."""

    train_gpus: int
    rollout_gpus: int
    colocated: bool
    max_staleness: int

    @property
    def name(self) -> str:
        if self.colocated:
            return f"sync_colocated_{self.train_gpus}"
        return f"async_k{self.max_staleness}_train{self.train_gpus}_rollout{self.rollout_gpus}"

    def describe(self) -> str:
        if self.colocated:
            return f"synchronous, trainer and {self.rollout_gpus} engines colocated on all {self.train_gpus} GPUs"
        return (f"asynchronous (max_staleness {self.max_staleness}): {self.train_gpus} GPUs train, "
                f"{self.rollout_gpus} engines")


def candidates(gpus: int) -> list[Candidate]:
    """Synchronous colocated on all `gpus`; asynchronous with a quarter and a half of them training (K = 1), and a
    half with K = 2."""
    if gpus < 2:
        raise ConfigError(f"rollflow plan needs at least 2 GPUs to split, got --gpus {gpus}")
    quarter, half = max(1, gpus // 4), gpus // 2
    found = [Candidate(gpus, gpus, True, 0)]
    for train, staleness in ((quarter, 1), (half, 1), (half, 2)):
        candidate = Candidate(train, gpus - train, False, staleness)
        if candidate not in found:
            found.append(candidate)
    return found


def devices(first: int, count: int) -> str:
    return "[" + ",".join(str(d) for d in range(first, first + count)) + "]"


def simulated_overrides(candidate: Candidate, profile: str, time_scale: float, token_scale: int,
                        max_new_tokens: int, steps: int, lengths: dict[str, Any] | None = None) -> list[str]:
    """The overrides that turn an RLVR config into a simulated run of `candidate` for `steps` steps: the
    simulated cluster and its placement, add2 prompts, no eval, no checkpoints, `exact_match` as the reward
    (its value is of no use on random text; its cost per sample is a plain reward's).

    Args:
        max_new_tokens: the response limit in simulated tokens (the run's payload limit is this over
            `token_scale`).
        lengths: the engines' response-length distribution (`rollflow.sim.profiles.length_distribution`).
    """
    total = candidate.train_gpus if candidate.colocated else candidate.train_gpus + candidate.rollout_gpus
    first_engine = 0 if candidate.colocated else candidate.train_gpus
    engine_kwargs = json.dumps({"lengths": lengths} if lengths else {})
    train = devices(0, candidate.train_gpus)
    return [
        "cluster.device=sim", f"cluster.num_devices={total}", f"cluster.sim.profile={profile}",
        f"cluster.sim.time_scale={time_scale}", f"cluster.sim.token_scale={token_scale}",
        "cluster.weight_sync_transport=object_store", "cluster.address=null",
        # the bundled model's tokenizer encodes the add2 prompts; the profile stands for the real model's costs
        "model.path=tiny", "model.dtype=float32", "model.trust_remote_code=false",
        "roles.actor_infer.engine=sim", "roles.actor_infer.hybrid=false", f"roles.actor_infer.engine_kwargs={engine_kwargs}",
        f"roles.actor_infer.device_mapping={devices(first_engine, candidate.rollout_gpus)}",
        f"roles.actor_infer.num_workers={candidate.rollout_gpus}", "roles.actor_infer.max_in_flight_requests=256",
        *(f"roles.{role}.{key}" for role in ("actor_train", "reference", "critic") for key in (
            "backend=sim", "backend_kwargs={}", "num_workers=1", "num_cpus=1", f"device_mapping={train}")),
        "roles.actor_train.lora=null",
        f"rollout.max_staleness={candidate.max_staleness}",
        f"rollout.max_new_tokens={max(1, math.ceil(max_new_tokens / token_scale))}", "rollout.deterministic=false",
        f"train.steps={steps}", "eval.every_steps=0", "data.eval=null", "data.domains=null",
        "data.train={task: add2, split: train}", "data.prompt_key=prompt", "data.answer_key=answer",
        "data.apply_chat_template=false", "data.max_prompt_tokens=256", "reward.functions=[{name: exact_match}]",
        "output.trackers=[jsonl]", "checks.logprob_parity_samples=0", "output.save_every_steps=0",
        "output.save_on_interrupt=false",
    ]


def throughput(run_dir: Path, time_scale: float, warmup: int = WARMUP_STEPS, token_scale: int = 16) -> dict[str, float]:
    """Trained samples per simulated second after `warmup` steps (`metrics.jsonl`), with the median step and
    its rollout and training time, in simulated seconds, the share of groups dropped as stale, and the mean
    trained response in simulated tokens (dropping stale groups drops long responses first)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if row["step"] > warmup]
    if not steps:
        raise ConfigError(f"a simulated run needs more than {warmup} steps to measure")
    seconds = sum(row["time/step"] for row in steps) * time_scale
    stale = sum(row.get("rollout/groups/stale", 0.0) for row in steps)
    consumed = sum(row.get("rollout/groups/consumed", 0.0) for row in steps)
    return {
        "samples_per_s": sum(row.get("train/usable_samples", row.get("train/samples", 0.0)) for row in steps) / seconds,
        "step_s": statistics.median(row["time/step"] * time_scale for row in steps),
        "rollout_s": statistics.median(row["time/rollout"] * time_scale for row in steps),
        "train_s": statistics.median(row.get("time/train", 0.0) * time_scale for row in steps),
        "stale_fraction": stale / max(1.0, stale + consumed),
        "staleness_max": max((row.get("staleness/max", 0.0) for row in steps), default=0.0),
        "response_tokens": token_scale * statistics.fmean(row.get("rollout/response_length", 0.0) for row in steps),
    }


def plan(config_path: str | None, overrides: list[str], profile: str, gpus: int, out: Path, steps: int = 6,
         time_scale: float = 20.0, token_scale: int = 16, max_new_tokens: int | None = None,
         lengths: dict[str, Any] | None = None, manage_ray: bool = True) -> dict[str, Any]:
    """Simulate every candidate placement of the RLVR config on `gpus` GPUs of `profile`; the best first.

    Args:
        config_path, overrides: the RLVR config to plan for.
        out: where the simulated runs write their run directories (`out/<candidate>/`, timeline.png included).
        max_new_tokens: the response limit in simulated tokens; None: the config's `rollout.max_new_tokens`.
        lengths: the response-length distribution (None: the profile's default long tail).
        manage_ray: start and stop Ray here (False: the caller's session).

    Returns:
        {"candidates": [{"name", "describe", "train_gpus", "rollout_gpus", "max_staleness", ...throughput}],
        "best": the best one's name, "speedup": its samples/s over the synchronous one's}.
    """
    if lengths is not None:
        length_distribution(lengths)  # a bad file or shape fails here, before anything starts
    config = load_config(config_path, overrides)
    if not isinstance(config, RLVRConfig):
        raise ConfigError(f"rollflow plan simulates RLVR configs; {config_path} is a {config.pipeline} config")
    if profile not in PROFILES:
        raise ConfigError(PROFILES.unknown_message(profile))
    placements = candidates(gpus)
    limit = max_new_tokens or config.rollout.max_new_tokens
    base = dump_config(config)
    out.mkdir(parents=True, exist_ok=True)
    (out / "base_config.yaml").write_text(base)
    found = []
    if manage_ray:
        start_ray()
    try:
        for candidate in placements:
            simulated = load_config(str(out / "base_config.yaml"), [
                *simulated_overrides(candidate, profile, time_scale, token_scale, limit, steps, lengths),
                f"name={candidate.name}", f"output.dir={out}", "resume=false"])
            run_rlvr(simulated, manage_ray=False)
            found.append({"name": candidate.name, "describe": candidate.describe(),
                          "train_gpus": candidate.train_gpus, "rollout_gpus": candidate.rollout_gpus,
                          "max_staleness": candidate.max_staleness,
                          **throughput(out / candidate.name, time_scale, token_scale=token_scale)})
    finally:
        if manage_ray:
            stop_ray()
    found.sort(key=lambda c: -c["samples_per_s"])
    synchronous = next(c for c in found if c["max_staleness"] == 0)
    return {"profile": profile, "gpus": gpus, "candidates": found, "best": found[0]["name"],
            "speedup": found[0]["samples_per_s"] / synchronous["samples_per_s"]}


def format_plan(result: dict[str, Any], out: Path) -> str:
    """The plan as `rollflow plan` prints it: each candidate's simulated throughput, then the recommendation."""
    lines = [f"simulated {result['gpus']} GPUs of profile {result['profile']} (docs/simulation.md):",
             f"{'placement':<62} {'samples/s':>9} {'step s':>7} {'rollout s':>9} {'stale':>6}"]
    for c in result["candidates"]:
        lines.append(f"{c['describe']:<62} {c['samples_per_s']:>9.2f} {c['step_s']:>7.1f} {c['rollout_s']:>9.1f} "
                     f"{c['stale_fraction']:>6.1%}")
    best = result["candidates"][0]
    lines.append(f"recommended: {best['describe']}: {best['samples_per_s']:.2f} samples/s, "
                 f"{result['speedup']:.2f}x the synchronous placement")
    if best["max_staleness"]:
        lines.append(f"  roles.actor_train.device_mapping: {devices(0, best['train_gpus'])}, "
                     f"roles.actor_infer.device_mapping: {devices(best['train_gpus'], best['rollout_gpus'])} "
                     f"(num_workers {best['rollout_gpus']}), rollout.max_staleness: {best['max_staleness']}")
    lines.append(f"timelines (where each GPU role waits): {out}/<placement>/timeline.png, e.g. "
                 f"{out / best['name'] / 'timeline.png'}")
    return "\n".join(lines)
