"""The RLVR pipeline's config: rollout, rewards and the RL algorithm, on top of `RunConfigBase`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from rollflow.algorithms.registries import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    TURN_LEVEL_LOSSES,
    check_options,
)
from rollflow.config.rollout_fields import GroupFlowFields, SamplingFields
from rollflow.config.sections import RunConfigBase, Strict
from rollflow.registry import Registry

# Estimators whose baseline is the mean of the sample's prompt group: with one sample per prompt the sample is
# its own baseline and every reward-based advantage is 0 (tests/config check this against the estimators).
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "lite_ppo")


class RolloutConfig(SamplingFields, GroupFlowFields):
    """How RLVR samples: `groups_per_step` prompts a step, `group_size` completions each (the shared rollout
    vocabulary, `rollflow.config.rollout_fields`)."""

    @property
    def samples_per_step(self) -> int:
        return self.groups_per_step * self.group_size


class RewardFunctionConfig(Strict):
    name: str = Field(
        description="A registered reward (see [rewards.md](rewards.md)), a dotted path "
                    "`pkg.module:function` (importable: installed, on `PYTHONPATH` or in the working "
                    "directory), or a file path `path/to/file.py:function` (relative to the working "
                    "directory, or absolute).")
    weight: float = Field(default=1.0, description="Its weight in the training reward.")
    kwargs: dict[str, Any] = Field(default={}, description="Extra keyword arguments passed to the function.")


class RewardConfig(Strict):
    functions: list[RewardFunctionConfig] = Field(
        default=[RewardFunctionConfig(name="math_answer")],
        description="The reward functions, at least one, each name once. The training reward is their "
                    "weighted sum; each is logged as `rollout/reward/NAME`.")
    timeout_s: float = Field(
        default=60.0, gt=0,
        description="Time limit of one call of a plain (Python) reward function; a call that runs longer "
                    "fails its sample (`failed`, with the reason in `samples.jsonl`).")
    num_threads: int = Field(
        default=4, gt=0,
        description="Threads that run plain reward functions off the driver's scheduling loop, so a slow "
                    "reward never stalls generation.")
    domains: dict[str, list[RewardFunctionConfig]] | None = Field(
        default=None,
        description="With `data.domains`: a domain's own reward functions, by domain name, used for its "
                    "prompts instead of `functions` (the same rules: at least one, each name once). Domains "
                    "not listed use `functions`. Each reward is still logged as `rollout/reward/NAME`, "
                    "averaged over the samples of the domains that use it. `null`: every domain uses "
                    "`functions`.")

    @field_validator("functions")
    @classmethod
    def _distinct_names(cls, functions: list[RewardFunctionConfig]) -> list[RewardFunctionConfig]:
        """What `rollflow.rewards.combine_rewards` would refuse at run time, refused at load time."""
        return _checked_functions(functions)

    @field_validator("domains")
    @classmethod
    def _each_domain_distinct_names(cls, domains: dict[str, list[RewardFunctionConfig]] | None
                                    ) -> dict[str, list[RewardFunctionConfig]] | None:
        for name, functions in (domains or {}).items():
            try:
                _checked_functions(functions)
            except ValueError as error:
                raise ValueError(f"domain {name!r}: {error}") from None
        return domains

    def functions_of(self, domain: str | None) -> list[RewardFunctionConfig]:
        """The reward functions of `domain`'s prompts: its own (`domains`), else `functions`."""
        return (self.domains or {}).get(domain, self.functions) if domain is not None else self.functions


def _checked_functions(functions: list[RewardFunctionConfig]) -> list[RewardFunctionConfig]:
    if not functions:
        raise ValueError("a run needs at least one reward function")
    names = [function.name for function in functions]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"each reward may appear once (its name keys its logged value); repeated: "
                         f"{', '.join(repeated)}")
    return functions


NormalizationMode = Literal["none", "batch", "group", "running"]
CorrectionLevel = Literal["token", "sequence", "geometric"]


class TrainInferCorrectionConfig(Strict):
    """Train-inference mismatch correction in the actor loss (`algorithms.train_infer_correction`).

    The ratio is `exp(old_logprobs - rollout_logprobs)`: trainer vs inference engine on the sampled tokens.
    """

    weight_level: CorrectionLevel | None = Field(
        default="token",
        description="Truncated importance sampling (TIS): weight the policy-gradient term by `min(ratio, "
                    "upper_bound)`, the ratio taken per `token`, per `sequence`, or as the sequence's "
                    "per-token `geometric` mean; `null`: weights of 1.")
    upper_bound: float = Field(default=2.0, gt=0, description="TIS truncation: the largest weight.")
    mask_level: CorrectionLevel | None = Field(
        default=None,
        description="Masked importance sampling (MIS): drop the tokens or sequences whose ratio, at this "
                    "level, is outside `[low, high]`; `null`: off.")
    low: float = Field(default=0.5, gt=0, description="MIS: the lowest ratio kept.")
    high: float = Field(default=2.0, gt=0, description="MIS: the highest ratio kept (`low <= high`).")

    @model_validator(mode="after")
    def _bounds(self) -> TrainInferCorrectionConfig:
        if self.low > self.high:
            raise ValueError(f"need low <= high, got low={self.low}, high={self.high}")
        if self.weight_level is None and self.mask_level is None:
            raise ValueError("set weight_level (TIS) or mask_level (MIS), "
                             "or set train_infer_correction: null")
        return self


def check_exact_old_logprobs(config) -> None:
    """`algorithm.old_logprobs: exact` swaps the trainer's weights for older versions' in one process: the
    torch backend's (an fsdp2 rank holds a shard, a simulated trainer none)."""
    backend = config.roles.actor_train.backend
    if config.algorithm.old_logprobs == "exact" and backend != "torch":
        raise ValueError(f"algorithm.old_logprobs=exact needs roles.actor_train.backend=torch (got {backend!r}); "
                         "or old_logprobs: current")


def stale_old_logprobs_warnings(config) -> list[str]:
    """A line to print when an asynchronous run bounds staleness at 2 or more with `current` old logprobs: the
    PPO clip then sees none of the staleness (it rides in the truncated train-inference ratio), and on the
    io-bound bench such a run collapsed where `exact` learned (docs/async.md)."""
    k = min(config.rollout.max_staleness, config.train.steps)
    if k < 2 or config.algorithm.old_logprobs != "current":
        return []
    fix = ("algorithm.old_logprobs: exact" if config.roles.actor_train.backend == "torch"
           else "rollout.max_staleness: 1 (exact old logprobs need the torch backend)")
    return [f"rollout.max_staleness is {k} with algorithm.old_logprobs: current: tokens up to {k} versions old are "
            "trained with the clip blind to their staleness, which collapsed a K = 2 run of the io-bound bench "
            f"(docs/async.md); set {fix}"]


class LossFields(Strict):
    """The actor loss settings every RL pipeline shares (the advantage estimator, its registry and the rest of
    the algorithm are each pipeline's: `advantage` and `ADVANTAGES`)."""

    ADVANTAGES: ClassVar[Registry[Callable[..., Any]]]  # the registry `advantage` names an estimator of

    advantage_kwargs: dict[str, Any] = Field(
        default={},
        description="The estimator's options, e.g. `{gamma: 1.0, lam: 0.95}` for `gae` or `{step_weight: 1.0}` "
                    "for `gigpo`; a misspelled one fails at load time.")
    policy_loss: str = Field(
        default="ppo",
        description="Policy loss, by registry name, e.g. `ppo`, `gspo` or `cispo` (agentic runs also `ipa_chunk`: "
                    "one importance ratio per turn); all of them in [algorithms.md](algorithms.md).")
    policy_loss_kwargs: dict[str, Any] = Field(
        default={},
        description="The loss's options, e.g. `{clip_low: 0.2, clip_high: 0.28, dual_clip: 3.0}`; a "
                    "misspelled one fails at load time.")
    loss_aggregation: str = Field(
        default="token_mean",
        description="How per-token losses become one: `token_mean`, `seq_mean_token_mean`, "
                    "`seq_mean_token_sum` or `seq_mean_token_sum_norm` (whose L is "
                    "`rollout.max_new_tokens`); how it splits over micro-batches and ranks: "
                    "[algorithms.md](algorithms.md).")
    kl_loss_coef: float = Field(
        default=0.0, ge=0,
        description="> 0 adds coef * KL(policy ‖ reference) to the loss and starts the `reference` role.")
    kl_estimator: str = Field(
        default="k3", description="KL estimator of the loss term: `k1`, `k2` (= `mse`), `k3` or `abs`.")
    entropy_coef: float = Field(
        default=0.0, description="Weight of the entropy bonus in the actor loss; 0: off.")
    advantage_clip: float | None = Field(
        default=None, gt=0, description="Clamp advantages to `[-clip, clip]` after whitening; `null`: off.")
    train_infer_correction: TrainInferCorrectionConfig | None = Field(
        default=None,
        description="Train-inference mismatch correction in the actor loss (TIS weights, MIS masks), with "
                    "the ratio `exp(old_logprobs − rollout_logprobs)`; `null`: off.")
    old_logprobs: Literal["current", "exact"] = Field(
        default="current",
        description="The PPO ratio's old logprobs. `current`: the trainer's, under its weights at the start of "
                    "the step; with `rollout.max_staleness` > 0 the tokens of older versions then carry their "
                    "staleness into the train-inference ratio, and the clip sees none of it. `exact`: under the "
                    "weights of the version that sampled each token (actor_train keeps the last max_staleness + 1 "
                    "versions' trainable weights in host memory, one more forward per older version in a batch; "
                    "torch backend): the train-inference correction sees only the engine-trainer discrepancy and "
                    "the clip bounds the staleness. Use `exact` from `max_staleness: 2`: on the io-bound bench "
                    "`current` collapsed there (held-out accuracy 0.345 -> 0.250) where `exact` learned (-> 0.670) "
                    "([async.md](async.md)).")

    def _named(self) -> list[tuple[Registry[Callable[..., Any]], str, dict[str, Any] | None]]:
        """(registry, the name the config gives, the options it passes or None) for each registry name."""
        return [(self.ADVANTAGES, self.advantage, self.advantage_kwargs),  # type: ignore[attr-defined]
                (POLICY_LOSSES, self.policy_loss, self.policy_loss_kwargs),
                (LOSS_AGGREGATIONS, self.loss_aggregation, None),
                (KL_ESTIMATORS, self.kl_estimator, None)]

    @model_validator(mode="after")
    def _known_names(self) -> LossFields:
        """Unknown registry names and options fail at load time, listing the valid ones (without importing an
        implementation: `check_options`)."""
        for registry, name, options in self._named():
            if name not in registry:
                raise ValueError(registry.unknown_message(name))
            if options is not None:
                check_options(registry, name, options)
        return self


class AlgorithmConfig(LossFields):
    """Algorithm choices by registry name; `*_kwargs` are checked against each function's signature.

    The advantage stage runs, in order: difficulty mask, overlong filter, overlong reward shaping, reward
    normalization and clipping, KL penalty in the reward, the estimator, advantage whitening and clipping
    (docs/algorithms.md). Every option below is off by default.
    """

    ADVANTAGES = ADVANTAGE_ESTIMATORS

    advantage: str = Field(
        default="grpo",
        description="Advantage estimator, by registry name, e.g. `grpo`, `rloo`, `gae` (starts the `critic` "
                    "role) or `opd` (on-policy distillation from the `reference`); all of them in "
                    "[algorithms.md](algorithms.md).")
    # Reward shaping, before the estimator.
    reward_norm_mean: NormalizationMode = Field(
        default="none",
        description="Scope of the mean subtracted from the scalar reward: `none`, `batch`, `group` or "
                    "`running` (moments kept across steps and in checkpoints).")
    reward_norm_std: NormalizationMode = Field(
        default="none", description="Scope of the std the scalar reward is divided by (same choices).")
    reward_norm_by_domain: bool = Field(
        default=False,
        description="Take the `batch` and `running` moments of the reward normalization per domain (a "
                    "sample's `domain`: its `data.domains` name), running moments kept per domain (and in "
                    "checkpoints), so a domain whose rewards run high does not shift another's. `group` is "
                    "within one domain anyway.")
    reward_clip: float | None = Field(
        default=None, gt=0, description="Clamp rewards to `[-clip, clip]` after normalizing; `null`: off.")
    overlong_buffer: int | None = Field(
        default=None, gt=0,
        description="DAPO soft overlong punishment: a response within the last N tokens before "
                    "`rollout.max_new_tokens` loses reward linearly, up to `overlong_penalty_factor` at the "
                    "limit; `null`: off.")
    overlong_penalty_factor: float = Field(
        default=1.0, ge=0, description="The overlong penalty at `rollout.max_new_tokens`.")
    overlong_filter: bool = Field(
        default=False,
        description="DAPO overlong filtering: zero the loss of truncated samples (their reward still enters "
                    "the group statistics).")
    difficulty_mask: tuple[float, float] | None = Field(
        default=None,
        description="`[low, high]`: train only the groups whose mean reward is strictly inside `(low, "
                    "high)`, e.g. `[0.0, 1.0]` drops groups that all fail or all pass; `null`: off.")
    kl_reward_coef: float = Field(
        default=0.0, ge=0,
        description="β: > 0 adds -β * KL(policy ‖ reference) to the reward of every trained token and starts "
                    "the `reference` role.")
    kl_reward_estimator: str = Field(default="k1", description="KL estimator of the reward term.")
    kl_reward_controller: Literal["fixed", "adaptive"] = Field(
        default="fixed",
        description="`fixed` keeps β; `adaptive` moves it after each step to steer the KL towards "
                    "`kl_reward_target`.")
    kl_reward_target: float | None = Field(
        default=None, gt=0, description="The KL the `adaptive` controller steers towards (it needs one).")
    kl_reward_horizon: float = Field(
        default=10000.0, gt=0,
        description="The `adaptive` controller's horizon, in samples: `β ← β·(1 + clip(KL/target − 1, "
                    "±0.2)·B/horizon)` after a step of B samples.")
    # Advantage post-processing, after the estimator.
    whiten_advantages: bool = Field(
        default=False, description="Whiten advantages: zero mean, unit std over the batch's trained tokens.")
    # Actor loss.
    # Critic loss (advantage: gae).
    value_clip: float | None = Field(
        default=0.5, gt=0,
        description="Critic loss (`advantage: gae`): clip the value update to ± this around the rollout-time "
                    "value; `null`: unclipped.")

    def _named(self) -> list[tuple[Registry[Callable[..., Any]], str, dict[str, Any] | None]]:
        return [*super()._named(), (KL_ESTIMATORS, self.kl_reward_estimator, None)]

    @model_validator(mode="after")
    def _single_turn_loss(self) -> AlgorithmConfig:
        if self.policy_loss in TURN_LEVEL_LOSSES:
            raise ValueError(f"policy_loss {self.policy_loss!r} takes one ratio per turn of a multi-turn episode; "
                             "it works in the agentic pipeline (pipeline: agentic), not on single responses")
        return self

    @model_validator(mode="after")
    def _consistent_options(self) -> AlgorithmConfig:
        if self.difficulty_mask is not None and self.difficulty_mask[0] >= self.difficulty_mask[1]:
            raise ValueError(f"difficulty_mask [low, high] needs low < high, "
                             f"got {list(self.difficulty_mask)}")
        if self.kl_reward_controller == "adaptive" and self.kl_reward_target is None:
            raise ValueError("kl_reward_controller: adaptive needs kl_reward_target "
                             "(the KL to steer towards)")
        if self.kl_reward_controller == "adaptive" and self.kl_reward_coef == 0:
            raise ValueError("kl_reward_controller: adaptive needs kl_reward_coef > 0 "
                             "(the initial coefficient)")
        scopes = {self.reward_norm_mean, self.reward_norm_std}
        if self.reward_norm_by_domain and not {"batch", "running"} & scopes:
            raise ValueError("reward_norm_by_domain needs reward_norm_mean or reward_norm_std to be batch or "
                             "running (the scopes it splits by domain)")
        return self

    @property
    def needs_reference(self) -> bool:
        """KL in the loss or in the reward, or on-policy distillation (the reference is the teacher)."""
        return self.kl_loss_coef > 0 or self.kl_reward_coef > 0 or self.advantage == "opd"

    @property
    def needs_critic(self) -> bool:
        return self.advantage == "gae"


class RLVRConfig(RunConfigBase):
    """A run of the RLVR pipeline (`pipeline: rlvr`, the default)."""

    pipeline: Literal["rlvr"] = Field(default="rlvr", description="Selects this pipeline.")
    rollout: RolloutConfig = Field(
        default=RolloutConfig(),
        description="How rollouts are sampled. Derived, never set: samples per step = `groups_per_step × "
                    "group_size`; samples per optimizer step = that ÷ "
                    "`train.optimizer_steps_per_step`, which must split evenly over the "
                    "`roles.actor_train.num_workers` data-parallel ranks and be divisible by "
                    "`train.train_micro_batch_size` × ranks (when larger).")
    reward: RewardConfig = Field(default=RewardConfig(), description="How a sample's reward is computed.")
    algorithm: AlgorithmConfig = Field(
        default=AlgorithmConfig(),
        description="The RL algorithm, its options chosen by registry name and checked at load time. The "
                    "advantage stage runs, in order: difficulty mask, overlong filter, overlong reward "
                    "shaping, reward normalization and clipping, KL penalty in the reward, the estimator, "
                    "advantage whitening and clipping. Every option is off by default; see "
                    "[algorithms.md](algorithms.md#selecting-them-in-the-rlvr-pipeline).")

    @model_validator(mode="after")
    def _batch_sizes_divide(self) -> RLVRConfig:
        samples = self.rollout.samples_per_step
        mini_batches = self.train.optimizer_steps_per_step
        if samples % mini_batches:
            raise ValueError(
                f"rollout.groups_per_step x rollout.group_size = {samples} samples per step is not "
                f"divisible by train.optimizer_steps_per_step = {mini_batches}; change one of them"
            )
        mini_batch = samples // mini_batches
        micro = self.train.train_micro_batch_size
        workers = self.roles.actor_train.num_workers
        if mini_batch % workers:
            raise ValueError(
                f"each optimizer step trains on {mini_batch} samples, which the {workers} data-parallel ranks "
                f"(roles.actor_train.num_workers) cannot split evenly; change rollout.groups_per_step, "
                f"train.optimizer_steps_per_step or roles.actor_train.num_workers"
            )
        if mini_batch % (micro * workers) and micro * workers < mini_batch:
            raise ValueError(
                f"each optimizer step trains on {mini_batch} samples, which is not divisible by "
                f"train.train_micro_batch_size ({micro}) x roles.actor_train.num_workers ({workers}); "
                f"change train.train_micro_batch_size or rollout.groups_per_step"
            )
        return self

    @model_validator(mode="after")
    def _groups_fit_the_estimator(self) -> RLVRConfig:
        advantage = self.algorithm.advantage
        group_baseline = advantage == "reinforce_pp" and self.algorithm.advantage_kwargs.get("group_baseline")
        if self.rollout.group_size == 1 and (advantage in GROUP_ESTIMATORS or group_baseline):
            baseline = "with group_baseline " if group_baseline else ""
            raise ValueError(
                f"algorithm.advantage {advantage!r} {baseline}compares each sample with the other samples of "
                "its prompt, but rollout.group_size is 1: every advantage would be 0 and the policy "
                "would learn nothing from the reward; set rollout.group_size >= 2, or use an "
                "estimator without groups (reinforce, reinforce_pp, gae)")
        return self

    @model_validator(mode="after")
    def _domains_fit_the_run(self) -> RLVRConfig:
        domains, reward_domains = self.data.domains, self.reward.domains
        if reward_domains is not None and domains is None:
            raise ValueError("reward.domains gives domains their own rewards, but there are no domains: set "
                             "data.domains, or move the functions to reward.functions")
        unknown = sorted(set(reward_domains or {}) - set(domains or {}))
        if unknown:
            raise ValueError(f"reward.domains names {', '.join(map(repr, unknown))}, not a domain of "
                             f"data.domains (its domains: {', '.join(domains)})")
        prompts = self.rollout.groups_per_step
        for name, share in self.data.domain_shares().items():
            if share * prompts < 1:
                raise ValueError(
                    f"data.domains.{name} gets {float(share * prompts):.3g} prompts per step (share "
                    f"{float(share):.3g} of rollout.groups_per_step {prompts}); every domain needs at least "
                    "1: raise its share or rollout.groups_per_step")
        return self

    @model_validator(mode="after")
    def _domain_lengths_fit(self) -> RLVRConfig:
        for name, domain in (self.data.domains or {}).items():
            limit = domain.max_new_tokens or self.rollout.max_new_tokens
            if limit > self.rollout.max_new_tokens or domain.min_new_tokens > limit:
                raise ValueError(
                    f"data.domains.{name}: need min_new_tokens ({domain.min_new_tokens}) <= max_new_tokens "
                    f"({limit}) <= rollout.max_new_tokens ({self.rollout.max_new_tokens})")
        return self

    @model_validator(mode="after")
    def _asynchronous_rollout_fits(self) -> RLVRConfig:
        """Asynchronous training runs the engines while the trainer trains: they cannot share devices. Its
        samples are off-policy: the train-inference correction (TIS) is on unless the config sets it."""
        if not self.rollout.max_staleness:
            return self
        roles = self.roles
        trainer_side = ["actor_train"] + ["reference"] * self.algorithm.needs_reference \
            + ["critic"] * self.algorithm.needs_critic
        engines = roles.actor_infer.device_mapping
        for role in trainer_side:
            mapping = roles.of(role).device_mapping
            if engines is None or mapping is None or set(engines) & set(mapping):
                raise ValueError(
                    f"rollout.max_staleness > 0 (asynchronous training) runs the engines while {role} trains, so "
                    f"they need disjoint devices; set roles.actor_infer.device_mapping and "
                    f"roles.{role}.device_mapping to different devices (e.g. [1] and [0]), or max_staleness: 0")
        if "train_infer_correction" not in self.algorithm.model_fields_set:
            self.algorithm.train_infer_correction = TrainInferCorrectionConfig()
        return self

    @model_validator(mode="after")
    def _exact_old_logprobs_fit(self) -> RLVRConfig:
        check_exact_old_logprobs(self)
        return self

    @model_validator(mode="after")
    def _algorithm_fits_the_run(self) -> RLVRConfig:
        algorithm, train = self.algorithm, self.train
        if algorithm.overlong_buffer is not None and algorithm.overlong_buffer > self.rollout.max_new_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer ({algorithm.overlong_buffer}) is longer than "
                f"rollout.max_new_tokens ({self.rollout.max_new_tokens}), the length it counts back from; "
                "lower the buffer"
            )
        if train.critic_warmup_steps and not algorithm.needs_critic:
            raise ValueError(
                f"train.critic_warmup_steps is {train.critic_warmup_steps} but advantage "
                f"{algorithm.advantage!r} uses no critic; set it to 0 or use advantage: gae"
            )
        if train.critic_warmup_steps >= train.steps:
            raise ValueError(
                f"train.critic_warmup_steps ({train.critic_warmup_steps}) >= train.steps ({train.steps}): "
                "the actor would never train"
            )
        return self

    @property
    def actor_optimizer_steps(self) -> int:
        """The optimizer steps the actor takes in the run: `train.optimizer_steps_per_step` in every step after
        the critic's warm-up (`train.critic_warmup_steps`). Its learning-rate schedule spans them, so a cosine
        reaches 0 at the actor's last update, however many steps only the critic trained."""
        train = self.train
        return (train.steps - train.critic_warmup_steps) * train.optimizer_steps_per_step
