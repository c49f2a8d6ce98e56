"""Typed run configuration: one pydantic schema, YAML file + `a.b=c` overrides, validated on load.

Unknown keys are errors that name the key and suggest the nearest valid one. Batch sizes carry their unit
in the name and each quantity is set once; indivisible combinations are rejected with a message that says
which numbers to change.
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollflow.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    check_hyperparams,
)
from rollflow.errors import ConfigError

BUNDLED_MODEL = "tiny"  # `model.path: tiny` loads the model shipped in rollflow/assets/


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Strict):
    """Which model to train. `path` is `tiny` (bundled), a local HF directory, or a hub id."""

    path: str = BUNDLED_MODEL
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    trust_remote_code: bool = False


class DatasetConfig(Strict):
    """A prompt dataset: a built-in synthetic `task` or a JSONL `path` (set exactly one)."""

    task: str | None = None  # built-in synthetic task, e.g. "add2"
    split: Literal["train", "eval"] = "train"  # which split of a synthetic task
    path: str | None = None  # JSONL file with a `prompt` column (+ optional `answer` and extra columns)
    limit: int | None = Field(default=None, gt=0)  # use only the first N rows

    @model_validator(mode="after")
    def _one_source(self) -> DatasetConfig:
        if (self.task is None) == (self.path is None):
            raise ValueError("set exactly one of `task` (built-in synthetic data) or `path` (a JSONL file)")
        return self


class DataConfig(Strict):
    train: DatasetConfig = DatasetConfig(task="add2", split="train")
    eval: DatasetConfig | None = DatasetConfig(task="add2", split="eval", limit=200)
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    apply_chat_template: bool = True  # wrap each prompt as a user turn with the tokenizer's chat template
    max_prompt_tokens: int = Field(default=256, gt=0)  # longer prompts are a data error
    shuffle: bool = True


class RolloutConfig(Strict):
    prompts_per_step: int = Field(default=16, gt=0)
    samples_per_prompt: int = Field(default=8, gt=0)
    max_new_tokens: int = Field(default=8, gt=0)
    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)  # 0 = off

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt


class RewardFunctionConfig(Strict):
    name: str  # registered reward name or dotted path `pkg.module:function`
    weight: float = 1.0
    kwargs: dict[str, Any] = {}  # extra keyword arguments passed to the function


class RewardConfig(Strict):
    functions: list[RewardFunctionConfig] = [RewardFunctionConfig(name="math_answer")]


NormalizationMode = Literal["none", "batch", "group", "running"]
CorrectionLevel = Literal["token", "sequence", "geometric"]


class TrainInferCorrectionConfig(Strict):
    """Train-inference mismatch correction in the actor loss (`algorithms.train_infer_correction`).

    The ratio is `exp(old_logprobs - rollout_logprobs)`: trainer vs inference engine on the sampled tokens.
    """

    weight_level: CorrectionLevel | None = "token"  # truncated IS (TIS) weights; null = weights of 1
    upper_bound: float = Field(default=2.0, gt=0)  # TIS truncation
    mask_level: CorrectionLevel | None = None  # masked IS (MIS): drop tokens/sequences outside [low, high]
    low: float = Field(default=0.5, gt=0)
    high: float = Field(default=2.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> TrainInferCorrectionConfig:
        if self.low > self.high:
            raise ValueError(f"need low <= high, got low={self.low}, high={self.high}")
        if self.weight_level is None and self.mask_level is None:
            raise ValueError("set weight_level (TIS) or mask_level (MIS), "
                             "or set train_infer_correction: null")
        return self


class AlgorithmConfig(Strict):
    """Algorithm choices by registry name; `*_kwargs` are checked against each function's signature.

    The advantage stage runs, in order: difficulty mask, overlong filter, overlong reward shaping, reward
    normalization and clipping, KL penalty in the reward, the estimator, advantage whitening and clipping
    (docs/algorithms.md). Every option below is off by default.
    """

    advantage: str = "grpo"
    advantage_kwargs: dict[str, Any] = {}
    policy_loss: str = "ppo"
    policy_loss_kwargs: dict[str, Any] = {}
    loss_aggregation: str = "token_mean"
    kl_loss_coef: float = Field(default=0.0, ge=0)  # > 0 adds coef * KL(policy || reference) to the loss
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    # Reward shaping, before the estimator.
    reward_norm_mean: NormalizationMode = "none"  # scope of the mean subtracted from the scalar reward
    reward_norm_std: NormalizationMode = "none"  # scope of the std it is divided by
    reward_clip: float | None = Field(default=None, gt=0)  # clamp rewards to [-clip, clip] after normalizing
    overlong_buffer: int | None = Field(default=None, gt=0)  # DAPO soft overlong penalty: the last N tokens
    overlong_penalty_factor: float = Field(default=1.0, ge=0)  # penalty at rollout.max_new_tokens
    overlong_filter: bool = False  # zero the loss of truncated samples (DAPO overlong filtering)
    difficulty_mask: tuple[float, float] | None = None  # [low, high]: train groups with low < mean reward < high
    kl_reward_coef: float = Field(default=0.0, ge=0)  # > 0 adds -coef * KL(policy || reference) per token
    kl_reward_estimator: str = "k1"
    kl_reward_controller: Literal["fixed", "adaptive"] = "fixed"
    kl_reward_target: float | None = Field(default=None, gt=0)  # adaptive: the KL to steer towards
    kl_reward_horizon: float = Field(default=10000.0, gt=0)  # adaptive: in samples
    # Advantage post-processing, after the estimator.
    whiten_advantages: bool = False  # zero mean, unit std over the batch's trained tokens
    advantage_clip: float | None = Field(default=None, gt=0)  # clamp advantages to [-clip, clip]
    # Actor loss.
    train_infer_correction: TrainInferCorrectionConfig | None = None  # TIS / MIS; null = off
    # Critic loss (advantage: gae).
    value_clip: float | None = Field(default=0.5, gt=0)  # clip the value update around the rollout-time value

    @model_validator(mode="after")
    def _known_names(self) -> AlgorithmConfig:
        """Unknown registry names and options fail at load time, listing the valid ones."""
        checks = [
            (ADVANTAGE_ESTIMATORS, self.advantage, self.advantage_kwargs),
            (POLICY_LOSSES, self.policy_loss, self.policy_loss_kwargs),
            (LOSS_AGGREGATIONS, self.loss_aggregation, None),
            (KL_ESTIMATORS, self.kl_estimator, None),
            (KL_ESTIMATORS, self.kl_reward_estimator, None),
        ]
        for registry, name, kwargs in checks:
            if name not in registry:
                raise ValueError(registry.unknown_message(name))
            if kwargs is not None:
                check_hyperparams(registry.get(name), kwargs)
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
        return self

    @property
    def needs_reference(self) -> bool:
        """KL in the loss or in the reward, or on-policy distillation (the reference is the teacher)."""
        return self.kl_loss_coef > 0 or self.kl_reward_coef > 0 or self.advantage == "opd"

    @property
    def needs_critic(self) -> bool:
        return self.advantage == "gae"


class TrainConfig(Strict):
    steps: int = Field(default=100, gt=0)
    lr: float = Field(default=1e-5, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(default=0, ge=0)  # optimizer steps of linear LR warm-up
    lr_schedule: Literal["constant", "cosine"] = "constant"  # after warm-up; cosine decays to 0 at the end
    max_grad_norm: float = Field(default=1.0, gt=0)
    train_micro_batch_size: int = Field(default=32, gt=0)  # samples per forward/backward
    optimizer_steps_per_step: int = Field(default=1, gt=0)  # mini-batches per RL step (PPO epochs of 1)
    critic_lr: float = Field(default=1e-5, gt=0)  # the critic's AdamW LR (advantage: gae); same schedule
    critic_warmup_steps: int = Field(default=0, ge=0)  # RL steps that train only the critic, not the actor


class EvalConfig(Strict):
    every_steps: int = Field(default=10, ge=0)  # 0 = only before the first and after the last step
    max_new_tokens: int | None = None  # default: rollout.max_new_tokens


class RoleConfig(Strict):
    """One role's workers. On CPU a worker's share of cores sets its torch thread count."""

    num_workers: int = Field(default=1, gt=0)
    num_cpus: float = Field(default=1.0, gt=0)  # CPU slots each worker reserves (and its thread count)
    # Device indices this role's workers use (ROLL's AutoDeviceMapping), split evenly over the workers. Roles
    # whose devices overlap are colocated and time-share; disjoint roles run concurrently. None: the role
    # needs no device of its own (CPU default: every role shares the machine's CPU slots).
    device_mapping: list[int] | None = None


class LoraConfig(Strict):
    """Train LoRA adapters (PEFT) instead of all weights; the base model stays frozen."""

    rank: int = Field(default=8, gt=0)
    alpha: float = Field(default=16.0, gt=0)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    target_modules: list[str] | str = "all-linear"  # PEFT names, or "all-linear"


class ActorTrainConfig(RoleConfig):
    backend: str = "torch"  # "torch" (one process) or "fsdp2" (data parallel over num_workers ranks)
    backend_kwargs: dict[str, Any] = {}
    lora: LoraConfig | None = None


class ActorInferConfig(RoleConfig):
    engine: str = "hf"
    max_batch_size: int = Field(default=256, gt=0)  # sequences decoded together
    max_in_flight_requests: int = Field(default=64, gt=0)  # requests the router sends one worker at a time
    engine_kwargs: dict[str, Any] = {}


class ReferenceConfig(RoleConfig):
    """The frozen reference policy (KL terms) and the teacher of on-policy distillation (`advantage: opd`)."""

    model_path: str | None = None  # default: model.path; a teacher must share the policy's tokenizer


class RolesConfig(Strict):
    actor_train: ActorTrainConfig = ActorTrainConfig()
    actor_infer: ActorInferConfig = ActorInferConfig()
    reference: ReferenceConfig = ReferenceConfig()  # started when algorithm.needs_reference
    critic: RoleConfig = RoleConfig()  # value model, started when algorithm.advantage is gae
    reward: RoleConfig = RoleConfig()  # model-based rewards (LLM judge, reward model), started when used


class ClusterConfig(Strict):
    address: str | None = None  # None: start a local Ray; "auto" or host:port: join a running cluster
    num_cpus: int | None = None  # CPUs a local Ray may use (default: all)
    device: Literal["cpu", "gpu"] = "cpu"  # what a device index in roles.*.device_mapping names
    num_devices: int | None = None  # devices per node (default: the CPUs or GPUs Ray sees per node)
    weight_sync_bucket_mb: float = Field(default=64.0, gt=0)  # trainer -> engines transfer piece size
    # object_store: through Ray's object store (anywhere); broadcast: a torch process group of the trainer's
    # rank 0 and the engines (gloo on CPU, NCCL GPU to GPU)
    weight_sync_transport: Literal["object_store", "broadcast"] = "object_store"


class ChecksConfig(Strict):
    logprob_parity_samples: int = Field(default=8, ge=0)  # step-0 trainer-vs-engine logprob check
    logprob_parity_tolerance: float = Field(default=1e-2, gt=0)  # max abs diff that stops the run
    # Test hook: corrupt the weight transfer after this many syncs (flip one byte after the checksum is taken)
    # to prove the engines catch it and the run stops. Never set it in a real run.
    fault_injection_flip_sync_byte_at: int | None = Field(default=None, ge=1)


class OutputConfig(Strict):
    dir: str = "runs"
    save_every_steps: int = Field(default=0, ge=0)  # 0 = only the final checkpoint
    samples_logged_per_step: int = Field(default=4, ge=0)
    trackers: list[Literal["console", "jsonl", "tensorboard"]] = ["console", "jsonl", "tensorboard"]


# Backend arguments the actor_train worker fills from typed config keys; backend_kwargs must not repeat them.
RESERVED_BACKEND_KWARGS = {
    "model_path", "dtype", "lr", "betas", "weight_decay", "warmup_steps", "max_grad_norm", "micro_batch_size",
    "lr_schedule", "total_steps", "trust_remote_code", "max_response_length", "lora", "trainable", "value_head",
    "device",
}


class RunConfig(Strict):
    """A whole `rollflow train` run."""

    name: str = "run"
    pipeline: Literal["rlvr"] = "rlvr"
    seed: int = 0
    resume: bool = False
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    roles: RolesConfig = RolesConfig()
    cluster: ClusterConfig = ClusterConfig()
    checks: ChecksConfig = ChecksConfig()
    output: OutputConfig = OutputConfig()

    @model_validator(mode="after")
    def _batch_sizes_divide(self) -> RunConfig:
        samples = self.rollout.samples_per_step
        mini_batches = self.train.optimizer_steps_per_step
        if samples % mini_batches:
            raise ValueError(
                f"rollout.prompts_per_step x rollout.samples_per_prompt = {samples} samples per step is not "
                f"divisible by train.optimizer_steps_per_step = {mini_batches}; change one of them"
            )
        mini_batch = samples // mini_batches
        micro = self.train.train_micro_batch_size
        workers = self.roles.actor_train.num_workers
        if mini_batch % workers:
            raise ValueError(
                f"each optimizer step trains on {mini_batch} samples, which the {workers} data-parallel ranks "
                f"(roles.actor_train.num_workers) cannot split evenly; change rollout.prompts_per_step, "
                f"train.optimizer_steps_per_step or roles.actor_train.num_workers"
            )
        if mini_batch % (micro * workers) and micro * workers < mini_batch:
            raise ValueError(
                f"each optimizer step trains on {mini_batch} samples, which is not divisible by "
                f"train.train_micro_batch_size ({micro}) x roles.actor_train.num_workers ({workers}); "
                f"change train.train_micro_batch_size or rollout.prompts_per_step"
            )
        return self

    @model_validator(mode="after")
    def _backend_fits_the_roles(self) -> RunConfig:
        actor = self.roles.actor_train
        if actor.num_workers > 1 and actor.backend == "torch":
            raise ValueError(
                f"roles.actor_train.num_workers is {actor.num_workers} but the torch backend trains in one "
                "process; set roles.actor_train.backend: fsdp2 for data-parallel training"
            )
        reserved = sorted(set(actor.backend_kwargs) & RESERVED_BACKEND_KWARGS)
        if reserved:
            raise ValueError(
                f"roles.actor_train.backend_kwargs sets {', '.join(reserved)}, which rollflow sets from the "
                "config; use the config key instead (e.g. roles.actor_train.lora, train.lr, model.dtype)"
            )
        if actor.lora is not None and actor.backend != "torch":
            raise ValueError(f"roles.actor_train.lora works with the torch backend only (got {actor.backend!r})")
        if self.roles.critic.num_workers > 1:
            raise ValueError("roles.critic.num_workers > 1 is not supported yet; the critic trains in one process")
        return self

    @model_validator(mode="after")
    def _algorithm_fits_the_run(self) -> RunConfig:
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
    def run_dir(self) -> Path:
        return Path(self.output.dir) / self.name


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any, defaults: dict[str, Any]) -> None:
    """Set `tree[a][b]... = value`; a section missing from `tree` starts as its default, so `a.b.c=1`
    changes one key of the default section instead of replacing the section."""
    keys = dotted.split(".")
    node, default = tree, defaults
    for key in keys[:-1]:
        default = default.get(key) if isinstance(default, dict) else None
        child = node.get(key)
        if child is None:
            child = node[key] = copy.deepcopy(default) if isinstance(default, dict) else {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {key!r} is a value, not a section")
        node = child
    node[keys[-1]] = value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=c` overrides; values are parsed as YAML (`3`, `1e-5`, `true`, `[1, 2]`, `null`)."""
    defaults = RunConfig().model_dump(mode="json")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({err.problem})") from None
        _set_dotted(tree, key.strip(), value, defaults)
    return tree


def _fields_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The field names of the sub-model that `loc` (a pydantic error location, minus the last key) points at."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        field = current.model_fields.get(part) if isinstance(current, type) else None
        if field is None:
            return []
        annotation = field.annotation
        current = next(
            (arg for arg in _flatten_annotation(annotation) if isinstance(arg, type) and issubclass(arg, BaseModel)),
            None,
        )
        if current is None:
            return []
    return list(current.model_fields) if isinstance(current, type) else []


def _flatten_annotation(annotation: Any) -> list[Any]:
    args = getattr(annotation, "__args__", None)
    if not args:
        return [annotation]
    return [leaf for arg in args for leaf in _flatten_annotation(arg)]


def _describe(error: dict[str, Any]) -> str:
    loc = tuple(error["loc"])
    where = ".".join(str(p) for p in loc) or "config"
    if error["type"] == "extra_forbidden":
        valid = _fields_at(RunConfig, loc[:-1])
        near = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
        hint = f"; did you mean {'.'.join([*map(str, loc[:-1]), near[0]])!r}?" if near else ""
        return f"unknown config key {where!r}{hint} (valid here: {', '.join(valid)})"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] in ("value_error", "assertion_error") and (not loc or isinstance(error.get("input"), dict)):
        return f"{where}: {message}" if loc else message
    return f"{where}: {message} (got {error.get('input')!r})"


def build_config(tree: dict[str, Any]) -> RunConfig:
    """Validate a raw config tree; raise `ConfigError` with one line per problem."""
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError("; ".join(_describe(e) for e in err.errors())) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (or start from defaults when `path` is None), apply overrides, validate.

    Raises:
        ConfigError: missing or unreadable file, bad YAML, unknown key, wrong type, bad batch sizes.
    """
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path} is not valid YAML: {err}".replace("\n", " ")) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of keys, not {type(loaded).__name__}")
        tree = loaded or {}
    return build_config(apply_overrides(tree, overrides or []))


def dump_config(config: RunConfig) -> str:
    """The resolved config as YAML (what `--print-config` prints and what the run directory keeps)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
