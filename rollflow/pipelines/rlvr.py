"""RLVR pipeline: generate -> reward -> advantage -> train -> sync -> eval, one step at a time.

The driver (single controller) owns the loop; each role runs in its own Ray actor. Optional roles:
`reference` (KL terms, the opd teacher), `critic` (values for GAE) and `reward` (model rewards).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from rollflow.cluster.colocation import ColocationManager
from rollflow.cluster.groups import WorkerGroups
from rollflow.cluster.runtime import pinned_threads
from rollflow.config import RLVRConfig
from rollflow.data.sample import Sample, collate
from rollflow.engines.base import SamplingParams
from rollflow.pipelines.interrupts import StopSignals
from rollflow.pipelines.phases import (
    check_group_by,
    eval_summary_lines,
    evaluate,
    reference_logprobs,
    rollout_scheduler,
    rollout_stream,
    sync_weights,
)
from rollflow.pipelines.preflight import build_sampler, check_inputs
from rollflow.pipelines.run_directory import (
    prepare_run_dir,
    read_driver_state,
    resume_point,
    save_checkpoint,
    write_placement,
)
from rollflow.rewards.registry import warm_up_rewards
from rollflow.rollout.filters import check_some_succeeded, usable
from rollflow.rollout.metrics import rollout_metrics
from rollflow.rollout.stream import RolloutStream
from rollflow.spans import record, span
from rollflow.trackers import MetricsTracker
from rollflow.trackers.plots import plot_curves
from rollflow.trackers.samples import write_samples
from rollflow.trackers.timeline import STEP_SPAN, timeline_written
from rollflow.workers.advantages import AdvantageStage
from rollflow.workers.parity import check_logprob_parity, parity_probe
from rollflow.workers.reward import configured_rewards, model_rewards
from rollflow.workers.roles import RoleLaunch

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


@pinned_threads(1)  # the driver only routes and scores; workers do the heavy lifting
def run_rlvr(config: RLVRConfig, manage_ray: bool = True) -> dict[str, float]:
    """Train with RL on verifiable rewards. Returns the final metrics (incl. initial/final eval accuracy).

    Args:
        config: the run config.
        manage_ray: start Ray (per `config.cluster`) and shut it down at the end. False runs in the caller's
            Ray session and leaves it up (tests run many short runs in one session).
    """
    rollout, output, began = config.rollout, config.output, time.time()
    resume_point(config)  # a resume with nothing to resume fails before anything starts
    roles, role_args = rlvr_roles(config), {"actor_train": ("policy_gradient",),
                                            "reward": (model_rewards(config.reward),)}
    launch = RoleLaunch(config, roles, role_args, manage_ray)  # Ray and the workers start now
    with launch.cancelled_on_error():  # every prompt encoded and checked meanwhile; a bad one stops the start
        with span("check inputs"):
            inputs = check_inputs(config, roles)
            check_group_by(inputs.eval_prompts, config.eval.group_by)
        for warning in inputs.warnings:
            print(f"rollflow: warning: {warning}", file=sys.stderr)
        prepared = prepare_run_dir(config)
        # math-verify's helpers start while the workers do, not in the first step
        warm_up_rewards(f.name for functions in configured_rewards(config.reward).values() for f in functions)
    tokenizer, eval_prompts = inputs.tokenizer, inputs.eval_prompts

    with timeline_written(config.run_dir, began) as worker_spans, StopSignals() as stop, \
            launch.running(worker_spans.take_from) as groups:
        tracker = MetricsTracker(config.run_dir, output.trackers, config.train.steps, prepared.resumed_at)
        if prepared.note:
            tracker.print(prepared.note)
        tracker.print(groups.plan.describe())
        write_placement(config.run_dir / "placement.json", groups)
        colocation = ColocationManager(groups.plan, dict(groups), PHASES)
        advantages = AdvantageStage(config.algorithm, rollout.max_new_tokens)
        scheduler = rollout_scheduler(config, groups, tokenizer)
        sampling = SamplingParams(rollout.max_new_tokens, rollout.temperature, rollout.top_p, rollout.top_k,
                                  n=rollout.samples_per_prompt)
        stream = rollout_stream(config, scheduler, build_sampler(config, inputs), sampling)
        greedy = SamplingParams(config.eval.max_new_tokens or rollout.max_new_tokens, temperature=0.0)
        sync_args = (int(config.cluster.weight_sync_bucket_mb * 2**20), config.checks.weight_checksum)
        first_step, initial_eval, syncs, version = 0, {}, 0, 0  # version: of the weights the engines hold
        if prepared.resume_from:
            first_step, initial_eval, regenerated = load_checkpoint(prepared.resume_from, groups, stream, advantages)
            version = sync_weights(groups, colocation, *sync_args)["sync/version"]
            tracker.print(f"resumed from {prepared.resume_from} at step {first_step}"
                          + (f" ({regenerated} prompts drawn but not trained then are generated again)"
                             if regenerated else ""))
        else:
            initial_eval = evaluate(scheduler, colocation, eval_prompts, greedy, 0, config.eval.group_by,
                                    config.run_dir / "eval_samples.jsonl")
            tracker.log(first_step, initial_eval)  # its line, `step 0/N  eval_acc ...`, is the initial eval's

        metrics: dict[str, float] = {}
        finished = driver_state(first_step, stream, advantages, initial_eval)  # the last step done in full
        saved_step = first_step
        try:
            for step in range(first_step + 1, config.train.steps + 1):
                started, step_began = time.perf_counter(), time.time()
                colocation.enter("rollout")
                with span("rollout"):
                    result = stream.next_batch(step, version)  # asynchronous: generated while the last step trained
                check_some_succeeded(result.samples, f"step {step}")
                metrics = {**result.metrics, **rollout_metrics(result.samples)}
                if step == first_step + 1 and config.checks.logprob_parity_samples:
                    metrics.update(logprob_parity(result.samples, groups, colocation, config,
                                                  tokenizer.pad_token_id))
                batch_samples = usable(result.samples)
                metrics["train/usable_samples"] = float(len(batch_samples))
                with stop.critical():  # a stop signal waits until this step is trained, synced and logged
                    if batch_samples:  # a step whose samples were all filtered trains nothing
                        batch = collate(batch_samples, tokenizer.pad_token_id)
                        metrics.update(train_on(batch, step, groups, colocation, advantages, config))
                        syncs += 1
                        corrupt = syncs == config.checks.fault_injection_flip_sync_byte_at
                        metrics.update(sync_weights(groups, colocation, *sync_args, corrupt))
                        version = int(metrics["sync/version"])
                        stream.weights_updated()
                    metrics.update(colocation.pop_metrics())
                    if config.eval.every_steps and step % config.eval.every_steps == 0 or step == config.train.steps:
                        metrics.update(evaluate(scheduler, colocation, eval_prompts, greedy, step,
                                                config.eval.group_by, config.run_dir / "eval_samples.jsonl"))
                    metrics["time/step"] = time.perf_counter() - started
                    with span("log"):
                        tracker.log(step, metrics)
                        write_samples(config.run_dir / "samples.jsonl", step, result.samples,
                                      output.samples_logged_per_step)
                    finished = driver_state(step, stream, advantages, initial_eval)
                    if step == config.train.steps or output.save_every_steps and step % output.save_every_steps == 0:
                        with span("checkpoint"):
                            save_checkpoint(config.run_dir, groups, finished)
                        saved_step = step
                    record(STEP_SPAN, step_began, time.time(), step=step)
        except KeyboardInterrupt:  # a stop signal: `Interrupted`, or what ray.get makes of it
            if output.save_on_interrupt and finished["step"] > saved_step:
                tracker.print(f"interrupted: saving step {finished['step']} (interrupt again to skip it)")
                colocation.enter("checkpoint")  # an interrupted rollout may have left the trainer offloaded
                save_checkpoint(config.run_dir, groups, finished)
            tracker.print(f"interrupted after step {finished['step']}: resume=true continues from the newest "
                          "checkpoint")
            tracker.close()
            raise
        finally:
            stream.close()

        final = {**{f"initial_{k}": v for k, v in initial_eval.items()}, **metrics}
        for line in eval_summary_lines(final, config.train.steps):
            tracker.print(line)
        tracker.close()
    # drawn once the workers stopped: drawing adds nothing to the run's peak memory
    plot_curves(config.run_dir)
    return final


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


def driver_state(step: int, stream: RolloutStream, advantages: AdvantageStage, initial_eval: dict) -> dict:
    """The driver's part of a checkpoint after `step`: the step, data position (with the prompts drawn but not
    trained yet, which a resume generates again), reward and KL statistics. Taken when the step ends."""
    return {"step": step, "stream": stream.state(), "advantage_stage": advantages.state(),
            "initial_eval": initial_eval}


def load_checkpoint(path: Path, groups: WorkerGroups, stream: RolloutStream,
                    advantages: AdvantageStage) -> tuple[int, dict, int]:
    """Restore what `save_checkpoint` wrote. Returns (the step it was taken at, the run's initial eval, the
    prompts in flight then, to be generated again)."""
    state = read_driver_state(path)
    groups["actor_train"].call("load", str(path / "model"), state["step"])
    if "critic" in groups:
        groups["critic"].call("load", str(path / "critic"), state["step"])
    regenerated = stream.load_state(state["stream"])
    advantages.load_state(state.get("advantage_stage"))
    return state["step"], state.get("initial_eval", {}), regenerated

