"""Supervised pipelines: SFT, DPO and logit distillation. batch of rows -> (reference / teacher) -> train ->
eval, one optimizer step per step, on the same workers, placement and run directory as RLVR.

The three differ only in the trainer's objective (`rollflow.workers.objectives`: `nll`, `preference`,
`distill`) and in what a batch carries to it: DPO rows alternate chosen and rejected with the reference's
log-probs; distillation rows carry the teacher's top-k log-probs, computed on the `reference` worker (the
teacher, `roles.reference.model_path`) and sent with the batch to the student's ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import shutil
import sys
import time

import torch

from rollflow.algorithms.preference import preference_metrics, sequence_logprob_sums
from rollflow.backends.base import unpack_top_k
from rollflow.cluster.colocation import ColocationManager
from rollflow.cluster.groups import WorkerGroups
from rollflow.cluster.runtime import pinned_threads
from rollflow.data.sample import Batch, Sample, collate
from rollflow.data.supervised import shuffled_batches
from rollflow.engines.base import SamplingParams
from rollflow.pipelines.interrupts import StopSignals
from rollflow.pipelines.phases import (
    check_group_by,
    eval_summary_lines,
    evaluate,
    reference_logprobs,
    rollout_scheduler,
    sync_weights,
)
from rollflow.pipelines.run_directory import (
    prepare_run_dir,
    read_driver_state,
    resume_point,
    save_checkpoint,
    write_placement,
)
from rollflow.pipelines.supervised_inputs import Item, check_supervised_inputs
from rollflow.spans import record, span
from rollflow.trackers import MetricsTracker
from rollflow.trackers.durable_files import disk_full_as_error
from rollflow.trackers.plots import plot_curves
from rollflow.trackers.timeline import STEP_SPAN, timeline_written
from rollflow.trackers.trackers import CONSOLE_COLUMNS
from rollflow.workers.objectives import pair_logratios
from rollflow.workers.roles import RoleLaunch, forward_rows

PHASES: dict[str, tuple[str, ...]] = {
    "reference": ("reference",),  # DPO's reference log-probs, distillation's teacher
    "train": ("actor_train",),
    "weight_sync": ("actor_train", "actor_infer"),
    "rollout": ("actor_infer",),  # the greedy eval
    "checkpoint": ("actor_train",),
}
OBJECTIVES = {"sft": "nll", "dpo": "preference", "distill": "distill"}
EVAL_BATCH_ROWS = 256  # rows per eval forward call


def supervised_roles(config) -> list[str]:
    """actor_train; the reference (DPO without LoRA) or the teacher (distillation); actor_infer for the greedy
    eval."""
    roles = ["actor_train"]
    if config.pipeline == "distill" or config.pipeline == "dpo" and config.roles.actor_train.lora is None:
        roles.append("reference")
    if config.eval.greedy_accuracy:
        roles.append("actor_infer")
    return roles


@pinned_threads(1)
def run_supervised(config, manage_ray: bool = True) -> dict[str, float]:
    """Run an SFT, DPO or distillation config. Returns the final metrics (with `initial_eval/...`).

    Args:
        config: an `SFTConfig`, `DPOConfig` or `DistillConfig`.
        manage_ray: start Ray and shut it down at the end; False runs in the caller's session.
    """
    roles, began = supervised_roles(config), time.time()
    resume_point(config)  # a resume with nothing to resume fails before anything starts
    role_args = {"actor_train": (OBJECTIVES[config.pipeline],)}
    # The workers start while the inputs are checked, unless their config waits on the data (`train.epochs`
    # becomes a step count, which the trainer's schedule reads).
    launch = RoleLaunch(config, roles, role_args, manage_ray) if config.train.epochs is None else None
    with launch.cancelled_on_error() if launch else contextlib.nullcontext():
        with span("check inputs"):
            inputs = check_supervised_inputs(config, roles)
            check_group_by(inputs.eval_prompts, config.eval.group_by)
        for warning in inputs.warnings:
            print(f"rollflow: warning: {warning}", file=sys.stderr)
        config = with_resolved_steps(config, len(inputs.train))
        warning = repetition_warning(config, len(inputs.train))
        if warning:
            print(f"rollflow: warning: {warning}", file=sys.stderr)
        prepared = prepare_run_dir(config)
    pad = inputs.tokenizer.pad_token_id
    launch = launch or RoleLaunch(config, roles, role_args, manage_ray)
    with timeline_written(config.run_dir, began) as worker_spans, StopSignals() as stop, \
            launch.running(worker_spans.take_from) as groups:
        tracker = MetricsTracker(config.run_dir, config.output.trackers, config.train.steps, prepared.resumed_at,
                                 columns=CONSOLE_COLUMNS[config.pipeline])
        if prepared.note:
            tracker.print(prepared.note)
        tracker.print(groups.plan.describe())
        tracker.print(describe_data(config, inputs))
        write_placement(config.run_dir / "placement.json", groups)
        colocation = ColocationManager(groups.plan, dict(groups), PHASES)
        scheduler = rollout_scheduler(config, groups, inputs.tokenizer) if "actor_infer" in groups else None
        batches = shuffled_batches(inputs.train, config.train.batch_size, config.seed, config.data.shuffle)
        first_step, initial_eval = 0, {}
        best = BestCheckpoint(config)
        if prepared.resume_from:
            state = read_driver_state(prepared.resume_from)
            first_step, initial_eval = state["step"], state.get("initial_eval", {})
            best.restore(state.get("best"))
            groups["actor_train"].call("load", str(prepared.resume_from / "model"), first_step)
            for _ in range(first_step):  # the data position: one batch per step
                next(batches)
            tracker.print(f"resumed from {prepared.resume_from} at step {first_step}")
        else:
            initial_eval = evaluate_supervised(config, groups, colocation, scheduler, inputs, pad, 0)
            tracker.log(0, initial_eval)  # the console's step-0 line shows it
            best.update(0, initial_eval, groups)

        metrics: dict[str, float] = {}
        finished = {"step": first_step, "initial_eval": initial_eval, "best": best.state()}
        saved_step, stopped = first_step, ""
        try:
            for step in range(first_step + 1, config.train.steps + 1):
                started, step_began = time.perf_counter(), time.time()
                with span("batch"):
                    batch = training_batch(next(batches), config, groups, colocation, pad)
                with stop.critical():
                    colocation.enter("train")
                    with span("train"):
                        metrics = groups["actor_train"].call("train", batch)
                    metrics.update(colocation.pop_metrics())
                    last = step == config.train.steps
                    metrics["epoch"] = step * config.train.batch_size / len(inputs.train)
                    if last or config.eval.every_steps and step % config.eval.every_steps == 0:
                        metrics.update(evaluate_supervised(config, groups, colocation, scheduler, inputs, pad, step))
                        stopped = best.update(step, metrics, groups)  # first: the best is kept either way
                        stopped = reached_target(config, metrics) or stopped
                        last = last or bool(stopped)
                    metrics["time/step"] = time.perf_counter() - started
                    tracker.log(step, metrics)
                    finished = {"step": step, "initial_eval": initial_eval, "best": best.state()}
                    if last or config.output.save_every_steps and step % config.output.save_every_steps == 0:
                        with span("checkpoint"):
                            save_checkpoint(config.run_dir, groups, finished)
                        saved_step = step
                    record(STEP_SPAN, step_began, time.time(), step=step)
                if last:
                    break
        except KeyboardInterrupt:
            if config.output.save_on_interrupt and finished["step"] > saved_step:
                tracker.print(f"interrupted: saving step {finished['step']} (interrupt again to skip it)")
                colocation.enter("checkpoint")
                save_checkpoint(config.run_dir, groups, finished)
            tracker.print(f"interrupted after step {finished['step']}: resume=true continues from the newest "
                          "checkpoint")
            tracker.close()
            raise

        final = {**{f"initial_{k}": v for k, v in initial_eval.items()}, **metrics}
        if stopped and finished["step"] < config.train.steps:
            tracker.print(f"stopped after step {finished['step']} of {config.train.steps}: {stopped}")
        tracker.print(describe_eval(f"after {finished['step']} steps", metrics)
                      + f"; checkpoint {config.run_dir / 'checkpoints' / f'step_{saved_step}' / 'model'}")
        for line in eval_summary_lines(final, finished["step"]):
            tracker.print(line)
        if best.step is not None:
            final.update(best.evaluate(config, groups, colocation, scheduler, inputs, pad, finished["step"], metrics))
            tracker.print(best.describe(final))
        tracker.close()
    # drawn once the workers stopped: drawing adds nothing to the run's peak memory
    # DPO's `loss` is a surrogate with the right gradient (`objectives.PreferenceLoss`): plot the real one
    plot_curves(config.run_dir, ("dpo/loss" if config.pipeline == "dpo" else "loss", "eval/loss", "eval/accuracy",
                                 "eval/dpo/reward_accuracy"))
    return final


def with_resolved_steps(config, num_rows: int):
    """`train.epochs` as steps (epochs × full batches per epoch), written into the config the run directory
    keeps (`epochs` then null), so the run reads one length everywhere."""
    train = config.train
    if train.epochs is None:
        return config
    steps = train.epochs * (num_rows // train.batch_size)
    return config.model_copy(update={"train": train.model_copy(update={"steps": steps, "epochs": None})})


def training_batch(items: list[Item], config, groups: WorkerGroups, colocation: ColocationManager,
                   pad_token_id: int) -> Batch:
    """The batch the trainer's objective reads: SFT's samples as they are; DPO's pairs as alternating chosen,
    rejected rows with `ref_logprobs`; distillation's samples with the teacher's top-k log-probs."""
    if config.pipeline == "dpo":
        batch = collate([sample for pair in items for sample in pair], pad_token_id)
        batch.extras["ref_logprobs"] = reference_logprobs(batch, groups, colocation,
                                                          config.roles.reference.backend, "train")
        return batch
    if config.pipeline == "distill":
        samples = [prompt_distillation_sample(s) for s in items] if config.distill.on_prompts else items
        batch = collate(samples, pad_token_id)
        if config.distill.on_prompts:
            batch.extras["ce_mask"] = response_column_mask(samples, batch)
        colocation.enter("reference")
        settings = config.distill
        packed = forward_rows(groups["reference"], config.roles.reference.backend, "compute_top_k", batch,
                              settings.top_k, settings.temperature)  # [B, T, 2k]
        batch.extras["teacher_ids"], batch.extras["teacher_logprobs"] = unpack_top_k(packed)
        return batch
    return collate(items, pad_token_id)


def prompt_distillation_sample(sample: Sample) -> Sample:
    """The sample with its prompt moved into the response (all but the first token, which nothing predicts),
    so the KD term covers the prompt too; `metadata["ce_mask"]` keeps the tokens CE trains on (the old
    response's trained tokens)."""
    moved = sample.prompt_ids[1:]
    return dataclasses.replace(
        sample, prompt_ids=sample.prompt_ids[:1], response_ids=moved + sample.response_ids,
        loss_mask=[1] * (len(moved) + len(sample.response_ids)), response_logprobs=[], policy_versions=[],
        metadata={**sample.metadata, "ce_mask": [0] * len(moved) + list(sample.loss_mask)})


def response_column_mask(samples: list[Sample], batch: Batch) -> torch.Tensor:
    """[B, T] float: each sample's `metadata["ce_mask"]` in the batch's response columns."""
    mask = torch.zeros_like(batch.response_mask)
    for row, sample in enumerate(samples):
        values = sample.metadata["ce_mask"]
        mask[row, : len(values)] = torch.tensor(values, dtype=mask.dtype)
    return mask


def evaluate_supervised(config, groups: WorkerGroups, colocation: ColocationManager, scheduler,
                        inputs, pad_token_id: int, step: int, validation: bool = True,
                        keep_samples: bool = True) -> dict[str, float]:
    """`eval/` metrics on the eval rows (the test set) and, with `validation`, `val/` metrics on the validation
    split: the loss (`row_losses`), and with `eval.greedy_accuracy` the greedy decode scored by `reward`. The
    engines get the trainer's weights once, after both losses; the eval's accuracy is broken down by
    `eval.group_by`, and its decoded samples go to `eval_samples.jsonl` (with `keep_samples`)."""
    splits = {"eval": (inputs.eval, inputs.eval_prompts)}
    if validation:
        splits["val"] = (inputs.validation, inputs.validation_prompts)
    found = {name: row_losses(config, groups, colocation, items, pad_token_id) for name, (items, _) in splits.items()}
    metrics: dict[str, float] = {}
    if scheduler is not None and any(prompts for _, prompts in splits.values()):
        bucket = int(config.cluster.weight_sync_bucket_mb * 2**20)
        metrics.update(sync_weights(groups, colocation, bucket, config.checks.weight_checksum))
        greedy = SamplingParams(config.eval.max_new_tokens, temperature=0.0)
        for name, (_, prompts) in splits.items():
            if prompts:
                samples_path = config.run_dir / "eval_samples.jsonl" if keep_samples else None
                extra = (config.eval.group_by, samples_path) if name == "eval" else ()
                found[name].update(evaluate(scheduler, colocation, prompts, greedy, step, *extra))
    metrics.update(found["eval"])
    metrics.update({"val/" + key.removeprefix("eval/"): value for key, value in found.get("val", {}).items()})
    return metrics


def row_losses(config, groups: WorkerGroups, colocation: ColocationManager, items: list[Item],
               pad_token_id: int) -> dict[str, float]:
    """`eval/` loss metrics of `items`: SFT and distillation, the NLL of the responses per token; DPO, the
    preference metrics against the reference. Empty without items."""
    if not items:
        return {}
    actor = groups["actor_train"]
    if config.pipeline == "dpo":
        chosen, rejected = [], []
        for start in range(0, len(items), EVAL_BATCH_ROWS // 2):
            batch = collate([s for pair in items[start: start + EVAL_BATCH_ROWS // 2] for s in pair], pad_token_id)
            reference = reference_logprobs(batch, groups, colocation, config.roles.reference.backend, "train")
            colocation.enter("train")
            policy = actor.call("compute_logprobs", batch)
            pair = pair_logratios(sequence_logprob_sums(policy, batch.response_mask),
                                  sequence_logprob_sums(reference, batch.response_mask))
            chosen.append(pair[0])
            rejected.append(pair[1])
        found = preference_metrics(torch.cat(chosen), torch.cat(rejected), config.dpo.beta)
        return {f"eval/{key}": value for key, value in found.items()}
    colocation.enter("train")
    total, tokens = 0.0, 0.0
    for start in range(0, len(items), EVAL_BATCH_ROWS):
        batch = collate(items[start: start + EVAL_BATCH_ROWS], pad_token_id)
        logprobs = actor.call("compute_logprobs", batch)  # [b, T]
        total -= float((logprobs * batch.response_mask).sum())
        tokens += float(batch.response_mask.sum())
    return {"eval/loss": total / max(tokens, 1.0)}


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
    step count is then a bound, not a plan."""
    train = config.train
    passes = train.steps * train.batch_size / num_rows
    if passes <= EXPOSURE_WARNING_EPOCHS or train.stop_at_accuracy is not None or train.early_stopping_patience:
        return None
    hint = ("" if config.data.has_validation else
            "; carve a validation split (data.validation_fraction: 0.1) and keep the best checkpoint on it "
            "(train.best_checkpoint_metric), ")
    return (f"train.steps={config.train.steps} x train.batch_size={config.train.batch_size} trains on each of "
            f"the {num_rows} training rows {passes:.0f} times (more than {EXPOSURE_WARNING_EPOCHS}): a model "
            f"memorises so few rows{hint or '; '}see docs/sft.md#a-few-hundred-rows")


def describe_data(config, inputs) -> str:
    """The run's data line: rows, batch, steps, epochs, and the validation split."""
    rows, train = len(inputs.train), config.train
    line = (f"{rows} training rows, {train.batch_size} a step, {train.steps} steps "
            f"(each row about {train.steps * train.batch_size / rows:.3g} times)")
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
    evals have passed without a new best."""

    def __init__(self, config):
        self.metric = config.train.best_checkpoint_metric
        self.patience = config.train.early_stopping_patience
        self.path = config.run_dir / "checkpoints" / "best"
        self.step: int | None = None
        self.value = math.nan
        self.since = 0

    def state(self) -> dict | None:
        """What a checkpoint's driver state keeps of it, so a resumed run goes on choosing."""
        return None if self.step is None else {"step": self.step, "value": self.value, "since": self.since}

    def restore(self, state: dict | None) -> None:
        if state:
            self.step, self.value, self.since = state["step"], state["value"], state["since"]

    def update(self, step: int, metrics: dict[str, float], groups: WorkerGroups) -> str:
        """Keep the trainer's weights when `metrics` holds a new best (saved over the old best). Returns why the
        run should stop (`early_stopping_patience` evals without one), or ""."""
        if self.metric is None or self.metric not in metrics:
            return ""
        value = metrics[self.metric]
        if self.step is None or (value < self.value if self.metric == "val/loss" else value > self.value):
            self._save(step, value, groups)
            return ""
        self.since += 1
        if self.patience is not None and self.since >= self.patience:
            return (f"{self.metric} has not improved on {self.value:.4g} (step {self.step}) for {self.since} "
                    "evals (train.early_stopping_patience)")
        return ""

    def _save(self, step: int, value: float, groups: WorkerGroups) -> None:
        partial = self.path.with_name("best.partial")
        shutil.rmtree(partial, ignore_errors=True)
        with span("checkpoint"), disk_full_as_error(partial):
            partial.mkdir(parents=True)
            groups["actor_train"].call("save", str(partial / "model"))
            (partial / "best.json").write_text(json.dumps({"step": step, "metric": self.metric, "value": value}))
            shutil.rmtree(self.path, ignore_errors=True)
            partial.rename(self.path)
        self.step, self.value, self.since = step, value, 0

    def evaluate(self, config, groups: WorkerGroups, colocation: ColocationManager, scheduler, inputs,
                 pad_token_id: int, last_step: int, last_metrics: dict[str, float]) -> dict[str, float]:
        """The best checkpoint's `eval/` metrics (the test set), as `best/eval/...` with `best/step`: unless it is
        the last step's (`last_metrics`), its weights are loaded into the trainer for it (the run has ended, so
        nothing trains on them)."""
        found = last_metrics
        if self.step != last_step:
            colocation.enter("train")
            groups["actor_train"].call("load", str(self.path / "model"), last_step + 1)
            found = evaluate_supervised(config, groups, colocation, scheduler, inputs, pad_token_id, last_step + 1,
                                        validation=False, keep_samples=False)
        return {"best/step": self.step, f"best/{self.metric}": self.value,
                **{f"best/{key}": value for key, value in found.items() if key.startswith("eval/")}}

    def describe(self, final: dict[str, float]) -> str:
        shown = describe_eval("", {key.removeprefix("best/"): value for key, value in final.items()
                                   if key.startswith("best/eval/")}).removeprefix(": ")
        return (f"best checkpoint: step {self.step} ({self.metric} {self.value:.4g}): {shown}; "
                f"{self.path / 'model'}")
