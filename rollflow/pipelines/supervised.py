"""Supervised pipelines: SFT, DPO and logit distillation. batch of rows -> (reference / teacher) -> train ->
eval, one optimizer step per step, on the same workers, placement and run directory as RLVR.

The three differ only in the trainer's objective (`rollflow.workers.objectives`: `nll`, `preference`,
`distill`) and in what a batch carries to it: DPO rows alternate chosen and rejected with the reference's
log-probs; distillation rows carry the teacher's top-k log-probs, computed on the `reference` worker (the
teacher, `roles.reference.model_path`) and sent with the batch to the student's ranks. Each is a step class
(`SFTStep`, `DPOStep`, `DistillStep`, on `SupervisedStep`) that the driver frame (`rollflow.pipelines.loop`)
runs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

from rollflow.algorithms.preference import PairLogratios
from rollflow.algorithms.supervised import MeanTokenNLL
from rollflow.backends.base import unpack_top_k
from rollflow.cluster.colocation import ColocationManager
from rollflow.cluster.groups import WorkerGroups
from rollflow.data.sample import Batch, Sample, collate
from rollflow.data.supervised import shuffled_batches
from rollflow.engines.base import SamplingParams
from rollflow.inputs.conversations import Item, load_supervised_inputs
from rollflow.pipelines import PIPELINES
from rollflow.pipelines.loop import Progress, StepDefaults, run_pipeline
from rollflow.pipelines.phases import (
    check_group_by,
    eval_summary_lines,
    evaluate,
    prompt_rollout,
    reference_logprobs,
    sync_weights,
)
from rollflow.spans import span
from rollflow.trackers.durable_files import write_failure_as_error
from rollflow.trackers.trackers import DPO_COLUMNS, SUPERVISED_COLUMNS
from rollflow.workers.roles import forward_rows

PHASES: dict[str, tuple[str, ...]] = {
    "reference": ("reference",),  # DPO's reference log-probs, distillation's teacher
    "train": ("actor_train",),
    "weight_sync": ("actor_train", "actor_infer"),
    "rollout": ("actor_infer",),  # the greedy eval
    "checkpoint": ("actor_train",),
}
EVAL_BATCH_ROWS = 256  # rows per eval forward call


def run_supervised(config, manage_ray: bool = True) -> dict[str, float]:
    """Run an SFT, DPO or distillation config. Returns the final metrics (with `initial_eval/...`).

    Args:
        config: an `SFTConfig`, `DPOConfig` or `DistillConfig`.
        manage_ray: start Ray and shut it down at the end; False runs in the caller's session.
    """
    return run_pipeline(PIPELINES.get(config.pipeline).step_class()(config), manage_ray)


class SupervisedStep(StepDefaults):
    """A supervised step (`rollflow.pipelines.loop.PipelineStep`): the next batch of rows (with what the
    objective needs besides), one optimizer step; evals of the loss (and with `eval.greedy_accuracy` the greedy
    decode) on the eval rows and the validation split, which keep the best checkpoint
    (`train.best_checkpoint_metric`) and can end the run (`train.early_stopping_patience`,
    `train.stop_at_accuracy`). SFT as it is; `DPOStep` and `DistillStep` say what differs.

    Attributes:
        objective: the trainer's objective (`rollflow.workers.objectives.OBJECTIVES`).
    """

    objective = "nll"
    phases = PHASES
    columns = SUPERVISED_COLUMNS
    plot_keys = ("loss", "eval/loss", "eval/accuracy", "eval/dpo/reward_accuracy")

    def __init__(self, config):
        self.config = config
        self.patience_ran_out = ""  # the last eval's `BestCheckpoint.update`

    def roles(self) -> list[str]:
        """actor_train; the reference or teacher when the step needs one; actor_infer for the greedy eval."""
        roles = ["actor_train"]
        if self.needs_reference():
            roles.append("reference")
        if self.config.eval.greedy_accuracy:
            roles.append("actor_infer")
        return roles

    def needs_reference(self) -> bool:
        return False

    def launches_before_inputs(self) -> bool:
        """The workers start while the inputs are checked, unless their config waits on the data
        (`train.epochs` becomes a step count, which the trainer's schedule reads)."""
        return self.config.train.epochs is None

    def check_inputs(self, roles: list[str]) -> list[str]:
        """Every row encoded and checked (`load_supervised_inputs`); `train.epochs` resolved to steps."""
        self.inputs = load_supervised_inputs(self.config, roles)
        check_group_by(self.inputs.eval_prompts, self.config.eval.group_by)
        self.config = with_resolved_steps(self.config, len(self.inputs.train))
        warning = repetition_warning(self.config, len(self.inputs.train))
        return self.inputs.warnings + ([warning] if warning else [])

    def start_lines(self) -> list[str]:
        return [describe_data(self.config, self.inputs)]

    def start(self, groups: WorkerGroups, colocation: ColocationManager) -> None:
        config = self.config
        self.groups, self.colocation, self.pad = groups, colocation, self.inputs.tokenizer.pad_token_id
        self.core = prompt_rollout(config, groups, self.inputs.tokenizer) if "actor_infer" in groups else None
        self.batches = shuffled_batches(self.inputs.train, config.train.batch_size, config.seed, config.data.shuffle)
        self.best = BestCheckpoint(config)

    def load(self, checkpoint: Path, state: dict) -> str:
        self.best.restore(state.get("best"))
        self.groups["actor_train"].call("load", str(checkpoint / "model"), state["step"])
        for _ in range(state["step"]):  # the data position: one batch per step
            next(self.batches)
        return ""

    def evaluate(self, step: int) -> dict[str, float]:
        """The eval and validation metrics (`evaluate_splits`); a new best is kept (`BestCheckpoint`)."""
        metrics = self.evaluate_splits(step)
        self.patience_ran_out = self.best.update(step, metrics, self.groups)  # first: the best is kept either way
        return metrics

    def stop_reason(self, metrics: dict[str, float]) -> str:
        return reached_target(self.config, metrics) or self.patience_ran_out

    def state(self, step: int, initial_eval: dict) -> dict:
        return {"step": step, "initial_eval": initial_eval, "best": self.best.state()}

    def rollout(self, step: int) -> tuple[Batch, dict[str, float]]:
        """The step's batch of rows (no rollout: the rows are the data)."""
        with span("batch"):
            return self.training_batch(next(self.batches)), {}

    def train(self, step: int, work: Batch) -> dict[str, float]:
        self.colocation.enter("train")
        with span("train"):
            return self.groups["actor_train"].call("train", work)

    def position(self, step: int) -> dict[str, float]:
        """`epoch`: full batches so far over full batches per epoch, as `train.epochs` counts them."""
        return {"epoch": step / batches_per_epoch(len(self.inputs.train), self.config.train.batch_size)}

    def after_run(self, progress: Progress) -> dict[str, float]:
        """The best checkpoint's eval (`BestCheckpoint.evaluate`), when one was kept."""
        if self.best.step is None:
            return {}
        return self.best.evaluate(self.groups, self.colocation, self.evaluate_splits, progress.finished_step,
                                  progress.metrics)

    def summary_lines(self, final: dict[str, float], progress: Progress) -> list[str]:
        model = self.config.run_dir / "checkpoints" / f"step_{progress.saved_step}" / "model"
        lines = [describe_eval(f"after {progress.finished_step} steps", progress.metrics) + f"; checkpoint {model}"]
        lines += eval_summary_lines(final, progress.finished_step)
        return lines + ([self.best.describe(final)] if self.best.step is not None else [])

    def close(self) -> None:
        if getattr(self, "core", None) is not None:
            self.core.close()

    def training_batch(self, items: list[Item]) -> Batch:
        """The batch the trainer's objective reads: SFT's samples as they are."""
        return collate(items, self.pad)

    def eval_losses(self, items: list[Item]) -> dict[str, float]:
        """`eval/` loss metrics of `items` (not empty): the NLL of the responses per token."""
        self.colocation.enter("train")
        nll = MeanTokenNLL()
        for start in range(0, len(items), EVAL_BATCH_ROWS):
            batch = collate(items[start: start + EVAL_BATCH_ROWS], self.pad)
            nll.add(self.groups["actor_train"].call("compute_logprobs", batch), batch.response_mask)  # [b, T]
        return {"eval/loss": nll.value}

    def evaluate_splits(self, step: int, validation: bool = True, keep_samples: bool = True) -> dict[str, float]:
        """`eval/` metrics on the eval rows (the test set) and, with `validation`, `val/` metrics on the validation
        split: the loss (`eval_losses`), and with `eval.greedy_accuracy` the greedy decode scored by `reward`. The
        engines get the trainer's weights once, after both losses; the eval's accuracy is broken down by
        `eval.group_by`, and its decoded samples go to `eval_samples.jsonl` (with `keep_samples`)."""
        config, inputs = self.config, self.inputs
        splits = {"eval": (inputs.eval, inputs.eval_prompts)}
        if validation:
            splits["val"] = (inputs.validation, inputs.validation_prompts)
        found = {name: self.eval_losses(items) if items else {} for name, (items, _) in splits.items()}
        metrics: dict[str, float] = {}
        if self.core is not None and any(prompts for _, prompts in splits.values()):
            bucket = int(config.cluster.weight_sync_bucket_mb * 2**20)
            metrics.update(sync_weights(self.groups, self.colocation, bucket, config.checks.weight_checksum))
            greedy = SamplingParams(config.eval.max_new_tokens, temperature=0.0)
            for name, (_, prompts) in splits.items():
                if prompts:
                    samples_path = config.run_dir / "eval_samples.jsonl" if keep_samples else None
                    extra = (config.eval.group_by, samples_path) if name == "eval" else ()
                    found[name].update(evaluate(self.core, self.colocation, prompts, greedy, step, *extra))
        metrics.update(found["eval"])
        metrics.update({"val/" + key.removeprefix("eval/"): value for key, value in found.get("val", {}).items()})
        return metrics


class SFTStep(SupervisedStep):
    """SFT: the NLL of the rows' responses."""


class DPOStep(SupervisedStep):
    """DPO: each row a (chosen, rejected) pair, trained against the reference's log-probs (the base model inside
    actor_train with LoRA). Its `loss` is a surrogate with the right gradient (`objectives.PreferenceLoss`):
    the console and the curves show the real one, `dpo/loss`."""

    objective = "preference"
    columns = DPO_COLUMNS
    plot_keys = ("dpo/loss", "eval/loss", "eval/accuracy", "eval/dpo/reward_accuracy")

    def needs_reference(self) -> bool:
        return self.config.roles.actor_train.lora is None

    def training_batch(self, items: list[Item]) -> Batch:
        """The pairs as alternating chosen, rejected rows with `ref_logprobs`."""
        batch = collate([sample for pair in items for sample in pair], self.pad)
        batch.extras["ref_logprobs"] = reference_logprobs(batch, self.groups, self.colocation,
                                                          self.config.roles.reference.backend, "train")
        return batch

    def eval_losses(self, items: list[Item]) -> dict[str, float]:
        """The preference metrics of the pairs against the reference, as `eval/dpo/...`."""
        pairs = PairLogratios()
        for start in range(0, len(items), EVAL_BATCH_ROWS // 2):
            batch = collate([s for pair in items[start: start + EVAL_BATCH_ROWS // 2] for s in pair], self.pad)
            reference = reference_logprobs(batch, self.groups, self.colocation, self.config.roles.reference.backend,
                                           "train")
            self.colocation.enter("train")
            pairs.add(self.groups["actor_train"].call("compute_logprobs", batch), reference, batch.response_mask)
        return {f"eval/{key}": value for key, value in pairs.metrics(self.config.dpo.beta).items()}


class DistillStep(SupervisedStep):
    """Logit distillation: the student's rows with the teacher's (the `reference` worker's) top-k log-probs;
    with `distill.on_prompts` the prompts are distilled too."""

    objective = "distill"

    def needs_reference(self) -> bool:
        return True

    def training_batch(self, items: list[Item]) -> Batch:
        """The samples with the teacher's top-k log-probs (`teacher_ids`, `teacher_logprobs`)."""
        settings = self.config.distill
        samples = [prompt_distillation_sample(s) for s in items] if settings.on_prompts else items
        batch = collate(samples, self.pad)  # with `ce_mask` on prompts
        self.colocation.enter("reference")
        packed = forward_rows(self.groups["reference"], self.config.roles.reference.backend, "compute_top_k", batch,
                              settings.top_k, settings.temperature)  # [B, T, 2k]
        batch.extras["teacher_ids"], batch.extras["teacher_logprobs"] = unpack_top_k(packed)
        return batch


def with_resolved_steps(config, num_rows: int):
    """`train.epochs` as steps (epochs × full batches per epoch), written into the config the run directory
    keeps (`epochs` then null), so the run reads one length everywhere."""
    train = config.train
    if train.epochs is None:
        return config
    steps = train.epochs * batches_per_epoch(num_rows, train.batch_size)
    return config.model_copy(update={"train": train.model_copy(update={"steps": steps, "epochs": None})})


def batches_per_epoch(num_rows: int, batch_size: int) -> int:
    """Full batches in one pass over `num_rows` rows (`shuffled_batches` drops a last partial one): the steps of
    an epoch, for `train.epochs` and the `epoch` metric alike."""
    return max(num_rows // batch_size, 1)


def prompt_distillation_sample(sample: Sample) -> Sample:
    """The sample with its prompt moved into the response (all but the first token, which nothing predicts),
    so the KD term covers the prompt too; `ce_mask` keeps the tokens CE trains on (the old response's trained
    tokens)."""
    moved = sample.prompt_ids[1:]
    return dataclasses.replace(
        sample, prompt_ids=sample.prompt_ids[:1], response_ids=moved + sample.response_ids,
        loss_mask=[1] * (len(moved) + len(sample.response_ids)), response_logprobs=[], policy_versions=[],
        ce_mask=[0] * len(moved) + list(sample.loss_mask))


def reached_target(config, metrics: dict[str, float]) -> str:
    """Why `train.stop_at_accuracy` ends the run here (the validation accuracy when there is a validation
    split, else the eval accuracy), or "" to go on."""
    target = config.train.stop_at_accuracy
    key = "val/accuracy" if config.data.has_validation else "eval/accuracy"
    if target is None or metrics.get(key, -math.inf) < target:
        return ""
    return f"{key} {metrics[key]:.4g} reached train.stop_at_accuracy {target:g}"


EXPOSURE_WARNING_EPOCHS = 20  # passes over the rows past which a small model is known to memorise them


def repetition_warning(config, num_rows: int) -> str | None:
    """A warning when the run trains on each row more than `EXPOSURE_WARNING_EPOCHS` times: a small dataset
    under a recipe written for a large one (docs/sft.md's 600 steps of 128 rows are 6.5 passes over its word
    problems, and 135 over 570 rows, which SFT then memorises: held-out loss rising, RL left all-correct
    groups). None too when the run ends itself on an eval (`stop_at_accuracy`, `early_stopping_patience`): its
    step count is then a bound, not a plan; and when a validation split chooses the checkpoint
    (`best_checkpoint_metric`): what memorising costs, it does not keep."""
    train = config.train
    passes = train.steps * train.batch_size / num_rows
    if passes <= EXPOSURE_WARNING_EPOCHS or train.stop_at_accuracy is not None or train.early_stopping_patience \
            or train.best_checkpoint_metric is not None:
        return None
    hint = ("; keep the best checkpoint on the validation split (train.best_checkpoint_metric), "
            if config.data.has_validation else
            "; carve a validation split (data.validation_fraction: 0.1) and keep the best checkpoint on it "
            "(train.best_checkpoint_metric), ")
    return (f"train.steps={config.train.steps} x train.batch_size={config.train.batch_size} trains on each of "
            f"the {num_rows} training rows {passes:.0f} times (more than {EXPOSURE_WARNING_EPOCHS}): a model "
            f"memorises so few rows{hint or '; '}see docs/sft.md#a-few-hundred-rows")


def describe_data(config, inputs) -> str:
    """The run's data line: rows, batch, steps, epochs, and the validation split."""
    rows, train = len(inputs.train), config.train
    epochs = train.steps / batches_per_epoch(rows, train.batch_size)
    line = (f"{rows} training rows, {train.batch_size} a step, {train.steps} steps ({epochs:.3g} epochs; "
            f"each row about {train.steps * train.batch_size / rows:.3g} times)")
    if inputs.validation:
        where = ("carved from data.train" if config.data.validation_fraction is not None else "data.validation")
        line += f"; {len(inputs.validation)} validation rows ({where})"
    return line


def describe_eval(what: str, metrics: dict[str, float]) -> str:
    """`what: train loss L, val loss V, val accuracy A, eval loss E, eval accuracy B` for what `metrics` has
    (`eval` is data.eval, the test set; `val` the validation split)."""
    names = {"loss": "train loss", "dpo/loss": "train dpo loss"}
    for split in ("val", "eval"):
        names.update({f"{split}/loss": f"{split} loss", f"{split}/dpo/reward_accuracy": f"{split} reward accuracy",
                      f"{split}/accuracy": f"{split} accuracy"})
    shown = [f"{label} {metrics[key]:.4g}" for key, label in names.items() if key in metrics]
    return f"{what}: {', '.join(shown)}" if shown else f"{what}: no eval data"


class BestCheckpoint:
    """`train.best_checkpoint_metric` and `train.early_stopping_patience`: the best validation eval so far, its
    checkpoint in `checkpoints/best/` (the model in `best/model`, its step in `best/best.json`), and how many
    evals have passed without progress.

    The rule (docs/sft.md#early-stopping): a new best is a better value of the metric, or, for `val/accuracy`,
    the same accuracy at a lower `val/loss` (a tie goes to the later, better-fitted model, not to step 0).
    Patience counts evals in a row in which no validation metric set a record: not the chosen metric, not the
    lowest `val/loss`, not the highest `val/accuracy`. So a run whose accuracy sits at 0 while its loss still
    falls, as it does on a task the model has yet to start solving, is not stopped before its accuracy could
    move.
    """

    # the validation metrics whose records reset the patience, each with the sign of "better": lower loss, higher
    # accuracy
    RECORDS = {"val/loss": -1.0, "val/accuracy": 1.0}

    def __init__(self, config):
        self.metric = config.train.best_checkpoint_metric
        self.patience = config.train.early_stopping_patience
        self.path = config.run_dir / "checkpoints" / "best"
        self.step: int | None = None
        self.value = math.nan
        self.loss = math.nan  # val/loss at the best step: the tie-break of val/accuracy
        self.since = 0
        self.records: dict[str, list] = {}  # metric -> [its best value so far, the step of it]

    def state(self) -> dict | None:
        """What a checkpoint's driver state keeps of it, so a resumed run goes on choosing."""
        return None if self.step is None else {"step": self.step, "value": self.value, "since": self.since,
                                               "loss": self.loss, "records": self.records}

    def restore(self, state: dict | None) -> None:
        if state:
            self.step, self.value, self.since = state["step"], state["value"], state["since"]
            self.loss, self.records = state.get("loss", math.nan), state.get("records", {})

    def update(self, step: int, metrics: dict[str, float], groups: WorkerGroups) -> str:
        """Keep the trainer's weights when `metrics` holds a new best (saved over the old best). Returns why the
        run should stop (`early_stopping_patience` evals without a record), or ""."""
        if self.metric is None or self.metric not in metrics:
            return ""
        value, loss = metrics[self.metric], metrics.get("val/loss", math.nan)
        recorded = self._new_records(step, metrics)
        if self.step is None or self._better(value, loss):
            self._save(step, value, loss, groups)
            return ""
        self.since = 0 if recorded else self.since + 1
        if self.patience is not None and self.since >= self.patience:
            records = ", ".join(f"{name} {best:.4g} (step {at})" for name, (best, at) in self.records.items())
            return (f"no validation metric improved for {self.since} evals (train.early_stopping_patience; "
                    f"best so far: {records})")
        return ""

    def _better(self, value: float, loss: float) -> bool:
        if self.metric == "val/loss":
            return value < self.value
        return value > self.value or (value == self.value and loss < self.loss)  # nan compares False: no tie-break

    def _new_records(self, step: int, metrics: dict[str, float]) -> bool:
        """Note the validation metrics' records. Returns whether `metrics` set one."""
        recorded = False
        for name, sign in self.RECORDS.items():
            value = metrics.get(name)
            if value is None or not math.isfinite(value):
                continue
            if name not in self.records or sign * (value - self.records[name][0]) > 0:
                self.records[name] = [value, step]
                recorded = True
        return recorded

    def _save(self, step: int, value: float, loss: float, groups: WorkerGroups) -> None:
        partial = self.path.with_name("best.partial")
        shutil.rmtree(partial, ignore_errors=True)
        with span("checkpoint"), write_failure_as_error(partial):
            partial.mkdir(parents=True)
            groups["actor_train"].call("save", str(partial / "model"))
            (partial / "best.json").write_text(json.dumps({"step": step, "metric": self.metric, "value": value}))
            shutil.rmtree(self.path, ignore_errors=True)
            partial.rename(self.path)
        self.step, self.value, self.loss, self.since = step, value, loss, 0

    def evaluate(self, groups: WorkerGroups, colocation: ColocationManager,
                 evaluate_splits: Callable[..., dict[str, float]], last_step: int,
                 last_metrics: dict[str, float]) -> dict[str, float]:
        """The best checkpoint's `eval/` metrics (the test set), as `best/eval/...` with `best/step`: unless it is
        the last step's (`last_metrics`), its weights are loaded into the trainer for it (the run has ended, so
        nothing trains on them) and `evaluate_splits` (`SupervisedStep.evaluate_splits`) runs on them."""
        found = last_metrics
        if self.step != last_step:
            colocation.enter("train")
            groups["actor_train"].call("load", str(self.path / "model"), last_step + 1)
            found = evaluate_splits(last_step + 1, validation=False, keep_samples=False)
        return {"best/step": self.step, f"best/{self.metric}": self.value,
                **{f"best/{key}": value for key, value in found.items() if key.startswith("eval/")}}

    def describe(self, final: dict[str, float]) -> str:
        shown = describe_eval("", {key.removeprefix("best/"): value for key, value in final.items()
                                   if key.startswith("best/eval/")}).removeprefix(": ")
        return (f"best checkpoint: step {self.step} ({self.metric} {self.value:.4g}): {shown}; "
                f"{self.path / 'model'}")
