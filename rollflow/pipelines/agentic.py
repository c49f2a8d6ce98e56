"""Agentic pipeline: play env groups -> advantages per episode or per step -> train -> sync -> eval.

The driver owns the loop; env workers hold the environments, engine workers the policy, and `EnvRollout`
plays the episodes between them (each env on its own, no barrier between envs). Evaluation plays one greedy
episode per held-out seed and reports `eval/success`.
"""

from __future__ import annotations

import sys
import time

from rollflow.cluster.colocation import ColocationManager
from rollflow.cluster.runtime import pinned_threads
from rollflow.config.agentic import AgenticConfig
from rollflow.data.multiturn import TurnEncoder
from rollflow.data.sample import SampleStatus, collate
from rollflow.engines.base import SamplingParams
from rollflow.errors import ConfigError
from rollflow.models import check_model_files, load_model_config, load_tokenizer
from rollflow.pipelines.interrupts import StopSignals
from rollflow.pipelines.phases import reference_logprobs, sync_weights
from rollflow.pipelines.preflight import context_length
from rollflow.pipelines.run_directory import (
    prepare_run_dir,
    read_driver_state,
    resume_point,
    save_checkpoint,
    write_placement,
)
from rollflow.rollout.agentic import EnvRollout, EnvRolloutSettings, episode_metrics
from rollflow.rollout.episode_advantages import EpisodeAdvantages
from rollflow.rollout.episodes import (
    EpisodeErrorWarnings,
    episode_samples,
    failed_samples,
    no_episodes_error,
)
from rollflow.spans import record, span
from rollflow.trackers import MetricsTracker
from rollflow.trackers.plots import plot_curves
from rollflow.trackers.samples import write_samples
from rollflow.trackers.timeline import STEP_SPAN, timeline_written
from rollflow.trackers.trackers import CONSOLE_COLUMNS
from rollflow.workers.roles import RoleLaunch

PHASES: dict[str, tuple[str, ...]] = {
    "rollout": ("actor_infer", "env"),
    "reference": ("reference",),
    "old_logprobs": ("actor_train",),  # the LoRA reference: actor_train with its adapters off
    "actor_train": ("actor_train",),
    "weight_sync": ("actor_train", "actor_infer"),
    "checkpoint": ("actor_train",),
}


def agentic_roles(config: AgenticConfig) -> list[str]:
    """The roles an agentic run starts, in start order."""
    roles = ["actor_train", "actor_infer", "env"]
    if config.algorithm.needs_reference and config.roles.actor_train.lora is None:
        roles.append("reference")
    return roles


@pinned_threads(1)
def run_agentic(config: AgenticConfig, manage_ray: bool = True) -> dict[str, float]:
    """Train a policy in an environment with multi-turn RL. Returns the final metrics (with the initial and
    final `eval/success`).

    Args:
        config: the run config.
        manage_ray: start Ray and shut it down at the end; False runs in the caller's session.
    """
    model, began = config.model, time.time()
    resume_point(config)  # a resume with nothing to resume fails before anything starts
    roles = agentic_roles(config)
    launch = RoleLaunch(config, roles, {"actor_train": ("policy_gradient",)}, manage_ray)  # starts meanwhile
    with launch.cancelled_on_error():
        check_model_files(model.path)  # a missing or cut-short weights file is named here, not by a worker
        tokenizer = load_tokenizer(model.path, model.trust_remote_code)
        encoder = TurnEncoder(tokenizer, config.env.system_prompt)
        settings = rollout_settings(config, context_length(load_model_config(model.path, model.trust_remote_code)))
        prepared = prepare_run_dir(config)
    rollout = config.rollout
    sampling = SamplingParams(rollout.max_new_tokens, rollout.temperature, rollout.top_p, rollout.top_k)
    greedy = SamplingParams(rollout.max_new_tokens, temperature=0.0)
    eval_seeds = list(range(config.eval.seed_start, config.eval.seed_start + config.eval.episodes))
    sync_args = (int(config.cluster.weight_sync_bucket_mb * 2**20), config.checks.weight_checksum)

    with timeline_written(config.run_dir, began) as worker_spans, StopSignals() as stop, \
            launch.running(worker_spans.take_from) as groups:
        tracker = MetricsTracker(config.run_dir, config.output.trackers, config.train.steps, prepared.resumed_at,
                                 columns=CONSOLE_COLUMNS[config.pipeline])
        if prepared.note:
            tracker.print(prepared.note)
        tracker.print(groups.plan.describe())
        write_placement(config.run_dir / "placement.json", groups)
        colocation = ColocationManager(groups.plan, dict(groups), PHASES)
        envs = EnvRollout(groups["actor_infer"].handles, groups["env"].handles, encoder, settings, sampling,
                          config.seed)
        advantages = EpisodeAdvantages(config.algorithm, rollout.samples)
        first_step, initial_eval, version = 0, {}, 0
        errors = EpisodeErrorWarnings()
        try:
            check_envs(groups["env"], config)
            if prepared.resume_from:
                state = read_driver_state(prepared.resume_from)
                first_step, initial_eval = state["step"], state.get("initial_eval", {})
                groups["actor_train"].call("load", str(prepared.resume_from / "model"), first_step)
                envs.load_state(state["rollout"], first_step)
                version = sync_weights(groups, colocation, *sync_args)["sync/version"]
                tracker.print(f"resumed from {prepared.resume_from} at step {first_step}")
            else:
                initial_eval = evaluate(envs, colocation, eval_seeds, greedy, "eval at step 0", errors)
                tracker.log(0, initial_eval)  # its line, `step 0/N  eval_success ...`, is the initial eval's
            metrics: dict[str, float] = {}
            for step in range(first_step + 1, config.train.steps + 1):
                started, step_began = time.perf_counter(), time.time()
                colocation.enter("rollout")
                with span("rollout"):
                    result = envs.next_batch(step, version)
                logged = config.output.samples_logged_per_step
                failed_logged = readable(failed_samples(result.failed[:logged]), tokenizer)  # why, for the log
                if not result.groups:  # nothing to train on: say why, do not go on as if it were a step
                    write_samples(config.run_dir / "samples.jsonl", step, failed_logged, len(failed_logged))
                    raise no_episodes_error(f"step {step}", result.failed,
                                            sum(len(group.episodes) for group in result.dropped), rollout.group_size)
                warn(errors.lines(f"step {step}", result.failed))
                episodes = [e for group in result.groups for e in group.episodes]
                metrics = {**result.metrics, **episode_metrics(episodes, "rollout")}
                with stop.critical():
                    samples = episode_samples(episodes, {g.index: i for i, g in enumerate(result.groups)},
                                              rollout.samples)
                    if samples:  # none only if every turn was empty
                        batch = collate(samples, tokenizer.pad_token_id)
                        with span("advantages"):
                            metrics.update(advantages(batch, samples, episodes))
                        metrics.update(train_on(batch, groups, colocation, config))
                        metrics.update(sync_weights(groups, colocation, *sync_args))
                        version = int(metrics["sync/version"])
                    metrics["train/samples"] = float(len(samples))
                    metrics.update(colocation.pop_metrics())
                    if step == config.train.steps or config.eval.every_steps and step % config.eval.every_steps == 0:
                        metrics.update(evaluate(envs, colocation, eval_seeds, greedy, f"eval at step {step}", errors))
                    metrics["time/step"] = time.perf_counter() - started
                    tracker.log(step, metrics)
                    written = readable(samples[:logged], tokenizer) + failed_logged
                    write_samples(config.run_dir / "samples.jsonl", step, written, len(written))
                    state = {"step": step, "rollout": envs.state(), "initial_eval": initial_eval}
                    if step == config.train.steps or config.output.save_every_steps and \
                            step % config.output.save_every_steps == 0:
                        with span("checkpoint"):
                            save_checkpoint(config.run_dir, groups, state)
                    record(STEP_SPAN, step_began, time.time(), step=step)
        except KeyboardInterrupt:
            tracker.print("interrupted: resume=true continues from the newest checkpoint")
            tracker.close()
            raise
        finally:
            envs.close()
        final = {**{f"initial_{k}": v for k, v in initial_eval.items()}, **metrics}
        if "eval/success" in final and "initial_eval/success" in final:
            tracker.print(f"eval success: {final['initial_eval/success']:.3f} at start -> "
                          f"{final['eval/success']:.3f} after {config.train.steps} steps")
        tracker.close()
    # drawn once the workers stopped: drawing adds nothing to the run's peak memory
    plot_curves(config.run_dir, ("rollout/return", "rollout/success", "eval/success"))
    return final


def rollout_settings(config: AgenticConfig, model_context: int | None) -> EnvRolloutSettings:
    """`EnvRolloutSettings` from the config; the context limit from the model unless the config sets one."""
    rollout = config.rollout
    limit = rollout.max_context_tokens or model_context or 4096
    if model_context is not None and limit > model_context:
        raise ConfigError(f"rollout.max_context_tokens ({limit}) is longer than the model's context "
                          f"({model_context} tokens)")
    if rollout.max_new_tokens >= limit:
        raise ConfigError(f"rollout.max_new_tokens ({rollout.max_new_tokens}) leaves no room for a prompt in "
                          f"{limit} tokens of context")
    return EnvRolloutSettings(
        groups_per_step=rollout.groups_per_step, group_size=rollout.group_size,
        group_redundancy=rollout.group_redundancy, refill_bound=rollout.refill_bound, samples=rollout.samples,
        history_turns=rollout.history_turns, max_turns=config.env.max_turns, max_context_tokens=limit,
        max_staleness=min(rollout.max_staleness, config.train.steps),  # none can be older than the run is long
        lockstep=rollout.lockstep, step_timeout_s=config.env.step_timeout_s, watchdog_s=config.cluster.watchdog_s,
        train_seed_bound=max(config.eval.seed_start, 1))


def train_on(batch, groups, colocation: ColocationManager, config: AgenticConfig) -> dict[str, float]:
    """Reference logprobs when a KL term needs them, then the actor update."""
    actor = groups["actor_train"]
    if config.algorithm.needs_reference:
        batch.extras["ref_logprobs"] = reference_logprobs(batch, groups, colocation, config.roles.reference.backend)
    colocation.enter("actor_train")
    with span("actor_train"):
        return actor.call("train", batch)


def readable(samples: list, tokenizer) -> list:
    """The samples with their whole text (observations, turn markers and moves) for `samples.jsonl`."""
    for sample in samples:
        sample.prompt_text = tokenizer.decode(sample.prompt_ids, skip_special_tokens=False)
        sample.response_text = tokenizer.decode(sample.response_ids, skip_special_tokens=False)
    return samples


def evaluate(envs: EnvRollout, colocation: ColocationManager, seeds: list[int], greedy: SamplingParams,
             where: str, errors: EpisodeErrorWarnings) -> dict[str, float]:
    """One greedy episode per held-out seed: `eval/success`, `eval/return`, ...

    Raises:
        StepFailedError: every eval episode failed (a success rate of 0 would mean nothing).
    """
    if not seeds:
        return {}
    colocation.enter("rollout")
    with span("eval"):
        episodes = envs.evaluate(seeds, greedy)
    failed = [episode for episode in episodes if episode.status == SampleStatus.FAILED]
    if len(failed) == len(episodes):
        raise no_episodes_error(where, failed, 0, 1)
    warn(errors.lines(where, failed))
    return {**episode_metrics(episodes, "eval"), "eval/episodes_failed": float(len(failed))}


def check_envs(env_workers, config: AgenticConfig) -> None:
    """Make and reset one env with `env.kwargs` (and one with `env.eval_kwargs`) on env worker 0 before anything
    is played: an env that cannot be made (a constructor that refuses its kwargs) or reset stops the run here
    with one line, instead of failing every episode.

    Raises:
        ConfigError: the env could not be made or reset (its traceback, when it raised, in `details`).
    """
    env = config.env
    for setting, kwargs, eval_mode in (("env.kwargs", env.kwargs, False), ("env.eval_kwargs", env.eval_kwargs, True)):
        if kwargs is None:
            continue
        reply = env_workers.get([env_workers.handles[0].check.remote(eval_mode)], "check", [0])[0]
        if "error" in reply:
            error = ConfigError(f"env {env.id!r} with {setting} {kwargs}: one env could not be made and reset "
                                f"before the first step: {reply['error']}")
            error.details, error.details_label = reply.get("traceback", ""), "env traceback"
            raise error


def warn(lines: list[str]) -> None:
    """Print warning lines on stderr, as the other run-time warnings are."""
    for line in lines:
        print(f"rollflow: warning: {line}", file=sys.stderr, flush=True)

