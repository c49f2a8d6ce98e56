"""RLVR pipeline: generate -> reward -> advantage -> train -> sync -> eval, one step at a time.

The driver (single controller) runs the frame (`rollflow.pipelines.loop`); `RLVRStep` says what a step of RLVR
is. Each role runs in its own Ray actor. Optional roles: `reference` (KL terms, the opd teacher), `critic`
(values for GAE) and `reward` (model rewards).
"""

from __future__ import annotations

import sys

from rollflow.cluster.groups import WorkerGroups
from rollflow.config import RLVRConfig
from rollflow.config.rlvr import stale_old_logprobs_warnings
from rollflow.engines.base import SamplingParams
from rollflow.inputs.prompt_sets import build_sampler, load_prompt_sets
from rollflow.pipelines.loop import Progress, run_pipeline
from rollflow.pipelines.phases import check_group_by, eval_summary_lines, evaluate, prompt_rollout
from rollflow.pipelines.rl_step import RLStep, StepSamples
from rollflow.rewards import configured_rewards, model_rewards
from rollflow.rewards.registry import warm_up_rewards
from rollflow.rollout.core import RolloutCore, RolloutResult
from rollflow.rollout.filters import check_some_succeeded, failure_warning, usable
from rollflow.rollout.metrics import rollout_metrics
from rollflow.trackers.trackers import RL_COLUMNS
from rollflow.workers.advantages import AdvantageStage


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


class RLVRStep(RLStep):
    """An RLVR step: the shared RL step (`rollflow.pipelines.rl_step.RLStep`) over prompt groups scored by the
    run's rewards, with the reward-shaping advantage stage (`AdvantageStage`) and greedy eval on the eval
    prompts."""

    columns = RL_COLUMNS
    plot_keys = ("reward/mean", "eval/accuracy")

    def __init__(self, config: RLVRConfig):
        super().__init__(config)
        self.warned_failures = False  # failed samples (a reward raising on some rows) are warned of once
        rollout = config.rollout
        self.greedy = SamplingParams(config.eval.max_new_tokens or rollout.max_new_tokens, temperature=0.0)

    def roles(self) -> list[str]:
        return rlvr_roles(self.config)

    def check_inputs(self, roles: list[str]) -> list[str]:
        """Every prompt encoded and checked (`load_prompt_sets`); math-verify's helpers start while the workers
        do, not in the first step."""
        config = self.config
        self.inputs = load_prompt_sets(config, roles)
        check_group_by(self.inputs.eval_prompts, config.eval.group_by)
        warm_up_rewards(f.name for functions in configured_rewards(config.reward).values() for f in functions)
        return [*self.inputs.warnings, *stale_old_logprobs_warnings(config)]

    @property
    def pad_token_id(self) -> int:
        return self.inputs.tokenizer.pad_token_id

    def build_advantages(self) -> AdvantageStage:
        return AdvantageStage(self.config.algorithm, self.config.rollout.max_new_tokens)

    def build_core(self, groups: WorkerGroups) -> RolloutCore:
        config, rollout = self.config, self.config.rollout
        sampling = SamplingParams(rollout.max_new_tokens, rollout.temperature, rollout.top_p, rollout.top_k,
                                  n=rollout.group_size)
        return prompt_rollout(config, groups, self.inputs.tokenizer, build_sampler(config, self.inputs), sampling)

    def resume_note(self, regenerated: int) -> str:
        return f" ({regenerated} prompts drawn but not trained then are generated again)" if regenerated else ""

    def evaluate(self, step: int) -> dict[str, float]:
        return evaluate(self.core, self.colocation, self.inputs.eval_prompts, self.greedy, step,
                        self.config.eval.group_by, self.config.run_dir / "eval_samples.jsonl")

    def checked(self, step: int, result: RolloutResult) -> tuple[StepSamples, dict[str, float]]:
        """A step in which every sample failed stops the run; failed samples are warned of once."""
        check_some_succeeded(result.samples, f"step {step}")
        warning = None if self.warned_failures else failure_warning(result.samples, f"step {step}")
        if warning:  # once a run: later failures are in rollout/failed_ratio and samples.jsonl
            self.warned_failures = True
            print(f"rollflow: warning: {warning} (failed samples are not trained on; later failures are counted "
                  "in rollout/failed_ratio and logged in samples.jsonl, not printed)", file=sys.stderr, flush=True)
        metrics = {**result.metrics, **rollout_metrics(result.samples)}
        work = StepSamples(usable(result.samples), result.samples[: self.config.output.samples_logged_per_step])
        metrics["train/usable_samples"] = float(len(work.usable))
        return work, metrics

    def summary_lines(self, final: dict[str, float], progress: Progress) -> list[str]:
        return eval_summary_lines(final, self.config.train.steps)
