"""RLVR pipeline: generate -> reward -> advantage -> train -> sync -> eval, one step at a time.

The driver (single controller) runs the frame (`rollflow.pipelines.loop`); `RLVRStep` says what a step of RLVR
is. Each role runs in its own Ray actor. Optional roles: `reference` (KL terms, the opd teacher), `critic`
(values for GAE) and `reward` (model rewards).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from rollflow.cluster.colocation import ColocationManager
from rollflow.cluster.groups import WorkerGroups
from rollflow.config import RLVRConfig
from rollflow.data.sample import Sample, collate
from rollflow.engines.base import SamplingParams
from rollflow.pipelines.loop import Progress, run_pipeline
from rollflow.pipelines.phases import (
    check_group_by,
    eval_summary_lines,
    evaluate,
    prompt_rollout,
    reference_logprobs,
    sync_weights,
)
from rollflow.pipelines.preflight import build_sampler, check_inputs
from rollflow.rewards.registry import warm_up_rewards
from rollflow.rollout.filters import check_some_succeeded, failure_warning, usable
from rollflow.rollout.metrics import rollout_metrics
from rollflow.spans import span
from rollflow.trackers.trackers import RL_COLUMNS
from rollflow.workers.advantages import AdvantageStage
from rollflow.workers.parity import check_logprob_parity, parity_probe
from rollflow.workers.reward import configured_rewards, model_rewards

# The roles each phase of a step runs (what `ColocationManager` onloads; colocated idle roles are offloaded).
PHASES: dict[str, tuple[str, ...]] = {
    "rollout": ("actor_infer", "reward"),  # model rewards score groups while others generate
    "reference": ("reference",),
    "old_logprobs": ("actor_train",),
    "values": ("critic",),
    "critic_train": ("critic",),
    "actor_train": ("actor_train",),
    "weight_sync": ("actor_train", "actor_infer"),  # the trainer exports, the engines load
    "checkpoint": ("actor_train", "critic"),  # saving on interrupt, whatever phase the signal cut short
}


def rlvr_roles(config: RLVRConfig) -> list[str]:
    """The roles an RLVR run starts, in start order."""
    roles = ["actor_train", "actor_infer"]
    if config.algorithm.needs_reference and config.roles.actor_train.lora is None:
        roles.append("reference")  # with LoRA the reference is the base model inside actor_train
    if config.algorithm.needs_critic:
        roles.append("critic")
    if model_rewards(config.reward):
        roles.append("reward")
    return roles


def run_rlvr(config: RLVRConfig, manage_ray: bool = True) -> dict[str, float]:
    """Train with RL on verifiable rewards. Returns the final metrics (incl. initial/final eval accuracy).

    Args:
        config: the run config.
        manage_ray: start Ray (per `config.cluster`) and shut it down at the end. False runs in the caller's
            Ray session and leaves it up (tests run many short runs in one session).
    """
    return run_pipeline(RLVRStep(config), manage_ray)


@dataclass
class Generated:
    """A step's rollout: every sample (for `samples.jsonl`) and those it trains on."""

    samples: list[Sample]
    usable: list[Sample]


class RLVRStep:
    """An RLVR step (`rollflow.pipelines.loop.PipelineStep`): the rollout core's next batch, then the
    reference / old log-probs and values as needed, advantages, the critic and actor updates and the weight
    sync. The rollout core (`RolloutCore` playing prompt groups) is touched in `start`, `load`, `rollout`,
    `train` (`weights_updated`), `evaluate`, `state` and `close`, one line each."""

    objective = "policy_gradient"
    phases = PHASES
    columns = RL_COLUMNS
    plot_keys = ("reward/mean", "eval/accuracy")

    def __init__(self, config: RLVRConfig):
        self.config = config
        self.core = None
        self.version = 0  # of the weights the engines hold
        self.syncs = 0
        self.parity_due = bool(config.checks.logprob_parity_samples)  # the first step this driver runs
        self.warned_failures = False  # failed samples (a reward raising on some rows) are warned of once

    def roles(self) -> list[str]:
        return rlvr_roles(self.config)

    def role_args(self) -> dict[str, tuple]:
        return {"actor_train": (self.objective,), "reward": (model_rewards(self.config.reward),)}

    def launches_before_inputs(self) -> bool:
        return True

    def check_inputs(self, roles: list[str]) -> list[str]:
        """Every prompt encoded and checked (`check_inputs`); math-verify's helpers start while the workers do,
        not in the first step."""
        config = self.config
        self.inputs = check_inputs(config, roles)
        check_group_by(self.inputs.eval_prompts, config.eval.group_by)
        warm_up_rewards(f.name for functions in configured_rewards(config.reward).values() for f in functions)
        return self.inputs.warnings

    def start_lines(self) -> list[str]:
        return []

    def start(self, groups: WorkerGroups, colocation: ColocationManager) -> None:
        config, rollout = self.config, self.config.rollout
        self.groups, self.colocation = groups, colocation
        self.advantages = AdvantageStage(config.algorithm, rollout.max_new_tokens)
        sampling = SamplingParams(rollout.max_new_tokens, rollout.temperature, rollout.top_p, rollout.top_k,
                                  n=rollout.group_size)
        self.core = prompt_rollout(config, groups, self.inputs.tokenizer, build_sampler(config, self.inputs),
                                   sampling)
        self.greedy = SamplingParams(config.eval.max_new_tokens or rollout.max_new_tokens, temperature=0.0)
        self.sync_args = (int(config.cluster.weight_sync_bucket_mb * 2**20), config.checks.weight_checksum)

    def load(self, checkpoint: Path, state: dict) -> str:
        """The trainer's (and critic's) weights, the core's position and the advantage statistics; then the
        engines get the weights."""
        groups = self.groups
        groups["actor_train"].call("load", str(checkpoint / "model"), state["step"])
        if "critic" in groups:
            groups["critic"].call("load", str(checkpoint / "critic"), state["step"])
        regenerated = self.core.load_state(state["stream"])
        self.advantages.load_state(state.get("advantage_stage"))
        self.version = sync_weights(groups, self.colocation, *self.sync_args)["sync/version"]
        return f" ({regenerated} prompts drawn but not trained then are generated again)" if regenerated else ""

    def evaluate(self, step: int) -> dict[str, float]:
        return evaluate(self.core, self.colocation, self.inputs.eval_prompts, self.greedy, step,
                        self.config.eval.group_by, self.config.run_dir / "eval_samples.jsonl")

    def state(self, step: int, initial_eval: dict) -> dict:
        """The driver's part of a checkpoint after `step`: the step, data position (with the prompts drawn but
        not trained yet, which a resume generates again), reward and KL statistics."""
        return {"step": step, "stream": self.core.state(), "advantage_stage": self.advantages.state(),
                "initial_eval": initial_eval}

    def rollout(self, step: int) -> tuple[Generated, dict[str, float]]:
        """The core's batch for `step` (asynchronous: generated while the last step trained), checked."""
        self.colocation.enter("rollout")
        with span("rollout"):
            result = self.core.next_batch(step, self.version)
        check_some_succeeded(result.samples, f"step {step}")
        warning = None if self.warned_failures else failure_warning(result.samples, f"step {step}")
        if warning:  # once a run: later failures are in rollout/failed_ratio and samples.jsonl
            self.warned_failures = True
            print(f"rollflow: warning: {warning} (failed samples are not trained on; later failures are counted "
                  "in rollout/failed_ratio and logged in samples.jsonl, not printed)", file=sys.stderr, flush=True)
        metrics = {**result.metrics, **rollout_metrics(result.samples)}
        if self.parity_due:
            self.parity_due = False
            metrics.update(logprob_parity(result.samples, self.groups, self.colocation, self.config,
                                          self.inputs.tokenizer.pad_token_id))
        generated = Generated(result.samples, usable(result.samples))
        metrics["train/usable_samples"] = float(len(generated.usable))
        return generated, metrics

    def train(self, step: int, work: Generated) -> dict[str, float]:
        """A step whose samples were all filtered trains nothing."""
        if not work.usable:
            return {}
        config = self.config
        batch = collate(work.usable, self.inputs.tokenizer.pad_token_id)
        metrics = train_on(batch, step, self.groups, self.colocation, self.advantages, config)
        self.syncs += 1
        corrupt = self.syncs == config.checks.fault_injection_flip_sync_byte_at
        metrics.update(sync_weights(self.groups, self.colocation, *self.sync_args, corrupt))
        self.version = int(metrics["sync/version"])
        self.core.weights_updated()
        return metrics

    def position(self, step: int) -> dict[str, float]:
        return {}

    def stop_reason(self, metrics: dict[str, float]) -> str:
        return ""

    def logged_samples(self, work: Generated) -> list[Sample]:
        return work.samples[: self.config.output.samples_logged_per_step]

    def after_run(self, progress: Progress) -> dict[str, float]:
        return {}

    def summary_lines(self, final: dict[str, float], progress: Progress) -> list[str]:
        return eval_summary_lines(final, self.config.train.steps)

    def close(self) -> None:
        if self.core is not None:
            self.core.close()


def train_on(batch, step: int, groups: WorkerGroups, colocation: ColocationManager, advantages: AdvantageStage,
             config: RLVRConfig) -> dict[str, float]:
    """Reference logprobs and values as needed, advantages, then the critic and actor updates."""
    algorithm, actor = config.algorithm, groups["actor_train"]
    if algorithm.needs_reference:
        with span("reference"):
            batch.extras["ref_logprobs"] = reference_logprobs(batch, groups, colocation,
                                                              config.roles.reference.backend)
    if advantages.needs_policy_logprobs:
        colocation.enter("old_logprobs")
        with span("old_logprobs"):
            batch.extras["old_logprobs"] = actor.call("compute_logprobs", batch)
    if "critic" in groups:
        colocation.enter("values")
        with span("values"):
            batch.extras["values"] = groups["critic"].call("compute_values", batch)
    with span("advantages"):
        metrics = advantages(batch)
    if "critic" in groups:
        colocation.enter("critic_train")
        with span("critic_train"):
            metrics.update(groups["critic"].call("train", batch))
    if step > config.train.critic_warmup_steps:
        colocation.enter("actor_train")
        with span("actor_train"):
            metrics.update(actor.call("train", batch))
    return metrics


def logprob_parity(samples: list[Sample], groups: WorkerGroups, colocation: ColocationManager,
                   config: RLVRConfig, pad_token_id: int) -> dict[str, float]:
    """The first step's check that the trainer and every engine worker run the same model (`ParityError`)."""
    candidates = usable(samples)
    probe = [candidates[i] for i in parity_probe(candidates, config.checks.logprob_parity_samples)]
    if not probe:
        return {}
    batch = collate(probe, pad_token_id)
    colocation.enter("old_logprobs")
    trainer_logprobs = groups["actor_train"].call("compute_logprobs", batch)
    return {"check/logprob_max_abs_diff": check_logprob_parity(
        batch, trainer_logprobs, config.checks.logprob_parity_tolerance)}
