"""`rollflow plan`: before renting GPUs, simulate an RLVR config on N GPUs of a hardware profile and recommend
how to split them between training and rollout, and the staleness bound.

Each candidate placement is a few steps of the real RLVR pipeline on a simulated cluster (`cluster.device:
sim`: the `sim` engine and backend sleep what the profile says; docs/simulation.md): synchronous with the
trainer and the engines colocated on every GPU, and asynchronous (`max_staleness` 1 and 2) with the GPUs split
between the trainer and engines of their own. The config's rollout and training settings are kept (groups and
samples a step, the response limit, the algorithm); its prompts are replaced by the add2 task's (the engines
see `token_scale` simulated tokens per prompt character) and response lengths come from a distribution or a
real run's samples. Throughput is trained samples per simulated second over the steps after the first two.
Each simulated GPU's engine is a process of its own, so the GPUs a plan may have are bounded by this machine's
cores and memory (`simulated_gpu_limit`), checked with the rest before Ray starts.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from rollflow.cluster.ray_session import start_ray, stop_ray
from rollflow.config import RLVRConfig, dump_config, load_config
from rollflow.errors import ConfigError
from rollflow.pipelines.interrupts import StopSignals
from rollflow.pipelines.rlvr import run_rlvr
from rollflow.sim.profiles import PROFILES, length_distribution

WARMUP_STEPS = 2  # steps before throughput counts: the asynchronous pipeline fills up
# What a simulated GPU costs the machine that simulates it. Its engine is a Ray actor process of its own (the
# synchronous placement runs one per GPU): ~ENGINE_PROCESS_BYTES resident (measured, docs/simulation.md), and
# bench/simulated_cluster.py ran 64 of them on 2 cores. Beside them run Ray's own processes and the trainer's.
ENGINE_PROCESS_BYTES = 250 * 2**20
ENGINES_PER_CORE = 32
OTHER_PROCESSES = 8  # gcs_server, raylet, two agents, the driver, actor_train, reference, critic


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


def available_memory() -> int:
    """Bytes of memory this machine can still give processes (`MemAvailable`; all of it where /proc is missing)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/meminfo") as meminfo:
            line = next(line for line in meminfo if line.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def simulated_gpu_limit(cores: int | None = None, available_bytes: int | None = None) -> tuple[int, str]:
    """The most GPUs this machine can simulate in one placement, and why: every simulated GPU's engine is a
    process of its own (`ENGINE_PROCESS_BYTES` of memory each, beside `OTHER_PROCESSES`), and at most
    `ENGINES_PER_CORE` share a CPU core.

    Args:
        cores: CPU cores this process may use (None: its CPU affinity).
        available_bytes: memory still available (None: `available_memory()`).
    """
    cores = cores or len(os.sched_getaffinity(0))
    available = available_memory() if available_bytes is None else available_bytes
    by_memory = max(0, available // ENGINE_PROCESS_BYTES - OTHER_PROCESSES)
    limit = min(ENGINES_PER_CORE * cores, by_memory)
    why = (f"each simulated GPU's engine is a Ray actor process of its own (~{ENGINE_PROCESS_BYTES >> 20} MB; "
           f"{available / 2**30:.1f} GB of memory available) and at most {ENGINES_PER_CORE} share a CPU core "
           f"({cores} here)")
    return limit, why


def check_plan_size(gpus: int, steps: int, max_new_tokens: int | None = None,
                    limit: tuple[int, str] | None = None) -> None:
    """Refuse, before anything starts, a plan this machine cannot simulate or whose numbers mean nothing.

    Args:
        gpus, steps, max_new_tokens: `rollflow plan`'s `--gpus`, `--steps` and `--max-new-tokens`.
        limit: (most GPUs, why) as `simulated_gpu_limit` says (None: ask it).

    Raises:
        ConfigError: one line naming the limit and why.
    """
    candidates(gpus)  # at least 2
    most, why = limit or simulated_gpu_limit()
    if gpus > most:
        raise ConfigError(f"rollflow plan --gpus {gpus}: this machine can simulate at most {most} GPUs: {why}; "
                          f"plan for at most {most} GPUs, or on a machine with more memory and cores")
    if steps <= WARMUP_STEPS:
        raise ConfigError(f"rollflow plan --steps {steps}: throughput counts the steps after the first "
                          f"{WARMUP_STEPS}; give --steps {WARMUP_STEPS + 1} or more")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ConfigError(f"rollflow plan --max-new-tokens {max_new_tokens}: a response limit is at least 1 token")


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
    # the engines keep the limit itself, which `token_scale` need not divide (the payload's limit rounds it up)
    engine_kwargs = json.dumps({**({"lengths": lengths} if lengths else {}),
                                "max_new_simulated_tokens": max_new_tokens})
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


def throughput(run_dir: Path, time_scale: float, warmup: int = WARMUP_STEPS, token_scale: int = 16,
               max_new_tokens: int | None = None) -> dict[str, float]:
    """Trained samples per simulated second after `warmup` steps (`metrics.jsonl`), with the median step and
    its rollout and training time, in simulated seconds, the share of groups dropped as stale, and the mean
    trained response in simulated tokens and in payload tokens (`staleness_control: drop` drops long
    responses first).

    A response of `d` simulated tokens carries `ceil(d / token_scale)` payload tokens, so `token_scale` x the
    payload's mean overstates the mean by less than `token_scale`; no mean exceeds the response limit
    `max_new_tokens` (simulated tokens), where it is given.
    """
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if row["step"] > warmup]
    if not steps:
        raise ConfigError(f"a simulated run needs more than {warmup} steps to measure")
    seconds = sum(row["time/step"] for row in steps) * time_scale
    stale = sum(row.get("rollout/groups/stale", 0.0) for row in steps)
    consumed = sum(row.get("rollout/groups/consumed", 0.0) for row in steps)
    response = token_scale * statistics.fmean(row.get("rollout/response_length", 0.0) for row in steps)
    trained = [row["rollout/trained_response_len_mean"] for row in steps if "rollout/trained_response_len_mean" in row]
    return {
        "samples_per_s": sum(row.get("train/usable_samples", row.get("train/samples", 0.0)) for row in steps) / seconds,
        "step_s": statistics.median(row["time/step"] * time_scale for row in steps),
        "rollout_s": statistics.median(row["time/rollout"] * time_scale for row in steps),
        "train_s": statistics.median(row.get("time/train", 0.0) * time_scale for row in steps),
        "stale_fraction": stale / max(1.0, stale + consumed),
        "staleness_max": max((row.get("staleness/max", 0.0) for row in steps), default=0.0),
        "response_tokens": min(response, math.inf if max_new_tokens is None else max_new_tokens),
        # the mean trained response in payload tokens (no rounding to simulated tokens): what a bias in length shows in
        "trained_response_len": statistics.fmean(trained) if trained else 0.0,
    }


def plan(config_path: str | None, overrides: list[str], profile: str, gpus: int, out: Path, steps: int = 6,
         time_scale: float = 20.0, token_scale: int = 16, max_new_tokens: int | None = None,
         lengths: dict[str, Any] | None = None, manage_ray: bool = True, verbose: bool = False) -> dict[str, Any]:
    """Simulate every candidate placement of the RLVR config on `gpus` GPUs of `profile`; the best first.

    What can be checked without workers is checked before Ray starts: the plan's size (`check_plan_size`), the
    config and every placement's simulated config. It says on stdout which placement it simulates; what each
    run prints (its start lines, placement table and warnings, of no use to a plan whose rewards score random
    text) goes to `out/plan.log`. A stop signal anywhere in it raises `Interrupted` once Ray is stopped.

    Args:
        config_path, overrides: the RLVR config to plan for.
        out: where the simulated runs write their run directories (`out/<candidate>/`, timeline.png included).
        max_new_tokens: the response limit in simulated tokens; None: the config's `rollout.max_new_tokens`.
        lengths: the response-length distribution (None: the profile's default long tail).
        manage_ray: start and stop Ray here (False: the caller's session).
        verbose: what the runs print goes to the console instead of `out/plan.log`.

    Returns:
        {"candidates": [{"name", "describe", "train_gpus", "rollout_gpus", "max_staleness", ...throughput}],
        "best": the best one's name, "speedup": its samples/s over the synchronous one's, and the plan's
        "profile", "gpus", "steps" and "max_new_tokens"}.
    """
    check_plan_size(gpus, steps, max_new_tokens)
    if lengths is not None:
        length_distribution(lengths)  # a bad file or shape fails here, before anything starts
    config = load_config(config_path, overrides)
    if not isinstance(config, RLVRConfig):
        raise ConfigError(f"rollflow plan simulates RLVR configs; {config_path} is a {config.pipeline} config")
    if profile not in PROFILES:
        raise ConfigError(PROFILES.unknown_message(profile))
    placements = candidates(gpus)
    limit = max_new_tokens or config.rollout.max_new_tokens
    out.mkdir(parents=True, exist_ok=True)
    (out / "base_config.yaml").write_text(dump_config(config))
    runs = [load_config(str(out / "base_config.yaml"), [
        *simulated_overrides(candidate, profile, time_scale, token_scale, limit, steps, lengths),
        f"name={candidate.name}", f"output.dir={out}", "resume=false"]) for candidate in placements]
    found = []
    with StopSignals(), (out / "plan.log").open("w") as log:  # Ray's own SIGTERM handler would sys.exit
        if manage_ray:
            start_ray()
        try:
            for number, (candidate, simulated) in enumerate(zip(placements, runs), start=1):
                print(f"simulating placement {number}/{len(placements)}: {candidate.describe()} ...", flush=True)
                print(f"== {candidate.name}: {candidate.describe()}", file=log, flush=True)
                with contextlib.nullcontext() if verbose else _console_to(log):
                    run_rlvr(simulated, manage_ray=False)
                found.append({"name": candidate.name, "describe": candidate.describe(),
                              "train_gpus": candidate.train_gpus, "rollout_gpus": candidate.rollout_gpus,
                              "max_staleness": candidate.max_staleness,
                              **throughput(out / candidate.name, time_scale, token_scale=token_scale,
                                           max_new_tokens=limit)})
        finally:
            if manage_ray:
                stop_ray()
    found.sort(key=lambda c: -c["samples_per_s"])
    synchronous = next(c for c in found if c["max_staleness"] == 0)
    return {"profile": profile, "gpus": gpus, "steps": steps, "max_new_tokens": limit, "candidates": found,
            "best": found[0]["name"], "speedup": found[0]["samples_per_s"] / synchronous["samples_per_s"]}


@contextlib.contextmanager
def _console_to(log: IO[str]) -> Iterator[None]:
    """What this process prints to stdout and stderr in the block (and the output of the workers Ray forwards
    to it) goes to `log`."""
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        yield


def format_plan(result: dict[str, Any], out: Path) -> str:
    """The plan as `rollflow plan` prints it: the recommendation and its settings, then each candidate's
    simulated throughput, then where the runs are."""
    best = result["candidates"][0]
    lines = [f"recommended: {best['describe']}: {best['samples_per_s']:.2f} samples/s, "
             f"{result['speedup']:.2f}x the synchronous placement"]
    if best["max_staleness"]:
        lines.append(f"  roles.actor_train.device_mapping: {devices(0, best['train_gpus'])}, "
                     f"roles.actor_infer.device_mapping: {devices(best['train_gpus'], best['rollout_gpus'])} "
                     f"(num_workers {best['rollout_gpus']}), rollout.max_staleness: {best['max_staleness']}")
    lines += [f"simulated {result['gpus']} GPUs of profile {result['profile']}, {result['steps']} steps each, "
              f"responses of at most {result['max_new_tokens']} tokens (docs/simulation.md); step and rollout: "
              "median simulated seconds, stale: groups dropped, tokens: mean trained response",
              f"{'placement':<62} {'samples/s':>9} {'step s':>7} {'rollout s':>9} {'stale':>6} {'tokens':>7}"]
    for c in result["candidates"]:
        lines.append(f"{c['describe']:<62} {c['samples_per_s']:>9.2f} {c['step_s']:>7.1f} {c['rollout_s']:>9.1f} "
                     f"{c['stale_fraction']:>6.1%} {c['response_tokens']:>7.0f}")
    lines.append(f"timelines (where each GPU role waits): {out}/<placement>/timeline.png, e.g. "
                 f"{out / best['name'] / 'timeline.png'}; what the runs printed: {out / 'plan.log'}")
    return "\n".join(lines)
