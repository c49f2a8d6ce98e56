"""Agentic pipeline: play env groups -> advantages per episode or per step -> train -> sync -> eval.

The driver runs the frame (`rollflow.pipelines.loop`); `AgenticStep` says what a step is. Env workers hold the
environments, engine workers the policy, and the rollout core plays env groups between them (`EnvGroups`: each
env on its own, no barrier between envs) with the policy RLVR's prompt groups get. Evaluation plays one greedy
episode per held-out seed and reports `eval/success`.
"""

from __future__ import annotations

import sys

from rollflow.cluster.colocation import ColocationManager
from rollflow.cluster.groups import WorkerGroups
from rollflow.config.agentic import AgenticConfig
from rollflow.config.rlvr import stale_old_logprobs_warnings
from rollflow.data.multiturn import TurnEncoder
from rollflow.data.sample import SampleStatus
from rollflow.engines.base import SamplingParams
from rollflow.errors import ConfigError
from rollflow.inputs.prompt_sets import check_no_vision_critic, run_context_length, vision_processor
from rollflow.models import check_model_files, load_model_config, load_tokenizer
from rollflow.pipelines.loop import Progress, run_pipeline
from rollflow.pipelines.rl_step import RLStep, StepSamples
from rollflow.rollout.core import RolloutCore, RolloutResult
from rollflow.rollout.env_groups import EnvGroups, EpisodeSettings, SeedSource, turns_that_fit
from rollflow.rollout.episode_advantages import EpisodeAdvantages
from rollflow.rollout.episodes import (
    ContextLimitWarning,
    EpisodeErrorWarnings,
    TurnBudget,
    episode_metrics,
    no_episodes_error,
)
from rollflow.rollout.filters import usable
from rollflow.rollout.settings import core_settings
from rollflow.spans import span
from rollflow.trackers.samples import write_samples
from rollflow.trackers.trackers import AGENTIC_COLUMNS


def agentic_roles(config: AgenticConfig) -> list[str]:
    """The roles an agentic run starts, in start order."""
    roles = ["actor_train", "actor_infer", "env"]
    if config.algorithm.needs_reference and config.roles.actor_train.lora is None:
        roles.append("reference")
    return roles


def run_agentic(config: AgenticConfig, manage_ray: bool = True) -> dict[str, float]:
    """Train a policy in an environment with multi-turn RL. Returns the final metrics (with the initial and
    final `eval/success`).

    Args:
        config: the run config.
        manage_ray: start Ray and shut it down at the end; False runs in the caller's session.
    """
    return run_pipeline(AgenticStep(config), manage_ray)


class AgenticStep(RLStep):
    """An agentic step: the shared RL step (`rollflow.pipelines.rl_step.RLStep`) over env groups (episodes played
    against env workers), with advantages per episode or per turn (`EpisodeAdvantages`) and greedy eval on
    held-out seeds."""

    columns = AGENTIC_COLUMNS
    plot_keys = ("rollout/return", "rollout/success", "eval/success")

    def __init__(self, config: AgenticConfig):
        super().__init__(config)
        self.errors = EpisodeErrorWarnings()
        rollout = config.rollout
        self.sampling = SamplingParams(rollout.max_new_tokens, rollout.temperature, rollout.top_p, rollout.top_k)
        self.greedy = SamplingParams(rollout.max_new_tokens, temperature=0.0)
        self.eval_seeds = list(range(config.eval.seed_start, config.eval.seed_start + config.eval.episodes))

    def roles(self) -> list[str]:
        return agentic_roles(self.config)

    def check_inputs(self, roles: list[str]) -> list[str]:
        """The model's files (a missing or cut-short weights file is named here, not by a worker), its
        tokenizer and context, and that the system prompt leaves room for a turn (`check_system_prompt_fits`)."""
        model = self.config.model
        check_model_files(model.path)
        self.tokenizer = load_tokenizer(model.path, model.trust_remote_code)
        model_config = load_model_config(model.path, model.trust_remote_code)
        self.processor = vision_processor(model.path, model_config, self.tokenizer, model.trust_remote_code)
        check_no_vision_critic(self.processor, self.config.algorithm)
        self.encoder = TurnEncoder(self.tokenizer, self.config.env.system_prompt, processor=self.processor)
        self.settings = episode_settings(self.config, run_context_length(self.config, model_config))
        check_system_prompt_fits(self.encoder, self.settings, self.sampling.max_new_tokens)
        return stale_old_logprobs_warnings(self.config)

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    def build_advantages(self) -> EpisodeAdvantages:
        return EpisodeAdvantages(self.config.algorithm)

    def build_core(self, groups: WorkerGroups) -> RolloutCore:
        """One env made and reset (`check_envs`) before anything is played, its tools (if any) rendered into the
        first prompt, its first turn checked against the context (`check_turn_budget`); then the rollout core
        over env groups."""
        tools, first_observations = check_envs(groups["env"], self.config)
        if tools:  # the env's tools go into the first prompt, by the chat template
            self.encoder = TurnEncoder(self.tokenizer, self.config.env.system_prompt, tools, self.processor)
        budget, lines = check_turn_budget(self.encoder, first_observations, self.settings,
                                          self.sampling.max_new_tokens)
        warn(lines)
        self.context_warning = ContextLimitWarning(budget)
        core = env_rollout(self.config, groups["actor_infer"].handles, groups["env"].handles, self.encoder,
                           self.settings, self.sampling)
        self.eval_program = core.program.for_eval(self.greedy)
        return core

    def evaluate(self, step: int) -> dict[str, float]:
        return evaluate(self.core, self.eval_program, self.colocation, self.eval_seeds, f"eval at step {step}",
                        self.errors, self.context_warning)

    def checked(self, step: int, result: RolloutResult) -> tuple[StepSamples, dict[str, float]]:
        """The step's episodes as samples; the failed episodes' samples made readable for the log.

        Raises:
            StepFailedError: no group finished (the failed episodes' samples are logged first: why).
        """
        logged = self.config.output.samples_logged_per_step
        failed = [s for s in result.samples if s.status == SampleStatus.FAILED]
        failed_logged = readable(failed[:logged], self.tokenizer)  # why, for the log
        samples = usable(result.samples)
        if not samples:  # nothing to train on: say why, do not go on as if it were a step
            write_samples(self.config.run_dir / "samples.jsonl", step, failed_logged, len(failed_logged))
            played = {s.episode.key for s in result.samples if s.status == SampleStatus.FILTERED}
            raise no_episodes_error(f"step {step}", failed, len(played), self.config.rollout.group_size)
        warn(self.errors.lines(f"step {step}", failed))
        warn(self.context_warning.lines(f"step {step}", samples))
        work = StepSamples(samples, readable(samples[:logged], self.tokenizer) + failed_logged)
        return work, {**result.metrics, **episode_metrics(samples, "rollout", failed)}

    def train(self, step: int, work: StepSamples) -> dict[str, float]:
        metrics = super().train(step, work)
        metrics["train/samples"] = float(len(work.usable))
        return metrics

    def summary_lines(self, final: dict[str, float], progress: Progress) -> list[str]:
        if "eval/success" not in final or "initial_eval/success" not in final:
            return []
        return [f"eval success: {final['initial_eval/success']:.3f} at start -> "
                f"{final['eval/success']:.3f} after {self.config.train.steps} steps"]


def episode_settings(config: AgenticConfig, model_context: int | None) -> EpisodeSettings:
    """`EpisodeSettings` from the config; the context limit from the model unless the config sets one."""
    rollout = config.rollout
    limit = rollout.max_context_tokens or model_context or 4096
    if model_context is not None and limit > model_context:
        raise ConfigError(f"rollout.max_context_tokens ({limit}) is longer than the model's context "
                          f"({model_context} tokens)")
    if rollout.max_new_tokens >= limit:
        raise ConfigError(f"rollout.max_new_tokens ({rollout.max_new_tokens}) leaves no room for a prompt in "
                          f"{limit} tokens of context")
    return EpisodeSettings(
        group_size=rollout.group_size, group_redundancy=rollout.group_redundancy, samples=rollout.samples,
        history_turns=rollout.history_turns, max_turns=config.env.max_turns, max_context_tokens=limit,
        step_timeout_s=config.env.step_timeout_s)


def check_system_prompt_fits(encoder: TurnEncoder, settings: EpisodeSettings, max_new_tokens: int) -> None:
    """The first prompt without its observation (the system prompt and the chat markers) and a turn's
    `max_new_tokens` must fit the context: checked before any env is made.

    Raises:
        ConfigError: they do not (one line, with the numbers).
    """
    prefix = len(encoder.first_prompt(""))
    if prefix + max_new_tokens > settings.max_context_tokens:
        raise ConfigError(f"env.system_prompt takes {prefix} tokens with the chat template's markers, and with "
                          f"rollout.max_new_tokens = {max_new_tokens} that is over the context of "
                          f"{settings.max_context_tokens} tokens before any observation; shorten env.system_prompt, "
                          "lower rollout.max_new_tokens or use a model with a longer context")


def check_turn_budget(encoder: TurnEncoder, first_observations: dict[str, tuple[str, object]],
                      settings: EpisodeSettings, max_new_tokens: int) -> tuple[TurnBudget, list[str]]:
    """Check the envs' first turn (seed 0's observation, `check_envs`) against the context, and how many of
    `env.max_turns` turns surely fit it (`turns_that_fit`), each turn taking all its `max_new_tokens` and each
    observation after it as long as the first (after a tool env's call: the tool results' markers alone).

    Args:
        encoder: renders the turns (with the env's tools).
        first_observations: `env.kwargs` (and `env.eval_kwargs`) -> (seed 0's first observation, its images).
        settings: the episodes' context and turn limits.
        max_new_tokens: `rollout.max_new_tokens`.

    Returns:
        The turns' `TurnBudget` (for `ContextLimitWarning`), and a warning line when fewer than `env.max_turns`
        turns surely fit.

    Raises:
        ConfigError: not even the first turn fits (one line, with the numbers).
    """
    context, prefix = settings.max_context_tokens, len(encoder.first_prompt(""))
    budget = TurnBudget(context, max_new_tokens, settings.max_turns, prefix)
    warnings: list[str] = []
    for setting, (observation, images) in first_observations.items():
        vision = encoder.vision(images)
        first = len(encoder.first_prompt(observation, vision))
        if first + max_new_tokens > context:
            raise ConfigError(
                f"the first turn does not fit the context: with {setting}, the first prompt (seed 0) has {first} "
                f"tokens ({prefix} of them the system prompt, tools and chat markers), and with "
                f"rollout.max_new_tokens = {max_new_tokens} that is over the context of {context} tokens "
                "(rollout.max_context_tokens, default the model's); lower rollout.max_new_tokens, shorten "
                "env.system_prompt or the observations, or use a model with a longer context")
        if encoder.tools:  # the turn after a call: the tool results' markers (the results may be short)
            later, what = len(encoder.tool_turn([""], [])), "the tool results' markers"
        else:  # the turn after a move: an observation as long as the first
            later, what = len(encoder.observation_turn(observation, [], vision)), "an observation as long as the first"
        fit = turns_that_fit(first, later, settings, max_new_tokens)
        if fit < settings.max_turns and not warnings:
            fits = f"{fit} turn surely fits" if fit == 1 else f"{fit} turns surely fit"
            warnings.append(
                f"env.max_turns is {settings.max_turns}, but only {fits} the context of {context} tokens: with "
                f"{setting}, the first prompt (seed 0) takes {first} tokens and each later turn up to "
                f"rollout.max_new_tokens = {max_new_tokens} plus {later} for {what}; an episode "
                "whose turns run that long ends truncated at the context limit, its last turn unplayed "
                "(rollout/context_truncated_frac). Lower rollout.max_new_tokens or env.max_turns, or use a model "
                "with a longer context")
    return budget, warnings


def env_rollout(config: AgenticConfig, engines: list, env_workers: list, encoder: TurnEncoder,
                settings: EpisodeSettings, sampling: SamplingParams) -> RolloutCore:
    """The run's rollout core playing env groups: training seeds drawn below `eval.seed_start`, the group
    policy per `rollout.*`."""
    program = EnvGroups(env_workers, encoder, settings, sampling)
    return RolloutCore(engines, program, SeedSource(config.seed, max(config.eval.seed_start, 1)),
                       core_settings(config))


def readable(samples: list, tokenizer) -> list:
    """The samples with their whole text (observations, turn markers and moves) for `samples.jsonl`."""
    for sample in samples:
        sample.prompt_text = tokenizer.decode(sample.prompt_ids, skip_special_tokens=False)
        sample.response_text = tokenizer.decode(sample.response_ids, skip_special_tokens=False)
    return samples


def evaluate(core: RolloutCore, program: EnvGroups, colocation: ColocationManager, seeds: list[int], where: str,
             errors: EpisodeErrorWarnings, context: ContextLimitWarning | None = None) -> dict[str, float]:
    """One greedy episode per held-out seed (`program`: the eval envs, greedy): `eval/success`, `eval/return`, ...
    Episode errors are warned of by `errors`, episodes cut at the context limit by `context`.

    Raises:
        StepFailedError: every eval episode failed (a success rate of 0 would mean nothing).
    """
    if not seeds:
        return {}
    colocation.enter("rollout")
    with span("eval"):
        samples = core.evaluate(seeds, program)
    failed = [sample for sample in samples if sample.status == SampleStatus.FAILED]
    if len(failed) == len({s.episode.key for s in samples}):
        raise no_episodes_error(where, failed, 0, 1)
    warn(errors.lines(where, failed))
    if context is not None:
        warn(context.lines(where, samples, "eval"))
    return {**episode_metrics(samples, "eval"), "eval/episodes_failed": float(len(failed))}


def check_envs(env_workers, config: AgenticConfig) -> tuple[list[dict], dict[str, tuple[str, object]]]:
    """Make and reset one env with `env.kwargs` (and one with `env.eval_kwargs`) on env worker 0 before anything
    is played: an env that cannot be made (a constructor that refuses its kwargs) or reset stops the run here
    with one line, instead of failing every episode.

    Returns:
        The env's tools (JSON-schema specs, from its `tools()`; [] for an env without tools), and per setting
        checked (`env.kwargs`, `env.eval_kwargs`) seed 0's first observation and its images (None: none).

    Raises:
        ConfigError: the env could not be made or reset (its traceback, when it raised, in `details`), or the
            eval envs have other tools than the training envs (the prompts would differ).
    """
    env = config.env
    tools: list[list[dict]] = []
    first_observations: dict[str, tuple[str, object]] = {}
    for setting, kwargs, eval_mode in (("env.kwargs", env.kwargs, False), ("env.eval_kwargs", env.eval_kwargs, True)):
        if kwargs is None:
            continue
        reply = env_workers.get([env_workers.handles[0].check.remote(eval_mode)], "check", [0])[0]
        if "error" in reply:
            error = ConfigError(f"env {env.id!r} with {setting} {kwargs}: one env could not be made and reset "
                                f"before the first step: {reply['error']}")
            error.details, error.details_label = reply.get("traceback", ""), "env traceback"
            raise error
        tools.append(reply.get("tools", []))
        first_observations[setting] = (reply.get("observation", ""), reply.get("images"))
    if len(tools) == 2 and tools[0] != tools[1]:
        names = [[tool.get("function", tool).get("name") for tool in listed] for listed in tools]
        raise ConfigError(f"env.eval_kwargs gives the eval envs other tools ({names[1]}) than env.kwargs gives the "
                          f"training envs ({names[0]}); the model would be evaluated on other prompts")
    return (tools[0] if tools else []), first_observations


def warn(lines: list[str]) -> None:
    """Print warning lines on stderr, as the other run-time warnings are."""
    for line in lines:
        print(f"rollflow: warning: {line}", file=sys.stderr, flush=True)
