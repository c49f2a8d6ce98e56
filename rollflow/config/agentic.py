"""The agentic pipeline's config: environments instead of prompt datasets, multi-turn rollouts, and the
trajectory- and step-level algorithms (StarPO, GiGPO, step REINFORCE, IPA chunk credit)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rollflow.algorithms.registries import (
    AGENTIC_ADVANTAGES,
)
from rollflow.config.rlvr import LossFields, TrainInferCorrectionConfig, check_exact_old_logprobs
from rollflow.config.rollout_fields import GroupFlowFields, SamplingFields
from rollflow.config.sections import EvalFields, RunConfigBase, Strict


class FaultInjectionConfig(Strict):
    """Make env steps fail on purpose (a test hook of the env workers' fault handling)."""

    raise_fraction: float = Field(default=0.0, ge=0, le=1, description="Steps that raise an exception.")
    hang_fraction: float = Field(default=0.0, ge=0, le=1, description="Steps that hang for `hang_s`.")
    hang_s: float = Field(default=3600.0, gt=0, description="How long a hanging step sleeps.")


class SimulatedLatencyConfig(Strict):
    """Slow every env step down by a log-normal delay (what a remote or heavy env costs; `bench/agentic_async.py`)."""

    median_s: float = Field(gt=0, description="Median delay of one step, in seconds.")
    sigma: float = Field(default=1.0, ge=0, description="Log-normal shape: larger is a heavier tail.")


class EnvConfig(Strict):
    id: str | list[str] = Field(
        default="frozenlake",
        description="The environment: a built-in (`frozenlake`, `sokoban`, `countdown`, `guess_number`; "
                    "`prompts`, a prompt dataset's rows as one-turn episodes; `tool_use`, tools around any env: "
                    "[tools.md](tools.md)), "
                    "`gem:<id>` (any env of the `gem-llm` package), `gym:<id>` (a gymnasium env with text "
                    "observations), a dotted path `pkg.module:factory`, or `http://host:port/ENV` (an env served "
                    "by `rollflow env serve`; a list of such URLs spreads episodes over several servers, least "
                    "loaded first). See [agentic.md](agentic.md) and [env_service.md](env_service.md).")
    kwargs: dict[str, Any] = Field(default={}, description="Keyword arguments of the env's constructor.")
    eval_kwargs: dict[str, Any] | None = Field(
        default=None, description="Constructor arguments of the eval envs; `null`: `kwargs`.")
    max_turns: int = Field(
        default=8, gt=0,
        description="Most model turns in one episode; an episode still running then is `truncated` (the env may "
                    "end it sooner).")
    step_timeout_s: float = Field(
        default=30.0, gt=0,
        description="Time limit of one env reset or step; one that raises, runs longer or returns what the "
                    "protocol forbids fails its trajectory (counted in `rollout/failed`, logged in "
                    "`samples.jsonl`), and spares or new groups take its place; a step (or eval) in which every "
                    "trajectory fails stops the run, naming the first error.")
    system_prompt: str | None = Field(
        default=None, description="A system message before the first observation; `null`: none.")
    fault_injection: FaultInjectionConfig | None = Field(
        default=None, description="Test hook: training env steps that raise or hang on purpose; `null`: off.")
    simulated_latency: SimulatedLatencyConfig | None = Field(
        default=None, description="Benchmark hook: a log-normal delay before every env step; `null`: off.")

    @field_validator("id")
    @classmethod
    def _id_form(cls, value: str | list[str]) -> str | list[str]:
        """A list holds only env server URLs, all of one env; a URL has a host and names the env (no network)."""
        from rollflow.envs.make import env_urls
        from rollflow.errors import RollflowError

        try:
            urls = env_urls(value)
        except RollflowError as err:
            raise ValueError(str(err)) from None
        return value if urls is None or isinstance(value, str) else urls


class AgenticRolloutConfig(SamplingFields, GroupFlowFields):
    """How episodes are played and turned into samples: `groups_per_step` env seeds a step, `group_size`
    episodes each (the shared rollout vocabulary, `rollflow.config.rollout_fields`)."""

    groups_per_step: int = Field(
        default=8, gt=0, description="Env groups (one seed each) whose trajectories one step trains on.")
    group_redundancy: int = Field(
        default=0, ge=0,
        description="Start `group_size` + this many envs per group and keep the first `group_size` that finish "
                    "(the slowest are aborted); failed trajectories are replaced from the spares. A group "
                    "left with fewer than `group_size` is dropped and a new group takes its place.")
    samples: Literal["trajectory", "step"] = Field(
        default="trajectory",
        description="`trajectory`: one sample per episode, its turns concatenated token-exactly (the model's "
                    "tokens trained, observation tokens masked). `step`: one sample per turn, its prompt the "
                    "last `history_turns` turns and the current observation.")
    history_turns: int = Field(
        default=0, ge=0, description="`samples: step`: earlier turns (observation, action) kept in the prompt.")
    max_context_tokens: int | None = Field(
        default=None, gt=0,
        description="A trajectory whose next turn would exceed this many tokens (prompt and turns) ends "
                    "`truncated`; `null`: the model's `max_position_embeddings`.")
    deterministic: bool = Field(
        default=False,
        description="Play each step's env groups in rounds: every turn of the step's episodes goes to the engines "
                    "as one batch per engine, in (group, episode) order, whatever order the envs answer in (the "
                    "same run gets the same batches); `false`: each turn is sent as soon as its env answers, so a "
                    "slow env holds up only its own episode.")
    lockstep: bool = Field(
        default=False,
        description="Play a step's envs in lockstep (every env's turn waits for all others': the synchronous "
                    "batch-of-envs baseline of `bench/agentic_async.py`); `false`: each env loops on its own.")


class AgenticAlgorithmConfig(LossFields):
    """The advantage (per episode or per step) and the actor loss."""

    ADVANTAGES = AGENTIC_ADVANTAGES

    advantage: str = Field(
        default="starpo",
        description="`starpo` (episode return, group-normalized: trajectory-level GRPO; `{normalize_std: "
                    "false}`: REINFORCE with a group baseline), `gigpo` (episode advantage + step advantage "
                    "within groups of identical anchor states) or `step_reinforce`; see "
                    "[algorithms.md](algorithms.md).")
    gamma: float = Field(default=1.0, ge=0, le=1, description="Discount of the step returns (gigpo, step_reinforce).")

    @property
    def needs_reference(self) -> bool:
        return self.kl_loss_coef > 0

    @property
    def needs_critic(self) -> bool:
        return False


class AgenticEvalConfig(EvalFields):
    """The agentic pipeline's `eval` section: greedy episodes on held-out seeds."""

    episodes: int = Field(default=100, ge=0, description="Held-out episodes, one per seed; 0: no eval.")
    seed_start: int = Field(
        default=1_000_000, ge=0,
        description="Eval seeds are `seed_start`, `seed_start + 1`, ...; training seeds are drawn below it.")


class AgenticConfig(RunConfigBase):
    """A run of the agentic pipeline (`pipeline: agentic`)."""

    pipeline: Literal["agentic"] = Field(default="agentic", description="Selects this pipeline.")
    data: None = Field(default=None, description="Not used: the environments make the episodes (`env`).")
    env: EnvConfig = Field(default=EnvConfig(), description="The environment the policy acts in.")
    rollout: AgenticRolloutConfig = Field(
        default=AgenticRolloutConfig(), description="How episodes are played and turned into samples.")
    algorithm: AgenticAlgorithmConfig = Field(
        default=AgenticAlgorithmConfig(), description="The advantage and the actor loss.")
    eval: AgenticEvalConfig = Field(default=AgenticEvalConfig(), description="Greedy eval on held-out seeds.")

    @model_validator(mode="after")
    def _env_exists(self) -> AgenticConfig:
        """The env id, and what its kwargs can say without making it (a `tool_use` env's tools), before Ray."""
        from rollflow.envs.make import check_env_id, check_env_settings
        from rollflow.errors import RollflowError

        try:
            check_env_id(self.env.id)
        except (RollflowError, KeyError) as err:
            raise ValueError(str(err)) from None
        for setting, kwargs in (("env.kwargs", self.env.kwargs), ("env.eval_kwargs", self.env.eval_kwargs)):
            try:
                check_env_settings(self.env.id, kwargs)
            except (RollflowError, KeyError) as err:
                raise ValueError(f"{setting}: {err}") from None
        return self

    @model_validator(mode="after")
    def _asynchronous_rollout_fits(self) -> AgenticConfig:
        if not self.rollout.max_staleness:
            return self
        engines, trainer = self.roles.actor_infer.device_mapping, self.roles.actor_train.device_mapping
        if engines is None or trainer is None or set(engines) & set(trainer):
            raise ValueError("rollout.max_staleness > 0 plays envs while actor_train trains, so the engines need "
                             "devices of their own; set roles.actor_infer.device_mapping and "
                             "roles.actor_train.device_mapping to different devices (e.g. [1] and [0])")
        if "train_infer_correction" not in self.algorithm.model_fields_set:
            self.algorithm.train_infer_correction = TrainInferCorrectionConfig()
        return self

    @model_validator(mode="after")
    def _exact_old_logprobs_fit(self) -> AgenticConfig:
        check_exact_old_logprobs(self)
        return self

    @model_validator(mode="after")
    def _lockstep_is_synchronous(self) -> AgenticConfig:
        if self.rollout.lockstep and self.rollout.max_staleness:
            raise ValueError("rollout.lockstep (the synchronous batch-of-envs baseline) needs max_staleness: 0")
        return self
