"""The configs of the pipelines that learn from fixed data: SFT, DPO and logit distillation.

They share `RunConfigBase` (model, roles, cluster, checks, output) with RLVR and replace its prompt `data`,
`train` and `eval` sections with ones for datasets of full conversations: a run is a number of optimizer
steps (or epochs) over shuffled batches of rows, with a periodic eval loss and, optionally, a greedy eval
through an inference engine scored with the same reward registry as RLVR.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rollflow.algorithms.registries import DIVERGENCES, PREFERENCE_LOSSES, check_options
from rollflow.config.rlvr import RewardConfig, RewardFunctionConfig
from rollflow.config.sections import (
    IMAGE_KEY_DOC,
    DatasetConfig,
    EvalFields,
    GroupByFields,
    RunConfigBase,
    Strict,
    TrainFields,
)


class SupervisedDataConfig(Strict):
    """Rows of full conversations: a chat `messages` column, or a prompt and a response column."""

    train: DatasetConfig | None = Field(
        default=None,
        description="The training rows (required): `{path: FILE}` (JSONL, parquet, a `datasets` directory or "
                    "hub name) or `{task: NAME}` (a built-in synthetic task: rows `{prompt, answer}`, so set "
                    "`response_key: answer`).")
    eval: DatasetConfig | None = Field(
        default=None,
        description="Held-out rows in the same form: the eval loss, and the greedy eval when "
                    "`eval.greedy_accuracy` is on; `null`: no eval.")
    validation: DatasetConfig | None = Field(
        default=None,
        description="Validation rows in the same form, kept apart from `eval` (the test set): the `val/` metrics, "
                    "which `train.best_checkpoint_metric` and `train.early_stopping_patience` choose by. Or carve "
                    "them from `train` with `validation_fraction`.")
    validation_fraction: float | None = Field(
        default=None, gt=0, le=0.5,
        description="Carve this share of the `train` rows (a seeded draw, the same for the same `seed`) into a "
                    "validation split: those rows are never trained on. `null`: no carved split.")
    messages_key: str = Field(
        default="messages",
        description="The column of a chat row: a list of `{role, content}` turns. Loss is taken on the "
                    "assistant turns only (their content and the end-of-turn tokens the chat template adds). A "
                    "row without it is read as a prompt / response row.")
    prompt_key: str = Field(default="prompt", description="The column holding the user message.")
    image_key: str = Field(default="images", description=IMAGE_KEY_DOC)
    response_key: str = Field(
        default="response",
        description="The column holding the assistant's response (what SFT trains on and distillation scores).")
    answer_key: str = Field(
        default="answer",
        description="The reference answer the greedy eval's rewards receive as `answer` (`eval.greedy_accuracy`).")
    apply_chat_template: bool = Field(
        default=True,
        description="Render rows with the tokenizer's chat template (when it has one); `false`: the prompt text, "
                    "then the response text and the EOS token.")
    max_tokens: int = Field(
        default=512, gt=0,
        description="The longest row, prompt and response, in tokens; a longer row is a data error naming it "
                    "(never truncated silently).")
    shuffle: bool = Field(
        default=True, description="Reshuffle the rows every epoch (seeded by `seed`); `false`: the file's order.")
    drop_degenerate_rows: bool = Field(
        default=False,
        description="What to do with a degenerate row of `train` or `eval`: a DPO pair whose chosen and rejected "
                    "encode to the same tokens (loss constant, gradient 0), or a row whose response (DPO: chosen "
                    "or rejected; a chat: every assistant turn) is empty or whitespace that encodes to no token "
                    "(it teaches the model to answer nothing). `false`: a data error naming the row; `true`: drop "
                    "such rows, with one warning per dataset that counts them and names the first (a dataset "
                    "left with no rows is still an error).")

    @model_validator(mode="after")
    def _has_training_rows(self) -> SupervisedDataConfig:
        if self.train is None:
            raise ValueError("data.train is required: `{path: FILE}` or `{task: NAME}`")
        if self.validation is not None and self.validation_fraction is not None:
            raise ValueError("set data.validation (a dataset of its own) or data.validation_fraction (carved from "
                             "data.train), not both")
        return self

    @property
    def has_validation(self) -> bool:
        return self.validation is not None or self.validation_fraction is not None


class PreferenceDataConfig(SupervisedDataConfig):
    """Preference rows: a prompt (a string or chat turns) and a chosen and a rejected response."""

    chosen_key: str = Field(default="chosen", description="The column holding the preferred response.")
    rejected_key: str = Field(default="rejected", description="The column holding the dispreferred response.")


class SupervisedTrainConfig(TrainFields):
    """A supervised pipeline's `train` section (SFT, DPO, distillation)."""

    steps: int = Field(
        default=100, gt=0,
        description="Optimizer steps of the run; each trains on `batch_size` rows. Set this or `epochs`.")
    lr: float = Field(default=1e-4, gt=0, description="AdamW learning rate (after warm-up).")
    epochs: int | None = Field(
        default=None, gt=0,
        description="Passes over the training rows instead of `steps`: steps = epochs × (rows ÷ `batch_size`), "
                    "a last partial batch of each epoch dropped; `null`: use `steps`.")
    batch_size: int = Field(
        default=64, gt=0,
        description="Rows per optimizer step (over all data-parallel ranks; a DPO row is one pair).")
    stop_at_accuracy: float | None = Field(
        default=None, gt=0, le=1,
        description="End the run at the first greedy eval whose accuracy reaches this (and save it there): the "
                    "validation accuracy when there is a validation split, else the `eval` accuracy; `null`: run "
                    "all steps.")
    best_checkpoint_metric: Literal["val/loss", "val/accuracy"] | None = Field(
        default=None,
        description="Keep the checkpoint of the best validation eval in `checkpoints/best/` (`val/loss`: the "
                    "lowest; `val/accuracy`: the highest, needs `eval.greedy_accuracy`); at the end the run "
                    "evaluates it on `data.eval` and says which step it is. Needs a validation split; never "
                    "chosen on the test set. `null`: the last checkpoint is the result.")
    early_stopping_patience: int | None = Field(
        default=None, gt=0,
        description="End the run after this many validation evals in a row without a new best "
                    "`best_checkpoint_metric`; `null`: run all steps.")

    @property
    def optimizer_steps_per_step(self) -> int:
        """One optimizer step per step (what the trainer's LR schedule counts)."""
        return 1

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> SupervisedTrainConfig:
        if self.epochs is not None and "steps" in self.model_fields_set:
            raise ValueError("set train.steps or train.epochs, not both")
        return self


class SupervisedEvalConfig(GroupByFields, EvalFields):
    """A supervised pipeline's `eval` section: the loss on `data.eval`, and with `greedy_accuracy` the greedy
    eval (which `group_by` breaks down)."""

    every_steps: int = Field(
        default=50, ge=0,
        description="Eval on `data.eval` every N steps, and before the first and after the last step; 0: only "
                    "those two.")
    greedy_accuracy: bool = Field(
        default=False,
        description="Also decode the eval rows' prompts greedily on an `actor_infer` engine and score them with "
                    "`reward` (`eval/accuracy`); starts the engine role.")
    max_new_tokens: int = Field(default=32, gt=0, description="Response length limit of the greedy eval.")


class SupervisedRunConfig(RunConfigBase):
    """Fields every supervised pipeline has (not a pipeline itself)."""

    data: SupervisedDataConfig = Field(
        default_factory=lambda: SupervisedDataConfig.model_construct(), validate_default=True,
        description="The datasets and how rows are read.")
    train: SupervisedTrainConfig = Field(
        default=SupervisedTrainConfig(), description="Length of the run, batch, optimizer, LR schedule.")
    eval: SupervisedEvalConfig = Field(default=SupervisedEvalConfig(), description="The periodic eval.")
    reward: RewardConfig = Field(
        default=RewardConfig(functions=[RewardFunctionConfig(name="math_answer")]),
        description="How the greedy eval (`eval.greedy_accuracy`) scores a completion: the RLVR reward "
                    "registry. Unused otherwise.")

    @model_validator(mode="after")
    def _batch_splits(self) -> SupervisedRunConfig:
        rows, ranks = self.sequences_per_step, self.roles.actor_train.num_workers
        if rows % ranks:
            raise ValueError(f"each step trains on {rows} sequences, which the {ranks} data-parallel ranks "
                             "(roles.actor_train.num_workers) cannot split evenly; change train.batch_size")
        train = self.train
        if train.stop_at_accuracy is not None and not self.eval.greedy_accuracy:
            raise ValueError("train.stop_at_accuracy needs eval.greedy_accuracy: true (the accuracy it stops at)")
        if self.eval.greedy_accuracy and self.data.eval is None and not self.data.has_validation:
            raise ValueError("eval.greedy_accuracy needs data.eval or a validation split (the rows to decode)")
        if train.best_checkpoint_metric is not None and not self.data.has_validation:
            raise ValueError(f"train.best_checkpoint_metric: {train.best_checkpoint_metric} needs a validation "
                             "split: set data.validation_fraction (e.g. 0.1) or data.validation; a checkpoint "
                             "chosen on data.eval would be chosen on the test set")
        if train.best_checkpoint_metric == "val/accuracy" and not self.eval.greedy_accuracy:
            raise ValueError("train.best_checkpoint_metric: val/accuracy needs eval.greedy_accuracy: true")
        if train.early_stopping_patience is not None and train.best_checkpoint_metric is None:
            raise ValueError("train.early_stopping_patience counts evals without a new best "
                             "train.best_checkpoint_metric: set that too (val/loss or val/accuracy)")
        if self.eval.group_by and not self.eval.greedy_accuracy:
            raise ValueError("eval.group_by breaks down the greedy accuracy: it needs eval.greedy_accuracy: true")
        if train.best_checkpoint_metric is not None and not self.eval.every_steps:
            raise ValueError("train.best_checkpoint_metric chooses among periodic evals: set eval.every_steps > 0")
        return self

    @property
    def sequences_per_step(self) -> int:
        return self.train.batch_size


class SFTConfig(SupervisedRunConfig):
    """A run of the SFT pipeline (`pipeline: sft`): the negative log-likelihood of the responses."""

    pipeline: Literal["sft"] = Field(default="sft", description="Selects this pipeline.")


class DPOSettings(Strict):
    loss: str = Field(
        default="dpo",
        description="The preference loss, by registry name: `dpo` (sigmoid; with `label_smoothing` > 0 it is "
                    "cDPO), `cdpo` or `ipo`; see [algorithms.md](algorithms.md#preference-and-distillation-losses).")
    beta: float = Field(default=0.1, gt=0, description="β: the strength of the implicit KL to the reference.")
    label_smoothing: float = Field(
        default=0.0, ge=0, lt=0.5,
        description="cDPO: the assumed rate of flipped preference labels (`dpo` / `cdpo` only).")

    @model_validator(mode="after")
    def _known_loss(self) -> DPOSettings:
        if self.loss not in PREFERENCE_LOSSES:
            raise ValueError(PREFERENCE_LOSSES.unknown_message(self.loss))
        if self.loss == "ipo" and self.label_smoothing:
            raise ValueError("label_smoothing is a cDPO option; ipo has none (set it to 0)")
        if self.loss == "cdpo" and not self.label_smoothing:
            raise ValueError("cdpo needs label_smoothing in (0, 0.5)")
        return self

    def loss_kwargs(self) -> dict[str, float]:
        """The keyword arguments of the registered loss: `beta`, and `label_smoothing` where it has one."""
        kwargs = {"beta": self.beta}
        if self.loss != "ipo":
            kwargs["label_smoothing"] = self.label_smoothing
        check_options(PREFERENCE_LOSSES, self.loss, kwargs)
        return kwargs


class DPOConfig(SupervisedRunConfig):
    """A run of the DPO pipeline (`pipeline: dpo`): preference pairs against a frozen reference."""

    pipeline: Literal["dpo"] = Field(default="dpo", description="Selects this pipeline.")
    data: PreferenceDataConfig = Field(
        default_factory=lambda: PreferenceDataConfig.model_construct(), validate_default=True,
        description="The preference datasets and their columns.")
    dpo: DPOSettings = Field(default=DPOSettings(), description="The preference loss and its options.")

    @property
    def sequences_per_step(self) -> int:
        return 2 * self.train.batch_size  # a pair is two sequences


class DistillSettings(Strict):
    divergence: str = Field(
        default="forward_kl",
        description="The KD term, by registry name: `forward_kl`, `reverse_kl`, `js`, `skewed_forward_kl`, "
                    "`skewed_reverse_kl` or `adaptive_kl`.")
    divergence_kwargs: dict[str, float] = Field(
        default={}, description="Its options, e.g. `{alpha: 0.1}` for the skewed KLs, `{beta: 0.5}` for `js`.")
    kd_weight: float = Field(
        default=0.5, ge=0, le=1, description="w in the loss (1 − w)·CE + w·KD, per token.")
    top_k: int = Field(
        default=64, gt=0,
        description="Teacher log-probs kept per token (the teacher's k most likely tokens); both distributions "
                    "are renormalized over them.")
    temperature: float = Field(
        default=1.0, gt=0, description="Teacher and student logits are divided by it in the KD term.")
    on_prompts: bool = Field(
        default=False,
        description="Distill on the prompt tokens too (KD only; CE stays on the response); `false`: responses "
                    "only.")

    @model_validator(mode="after")
    def _known_divergence(self) -> DistillSettings:
        if self.divergence not in DIVERGENCES:
            raise ValueError(DIVERGENCES.unknown_message(self.divergence))
        check_options(DIVERGENCES, self.divergence, self.divergence_kwargs)
        return self


class DistillConfig(SupervisedRunConfig):
    """A run of the distillation pipeline (`pipeline: distill`): the student (`model`) learns the teacher's
    (`roles.reference.model_path`) token distributions on the dataset's rows."""

    pipeline: Literal["distill"] = Field(default="distill", description="Selects this pipeline.")
    distill: DistillSettings = Field(default=DistillSettings(), description="The distillation loss.")

    @model_validator(mode="after")
    def _has_a_teacher(self) -> DistillConfig:
        if self.roles.reference.model_path is None:
            raise ValueError("distillation needs a teacher: set roles.reference.model_path")
        if self.roles.actor_train.lora is not None:
            raise ValueError("distillation trains the student's own weights: roles.actor_train.lora must be null")
        return self
