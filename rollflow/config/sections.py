"""The config sections every pipeline shares, and `RunConfigBase`, the fields of every run.

A pipeline's config (`rollflow.config.rlvr.RLVRConfig`, ...) extends `RunConfigBase` with its own sections;
`rollflow.config.loading` validates a YAML tree against the pipeline its `pipeline` key names. Every field
carries a `description`: `rollflow.config.reference` renders them into docs/config.md.
"""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from rollflow.backends import BACKENDS, check_backend_kwargs
from rollflow.backends.lora_config import LoraConfig
from rollflow.backends.settings import SETTINGS_FIELDS
from rollflow.config.simulation import SimConfig, check_simulated
from rollflow.config.values import (
    MAX_NAME_LENGTH,
    Strict,
    control_characters,
    is_default,
    name_problem,
    non_finite,
    plain_group_by_columns,
)
from rollflow.engines import ENGINES
from rollflow.errors import RollflowError

BUNDLED_MODEL = "tiny"  # `model.path: tiny` loads the model shipped in rollflow/assets/
SEED_LIMIT = 2**64  # torch's generators take a seed in [0, 2**64); a larger one overflows inside a worker
# A domain's name becomes part of metric names (`reward/NAME`, `rollout/NAME/samples`, `eval/NAME/accuracy`).
DOMAIN_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
RESERVED_DOMAIN_NAMES = ("mean", "std", "reward")  # taken: `reward/mean`, `reward/std`, `rollout/reward/NAME`


class ModelConfig(Strict):
    """Which model to train. `path` is `tiny` (bundled), a local HF directory, or a hub id."""

    path: str = Field(
        default=BUNDLED_MODEL,
        description="`tiny` (the small model bundled in `rollflow/assets/`), a local Hugging Face directory, "
                    "or a hub id. The trainers and engines start from it (the reference too, unless "
                    "`roles.reference.model_path` is set).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32",
        description="Parameter dtype of the trainers and the inference engines.")
    trust_remote_code: bool = Field(
        default=False,
        description="Passed to the Hugging Face loaders: run the modelling code a model's repository ships. "
                    "Only for models you trust.")
    freeze_vision_tower: bool = Field(
        default=False,
        description="A vision-language model: keep its vision tower (the image encoder and its merger) frozen; "
                    "only the language model trains, and weight syncs leave the engines' vision weights as they "
                    "are. `false`: the tower trains too (with `train.lora`, in full, beside the language model's "
                    "adapters). Ignored for a text model.")


class DatasetConfig(Strict):
    """A dataset: a built-in synthetic `task`, or a `path` naming a file, a `datasets` directory or a hub
    dataset (set exactly one); read by `rollflow.data.tables.read_rows`."""

    # An override of one source replaces the other: `data.eval.path=FILE` (what `rollflow eval --data FILE`
    # sets) over a config whose eval set is a `task` drops the `task`. Within one file both stay an error.
    override_replaces: ClassVar[dict[str, tuple[str, ...]]] = {"task": ("path", "subset"), "path": ("task",)}

    task: str | None = Field(
        default=None,
        description="A built-in synthetic task: `add2` (two-digit addition) or `sum3` (three one-digit "
                    "numbers). Set this or `path`; an override of either replaces the other (`rollflow eval "
                    "--data FILE` over a config's eval `task`).")
    split: str = Field(
        default="train",
        description="Which split: of a synthetic `task`, `train` (its training rows) or `eval` (its held-out "
                    "rows, the same for every run, whatever its seed); of a `datasets` dataset (a hub dataset, "
                    "a `DatasetDict` saved with `save_to_disk`, a directory of data files), the split name "
                    "(`test`; slices such as `train[:1000]` work). Ignored for a JSONL or parquet file.")
    path: str | None = Field(
        default=None,
        description="A JSONL or parquet file, a directory saved with `datasets` `save_to_disk` (or holding data "
                    "files: `train.jsonl`, `test.parquet`), or a Hugging Face hub dataset name (`owner/name`). "
                    "Parquet, directories and hub names need `pip install 'rollflow[data]'`. Rows hold the "
                    "pipeline's columns (for prompts, `data.prompt_key` and optionally an answer column) and any "
                    "extra columns. Set this or `task`.")
    subset: str | None = Field(
        default=None,
        description="A hub dataset's configuration name (`main` of `openai/gsm8k`); `null`: its default. "
                    "Only with a hub dataset `path`.")
    limit: int | None = Field(default=None, gt=0, description="Use only the first N rows; `null`: all rows.")

    @model_validator(mode="after")
    def _one_source(self) -> DatasetConfig:
        if (self.task is None) == (self.path is None):
            raise ValueError("set exactly one of `task` (built-in synthetic data) or `path` (a JSONL or parquet "
                             "file, a `datasets` directory or a hub dataset name)")
        return self

    @model_validator(mode="after")
    def _split_fits_the_source(self) -> DatasetConfig:
        if self.task is not None and self.split not in ("train", "eval"):
            raise ValueError(f"`split: {self.split}` with the built-in `task: {self.task}`: a synthetic task's "
                             "split is `train` or `eval`")
        if self.task is not None and self.subset is not None:
            raise ValueError(f"`subset: {self.subset}` is a hub dataset's configuration; the built-in `task: "
                             f"{self.task}` has none (drop `subset`)")
        if not self.split.strip():
            raise ValueError("`split` is empty: name a split (`train`)")
        return self


class DomainConfig(Strict):
    """One domain of a multi-domain run (`data.domains`): its prompts, its eval set, its share of each step."""

    train: DatasetConfig = Field(
        description="The domain's training prompts: `{task: NAME}` or `{path: FILE.jsonl}`, as `data.train`.")
    eval: DatasetConfig | None = Field(
        default=None,
        description="The domain's eval prompts, as `data.eval`, logged as `eval/NAME/accuracy`; `null`: the "
                    "domain is not evaluated.")
    share: float = Field(
        default=1.0, gt=0,
        description="The domain's share of each step's prompts, relative to the other domains' shares: they "
                    "are normalized to sum to 1 (`{a: 1, b: 3}` gives a 25% and b 75%). Each domain must get at "
                    "least one prompt a step: normalized share × `rollout.groups_per_step` >= 1.")
    max_new_tokens: int | None = Field(
        default=None, gt=0,
        description="The domain's own response length limit (at most `rollout.max_new_tokens`, which stays the "
                    "limit the context check and overlong shaping use); `null`: `rollout.max_new_tokens`.")
    min_new_tokens: int = Field(
        default=0, ge=0,
        description="The domain's responses cannot stop (EOS) before this many tokens (vLLM's `min_tokens`); "
                    "0: off.")


# one text for every data section's `image_key`
IMAGE_KEY_DOC = ("The column holding a row's images, for a vision-language model (Qwen2-VL's family): a file path "
                 "(relative to the dataset file's directory, or the working directory), a `datasets` image, or a "
                 "list of them. The prompt places them where it says `<image>`, else before its text. A row "
                 "without the column is text only; rows with images for a text-only model are a data error, and "
                 "so is a key other than the default that no row of the run's datasets has.")

class DataConfig(Strict):
    train: DatasetConfig | None = Field(
        default=DatasetConfig(task="add2", split="train"),
        description="The training prompts: `{task: NAME}` (built-in synthetic data) or `{path: FILE.jsonl}`. "
                    "`null` when `data.domains` is set (leave both `train` and `eval` unset then).")
    eval: DatasetConfig | None = Field(
        default=DatasetConfig(task="add2", split="eval", limit=200),
        description="The prompts of the greedy eval (see `eval`), in the same form; `null` disables eval. With "
                    "`data.domains`, each domain's `eval` instead.")
    domains: dict[str, DomainConfig] | None = Field(
        default=None,
        description="Train on several domains at once (math, code, rules, ...): name -> `{train, eval, "
                    "share}`, set instead of `data.train` / `data.eval`. Every step draws each domain's share "
                    "of `rollout.groups_per_step` (a deterministic smooth weighted round-robin), each domain "
                    "from its own shuffled epochs; its rows get the column `domain` = its name, which picks its "
                    "rewards (`reward.domains`) and names its metrics (`reward/NAME`, "
                    "`rollout/NAME/samples`, `eval/NAME/accuracy`). A name: a letter, then letters, digits or "
                    "`_`, at most 64 characters, not `mean`, `std` or `reward`. `null`: one dataset, "
                    "`data.train`.")
    prompt_key: str = Field(default="prompt", description="The column holding the user message.")
    image_key: str = Field(default="images", description=IMAGE_KEY_DOC)
    answer_key: str = Field(
        default="answer",
        description="The column holding the reference answer; rewards receive it as `answer`, whatever the "
                    "column is called.")
    apply_chat_template: bool = Field(
        default=True,
        description="Wrap each prompt as a user turn with the tokenizer's chat template (when it has one); "
                    "`false` tokenizes the raw text.")
    max_prompt_tokens: int = Field(
        default=256, gt=0,
        description="The longest prompt, in tokens; a longer prompt is a data error (never truncated).")
    shuffle: bool = Field(
        default=True,
        description="Reshuffle the training prompts every epoch (seeded by `seed`); `false` keeps the file's "
                    "order.")

    @model_validator(mode="before")
    @classmethod
    def _domains_replace_train_and_eval(cls, data: Any) -> Any:
        """With `domains`, `train` and `eval` are null. Left at their defaults they count as unset: a
        `data.domains.x.share=2` override fills the rest of `data` from the defaults."""
        if not isinstance(data, dict) or data.get("domains") is None:
            return data
        defaults = {key: cls.model_fields[key].default for key in ("train", "eval")}
        also_set = [key for key, default in defaults.items()
                    if data.get(key) is not None and not is_default(default, data[key])]
        if also_set:
            raise ValueError(f"set either `domains` or `train` / `eval`, not both ({' and '.join(also_set)} "
                             "set too); each domain has its own `train` and `eval` under data.domains")
        return {**data, "train": None, "eval": None}

    @field_validator("domains")
    @classmethod
    def _domain_names(cls, domains: dict[str, DomainConfig] | None) -> dict[str, DomainConfig] | None:
        if domains is None:
            return None
        if not domains:
            raise ValueError("no domains: name at least one, or set data.domains to null")
        for name in domains:
            if not DOMAIN_NAME.fullmatch(name):
                raise ValueError(f"domain name {name!r}: a letter, then letters, digits or '_', at most 64 "
                                 "characters (it becomes part of metric names)")
            if name in RESERVED_DOMAIN_NAMES:
                raise ValueError(f"domain name {name!r} is taken by a metric (reward/{name}); choose another")
        return domains

    @model_validator(mode="after")
    def _some_training_data(self) -> DataConfig:
        if self.train is None and self.domains is None:
            raise ValueError("train is null: set data.train (one dataset) or data.domains (several)")
        return self

    def domain_shares(self) -> dict[str, Fraction]:
        """Each domain's normalized share, exact: a share is read as the decimal it is written as, so shares
        0.1, 0.2 and 0.7 are exactly 1/10, 1/5 and 7/10 (their floats sum to 1.0000000000000002). Empty
        without `domains`."""
        shares = {name: Fraction(repr(domain.share)) for name, domain in (self.domains or {}).items()}
        total = sum(shares.values())
        return {name: share / total for name, share in shares.items()}


class TrainFields(Strict):
    """The `train` keys every pipeline shares: the run's length, AdamW, its schedule, micro-batching, and what a
    non-finite loss does (`TrainConfig` adds RL's, `SupervisedTrainConfig` the supervised ones)."""

    steps: int = Field(
        default=100, gt=0,
        description="Steps of the run. An RL step generates, rewards, computes advantages, trains and syncs the "
                    "weights to the engines; a supervised step is one optimizer step on `train.batch_size` rows.")
    lr: float = Field(default=1e-5, gt=0, description="The actor's AdamW learning rate (after warm-up).")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW `[beta1, beta2]`, each in [0, 1).")
    warmup_steps: int = Field(
        default=0, ge=0,
        description="Linear learning-rate warm-up, in optimizer steps (an RL step makes "
                    "`train.optimizer_steps_per_step` of them, a supervised step one); 0: none.")
    lr_schedule: Literal["constant", "cosine"] = Field(
        default="constant",
        description="The learning rate after warm-up: `constant`, or `cosine`, which decays to 0 at the last "
                    "step.")
    max_grad_norm: float = Field(default=1.0, gt=0, description="Clip gradients to this global norm.")
    train_micro_batch_size: int = Field(
        default=32, gt=0,
        description="Sequences per forward/backward pass (per data-parallel rank). Gradients accumulate and "
                    "the loss is normalized over the whole mini-batch, so it never changes the update, only "
                    "memory and speed.")
    on_nonfinite: Literal["stop", "skip_step"] = Field(
        default="stop",
        description="A non-finite loss or gradient norm: `stop` ends the run with one line before the bad "
                    "update reaches any weight (the last checkpoint stays good); `skip_step` drops that "
                    "optimizer step (counted in the `skipped_steps` metric) and goes on.")

    @field_validator("betas")
    @classmethod
    def _betas_below_one(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= beta < 1 for beta in betas):
            raise ValueError("AdamW betas must each be in [0, 1) (torch's AdamW refuses others)")
        return betas


class TrainConfig(TrainFields):
    """An RL pipeline's `train` section."""

    optimizer_steps_per_step: int = Field(
        default=1, gt=0,
        description="Mini-batches, i.e. optimizer steps, per RL step (PPO epochs of 1); > 1 recomputes the "
                    "old logprobs so PPO ratios are exact.")
    critic_lr: float = Field(
        default=1e-5, gt=0,
        description="The critic's AdamW learning rate (`algorithm.advantage: gae`); same warm-up and "
                    "schedule as the actor.")
    critic_warmup_steps: int = Field(
        default=0, ge=0,
        description="RL steps at the start that train only the critic while the actor stays frozen "
                    "(`advantage: gae`; must be < `train.steps`).")


class GroupByFields(Strict):
    """`eval.group_by`: the greedy eval's accuracy broken down by eval dataset columns."""

    group_by: list[str] = Field(
        default=[],
        description="Eval dataset columns to break the greedy accuracy down by: per value V of column C, "
                    "`eval/C=V/accuracy` and `eval/C=V/samples` (e.g. `[difficulty]` gives "
                    "`eval/difficulty=hard/accuracy`), printed in the run's last lines. Every eval row must "
                    "have each column (checked before the first step).")

    @field_validator("group_by")
    @classmethod
    def _plain_columns(cls, columns: list[str]) -> list[str]:
        return plain_group_by_columns(columns)


class EvalFields(Strict):
    """The `eval` key every pipeline shares."""

    every_steps: int = Field(
        default=10, ge=0,
        description="Greedy eval every N steps, and always before the first and after the last step; 0: only "
                    "those two.")


class EvalConfig(GroupByFields, EvalFields):
    """RLVR's `eval` section: the greedy eval on `data.eval`."""

    max_new_tokens: int | None = Field(
        default=None, gt=0,
        description="Response length limit of the eval, in tokens; `null`: `rollout.max_new_tokens`.")


class RoleConfig(Strict):
    """One role's workers. On CPU a worker's share of cores sets its torch thread count."""

    num_workers: int = Field(
        default=1, gt=0,
        description="Workers (Ray actors) of the role. Under `backend: fsdp2` they are the ranks of one "
                    "data-parallel model; `actor_train` and `critic` on the `torch` backend train in one "
                    "process, while `torch` reference workers are replicas that split a batch's rows.")
    num_cpus: float = Field(
        default=1.0, gt=0,
        description="CPU slots each worker reserves; a worker without a `device_mapping` runs this many "
                    "torch / OpenMP threads.")
    device_mapping: list[int] | None = Field(
        default=None,
        description="Global device indices of the role (ROLL's AutoDeviceMapping), split evenly over its "
                    "workers. Roles whose devices overlap are colocated and time-share; disjoint roles run "
                    "concurrently. `null`: no devices of its own (the CPU default: every role shares the "
                    "machine's CPU slots). See [placement.md](placement.md).")


class TrainerRoleConfig(RoleConfig):
    """A role whose workers hold a training backend (actor_train, critic, reference)."""

    backend: str = Field(
        default="torch",
        description="Training backend: `torch` (one process) or `fsdp2` (data parallel over `num_workers` "
                    "ranks); see [backends.md](backends.md). `sim`: simulated GPUs (`cluster.device: sim`, "
                    "[simulation.md](simulation.md)).")
    backend_kwargs: dict[str, Any] = Field(
        default={},
        description="Backend-specific options passed through, e.g. fsdp2's `mixed_precision`. Checked at "
                    "load time; a setting that has a config key of its own (`train.lr`, `model.dtype`, ...) "
                    "is rejected.")

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, name: str) -> str:
        if name not in BACKENDS:
            raise ValueError(BACKENDS.unknown_message(name))
        return name

    @model_validator(mode="after")
    def _backend_kwargs_are_its_own(self) -> TrainerRoleConfig:
        repeated = sorted(set(self.backend_kwargs) & SETTINGS_FIELDS)
        if repeated:
            raise ValueError(
                f"backend_kwargs sets {', '.join(repeated)}, which rollflow sets from the config; use the "
                "config key instead (e.g. roles.actor_train.lora, train.lr, model.dtype)")
        try:
            check_backend_kwargs(self.backend, self.backend_kwargs)
        except RollflowError as error:
            raise ValueError(str(error)) from None
        return self


class ActorTrainConfig(TrainerRoleConfig):
    lora: LoraConfig | None = Field(
        default=None,
        description="Train LoRA adapters instead of every weight (`torch` backend only); `null`: a full "
                    "fine-tune. See [lora.md](lora.md).")


class ActorInferConfig(RoleConfig):
    engine: str = Field(
        default="hf",
        description="Inference engine: `hf` (transformers, CPU or one GPU), `vllm` or `sglang`; see "
                    "[engines.md](engines.md). `sim`: a simulated GPU (`cluster.device: sim`, "
                    "[simulation.md](simulation.md)).")
    max_batch_size: int = Field(
        default=256, gt=0,
        description="Sequences one worker decodes together (vLLM's `max_num_seqs`, SGLang's "
                    "`max_running_requests`).")
    max_in_flight_requests: int = Field(
        default=64, gt=0,
        description="Requests (prompt groups) the router sends one worker at a time; the rest wait and go to "
                    "whichever worker frees up first.")
    engine_kwargs: dict[str, Any] = Field(
        default={},
        description="Engine-specific options passed through to the engine, e.g. any `vllm.AsyncEngineArgs` "
                    "or SGLang `ServerArgs` field.")
    hybrid: bool = Field(
        default=False,
        description="Run the engine inside `actor_train`'s worker (a hybrid engine: one process that "
                    "generates and trains in turn, weights copied and checked in memory) instead of a worker "
                    "of its own: one process fewer to start and hold, no weight transfer between processes. "
                    "CPU runs with the `hf` engine, one `torch` trainer and one engine, no `device_mapping`. "
                    "Ignored by a run without `actor_train` (`rollflow eval`). See [placement.md](placement.md).")

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, name: str) -> str:
        if name not in ENGINES:
            raise ValueError(ENGINES.unknown_message(name))
        return name


class ReferenceConfig(TrainerRoleConfig):
    """The frozen reference policy (KL terms) and the teacher of on-policy distillation (`advantage: opd`)."""

    model_path: str | None = Field(
        default=None,
        description="The reference model; `null`: `model.path` (the initial policy). A teacher for on-policy "
                    "distillation must share the policy's tokenizer.")


class RolesConfig(Strict):
    """Every role's workers, by role name. A pipeline starts the roles it needs (`PIPELINES[name].roles`)."""

    actor_train: ActorTrainConfig = Field(default=ActorTrainConfig(), description="The policy's trainer.")
    actor_infer: ActorInferConfig = Field(
        default=ActorInferConfig(), description="The inference engines that generate rollouts.")
    reference: ReferenceConfig = Field(
        default=ReferenceConfig(),
        description="The frozen reference policy, started when a KL term (`algorithm.kl_loss_coef` or "
                    "`algorithm.kl_reward_coef` > 0) or `advantage: opd` needs it. With LoRA the base model "
                    "inside `actor_train` serves instead.")
    critic: TrainerRoleConfig = Field(
        default=TrainerRoleConfig(),
        description="The value model, started when `algorithm.advantage` is `gae`; its learning rate is "
                    "`train.critic_lr`.")
    reward: RoleConfig = Field(
        default=RoleConfig(),
        description="Workers of each model-based reward (LLM judge, reward model), started when a reward "
                    "needs one; see [rewards.md](rewards.md).")
    env: RoleConfig = Field(
        default=RoleConfig(),
        description="Env workers of the agentic pipeline: each holds many environments, one thread each, and "
                    "runs every env step under `env.step_timeout_s`; see [agentic.md](agentic.md).")

    def of(self, role: str) -> RoleConfig:
        """The section of `role`."""
        return getattr(self, role)

    @model_validator(mode="after")
    def _one_process_backends(self) -> RolesConfig:
        for role in ("actor_train", "critic"):  # trained by one process unless data parallel
            section = self.of(role)
            if section.num_workers > 1 and section.backend == "torch":
                raise ValueError(
                    f"{role}.num_workers is {section.num_workers} but the torch backend trains in one "
                    f"process; set roles.{role}.backend: fsdp2 for data-parallel training")
        infer, train = self.actor_infer, self.actor_train
        if infer.hybrid:
            wrong = [f"{name} ({why})" for name, why, bad in (
                ("actor_infer.engine", f"{infer.engine!r}, not 'hf'", infer.engine != "hf"),
                ("actor_train.backend", f"{train.backend!r}, not 'torch'", train.backend != "torch"),
                ("actor_infer.num_workers", f"{infer.num_workers}, not 1", infer.num_workers != 1),
                ("actor_infer.device_mapping", "set", infer.device_mapping is not None),
                ("actor_train.device_mapping", "set", train.device_mapping is not None)) if bad]
            if wrong:
                raise ValueError("actor_infer.hybrid runs one hf engine inside the one torch trainer process, "
                                 f"on CPU without device_mapping; this config has {'; '.join(wrong)}. For "
                                 "separate engine workers set roles.actor_infer.hybrid=false")
        lora = self.actor_train.lora
        if lora is not None and self.actor_train.backend != "torch":
            raise ValueError(f"actor_train.lora works with the torch backend only "
                             f"(got {self.actor_train.backend!r})")
        return self


class ClusterConfig(Strict):
    address: str | None = Field(
        default=None,
        description="`null` starts a local Ray; `auto` or `host:port` joins a running cluster (passed to "
                    "`ray.init`).")
    num_cpus: int | None = Field(
        default=None,
        description="CPUs a local Ray may use; `null`: all of them. Unused when joining a cluster.")
    device: Literal["cpu", "gpu", "sim"] = Field(
        default="cpu",
        description="What a device index in `roles.*.device_mapping` names: a CPU slot (core), a GPU, or a "
                    "simulated GPU (`sim`: the `sim` engine and backend run a hardware profile's costs, "
                    "`cluster.sim`; see [simulation.md](simulation.md)).")
    num_devices: int | None = Field(
        default=None,
        description="Devices per node; `null`: the CPUs or GPUs Ray sees on each node. Device `d` is local "
                    "device `d % num_devices` of node `d // num_devices`. With `device: sim`, the simulated "
                    "GPUs (one node).")
    sim: SimConfig = Field(
        default=SimConfig(),
        description="The simulated cluster of `device: sim`: hardware profile, time and token scales.")
    weight_sync_bucket_mb: float = Field(
        default=64.0, gt=0,
        description="Size of one piece of the trainer -> engines weight transfer, in MiB.")
    weight_sync_transport: Literal["object_store", "broadcast"] = Field(
        default="object_store",
        description="`object_store`: through Ray's object store (works anywhere); `broadcast`: a torch "
                    "process group of the trainer's rank 0 and the engines (gloo on CPU, NCCL GPU to GPU).")
    watchdog_s: float = Field(
        default=900.0, gt=0,
        description="Stop the run with an error naming the phase and the workers it waits on when a phase "
                    "makes no progress (no group generated or scored, no worker call returned) for this many "
                    "seconds.")


class ChecksConfig(Strict):
    logprob_parity_samples: int = Field(
        default=8, ge=0,
        description="At the first step the trainer recomputes the engine's logprobs of this many samples of "
                    "every engine worker; 0 skips the check.")
    logprob_parity_tolerance: float = Field(
        default=1e-2, gt=0,
        description="The largest absolute trainer-vs-engine logprob difference allowed; a larger one stops "
                    "the run.")
    weight_checksum: Literal["full", "bucket", "off"] = Field(
        default="bucket",
        description="`bucket`: the trainer hashes each weight bucket, each engine worker verifies it as it "
                    "arrives; `full`: one digest over all weights, verified after the last bucket; `off`: no "
                    "hashing (a corrupted transfer goes unnoticed). See "
                    "[placement.md](placement.md#checksum-modes).")
    fault_injection_flip_sync_byte_at: int | None = Field(
        default=None, ge=1,
        description="Test hook: corrupt the K-th weight transfer (flip one byte after the checksum is taken) "
                    "to prove the engines catch it and the run stops. Never set it in a real run.")

    @field_validator("weight_checksum", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        """YAML reads a bare `off` as false: `weight_checksum: off` means the mode "off"."""
        return "off" if value is False else value


class OutputConfig(Strict):
    dir: str = Field(
        default="runs", description="Parent of run directories: a run writes to `output.dir/name`.")

    @field_validator("dir")
    @classmethod
    def _printable_dir(cls, path: str) -> str:
        if not path:
            raise ValueError("must not be empty (`.` is the current directory)")
        control = control_characters(path)
        if control:
            raise ValueError(f"must not contain control characters ({control})")
        return path
    save_every_steps: int = Field(
        default=0, ge=0,
        description="Checkpoint every N steps, and after the last one; 0: only the final checkpoint.")
    samples_logged_per_step: int = Field(
        default=4, ge=0, description="Decoded samples written to `samples.jsonl` per step.")
    save_on_interrupt: bool = Field(
        default=True,
        description="On Ctrl-C (SIGINT) or SIGTERM, save a checkpoint of the last finished step before "
                    "exiting, so `resume: true` continues from it.")
    trackers: list[Literal["console", "jsonl", "tensorboard", "wandb"]] = Field(
        default=["console", "jsonl", "tensorboard"],
        description="Where metrics go: `console` (one line per step, with the time left), `jsonl` "
                    "(`metrics.jsonl`), `tensorboard` (TensorBoard events), `wandb` (a Weights & Biases run "
                    "named after the run, with the resolved config; resumed with the run; online or offline "
                    "as W&B's environment says, e.g. `WANDB_MODE=offline`; needs `pip install "
                    "\"rollflow[wandb]\"`). What each metric means: [metrics.md](metrics.md).")
    wandb_project: str = Field(
        default="rollflow", min_length=1, description="The Weights & Biases project a `wandb` tracker logs to.")

    @field_validator("trackers")
    @classmethod
    def _wandb_installed(cls, trackers: list[str]) -> list[str]:
        """Refuse `wandb` without the package at load time, before any worker starts."""
        import importlib.util

        from rollflow.errors import ConfigError

        if "wandb" in trackers and importlib.util.find_spec("wandb") is None:
            # ConfigError, not ValueError: pydantic passes it through, so the message stays this one line
            raise ConfigError('output.trackers has wandb but the wandb package is not installed: '
                              'pip install "rollflow[wandb]"')
        return trackers


class RunConfigBase(Strict):
    """What every pipeline's run config has; `pipeline` names the pipeline (and so the config model)."""

    name: str = Field(
        default="run",
        description=f"Name of the run: its directory is `output.dir/name`. A plain name: at most "
                    f"{MAX_NAME_LENGTH} characters, no `/` or `\\`, not `.` or `..`, no control characters.")
    pipeline: str = Field(
        description="The pipeline to run, which selects the schema the rest of the config is checked "
                    "against. A config without it runs `rlvr`.")
    seed: int = Field(
        default=0,
        description="Seeds data order, sampling and initialization: an integer in [0, 2**64) (torch's "
                    "generators take 64 bits); per-worker and per-step seeds are hashed from it "
                    "(`rollflow.data.seeds.derive_seed`).")
    resume: bool = Field(
        default=False,
        description="Continue from the newest complete `checkpoints/step_N` of the run directory (an error "
                    "when there is none); the metric and sample logs are cut back to that step. Otherwise the "
                    "run starts afresh, and a run directory holding an earlier run is moved aside to "
                    "`NAME.1` (`NAME.2`, ...).")
    model: ModelConfig = Field(default=ModelConfig(), description="The model to train.")
    data: DataConfig = Field(default=DataConfig(), description="The prompt datasets and how prompts are "
                                                               "read.")
    train: TrainConfig = Field(
        default=TrainConfig(), description="Length of the run, optimizer, learning-rate schedule, batch "
                                           "splitting.")
    eval: EvalConfig = Field(default=EvalConfig(), description="The periodic greedy eval on `data.eval`.")
    roles: RolesConfig = Field(
        default=RolesConfig(),
        description="The workers of each role and where they run. A pipeline starts the roles it needs; "
                    "`rollflow train CFG --print-plan` prints which worker of which role sits on which "
                    "device and node. Each worker pins its torch / OpenMP threads to its share of CPU slots: "
                    "on a 2-core machine a process with more threads than its share slows small ops ~100x.")
    cluster: ClusterConfig = Field(
        default=ClusterConfig(),
        description="The Ray cluster, what a device index names, and how weights reach the engines; see "
                    "[placement.md](placement.md).")
    checks: ChecksConfig = Field(
        default=ChecksConfig(),
        description="Checks that stop a run whose trainer and engines do not run the same model.")
    output: OutputConfig = Field(
        default=OutputConfig(), description="Where a run writes its checkpoints, metrics and samples.")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        problem = name_problem(name)
        if problem:
            raise ValueError(problem)
        return name

    @field_validator("seed", mode="before")
    @classmethod
    def _integer_seed(cls, seed: Any) -> Any:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError("must be an integer in [0, 2**64)")
        if not 0 <= seed < SEED_LIMIT:
            raise ValueError("must be in [0, 2**64): torch's random generators take a 64-bit seed")
        return seed

    @model_validator(mode="before")
    @classmethod
    def _finite_numbers(cls, tree: Any) -> Any:
        """NaN or inf anywhere in the tree, pass-through dicts (`*_kwargs`) included, is an error."""
        where = non_finite(tree, ())
        if where is not None:
            path, value = where
            raise ValueError(f"{'.'.join(path)} is {value}: every number in the config must be finite")
        return tree

    @model_validator(mode="after")
    def _hybrid_engine_fits(self) -> RunConfigBase:
        if self.roles.actor_infer.hybrid and self.cluster.device != "cpu":
            raise ValueError("roles.actor_infer.hybrid is for CPU runs (cluster.device cpu); on GPUs set "
                             "roles.actor_infer.hybrid=false and colocate separate engine workers with "
                             "device_mapping")
        if self.roles.actor_infer.hybrid and self.cluster.weight_sync_transport != "object_store":
            raise ValueError("roles.actor_infer.hybrid copies weights inside one process; "
                             "cluster.weight_sync_transport: broadcast needs separate engine workers, "
                             "set roles.actor_infer.hybrid=false")
        return self

    @model_validator(mode="after")
    def _simulated_all_through(self) -> RunConfigBase:
        check_simulated(self)
        return self

    @model_validator(mode="after")
    def _dtype_runs_on_the_device(self) -> RunConfigBase:
        if self.model.dtype == "float16" and self.cluster.device == "cpu":
            raise ValueError("model.dtype float16 with cluster.device cpu: half precision on CPU turns the "
                             "weights NaN; use float32 or bfloat16")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.output.dir) / self.name

    @property
    def actor_optimizer_steps(self) -> int:
        """The optimizer steps the actor takes in the run, which its learning-rate schedule spans."""
        return self.train.steps * self.train.optimizer_steps_per_step
