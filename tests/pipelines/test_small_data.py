"""A few hundred rows: the validation split, the best checkpoint chosen on it, early stopping, and the warning
when a run trains on each row too many times (docs/sft.md#a-few-hundred-rows)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from rollflow.config import load_config
from rollflow.errors import ConfigError
from rollflow.pipelines.supervised import (
    BestCheckpoint,
    SFTStep,
    describe_data,
    describe_eval,
    repetition_warning,
    with_resolved_steps,
)

SFT = ["pipeline=sft", "data.train={task: add2}", "data.response_key=answer"]


def _config(*overrides: str):
    return load_config(None, [*SFT, *overrides])


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.best_checkpoint_metric=val/loss"], "needs a validation split"),
    (["data.validation_fraction=0.1", "train.best_checkpoint_metric=val/accuracy"], "needs eval.greedy_accuracy"),
    (["data.validation_fraction=0.1", "train.early_stopping_patience=3"], "set that too"),
    (["data.validation_fraction=0.1", "data.validation={task: add2, split: eval}"], "not both"),
    (["data.validation_fraction=0.1", "train.best_checkpoint_metric=val/loss", "eval.every_steps=0"],
     "eval.every_steps > 0"),
    (["data.validation_fraction=0.9"], "less than or equal to 0.5"),
    (["train.best_checkpoint_metric=eval/accuracy", "data.validation_fraction=0.1"], "val/loss"),
    (["eval.group_by=[difficulty]"], "needs eval.greedy_accuracy: true"),
    (["eval.group_by=[a/b]", "eval.greedy_accuracy=true", "data.eval={task: add2, split: eval}"], "without '/'"),
])
def test_choosing_on_anything_but_a_validation_split_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        _config(*overrides)


def test_a_validation_split_with_a_best_metric_and_patience_loads():
    config = _config("data.validation_fraction=0.1", "eval.greedy_accuracy=true", "data.eval={task: add2, split: eval}",
                     "train.best_checkpoint_metric=val/accuracy", "train.early_stopping_patience=2")
    assert config.data.has_validation and config.train.early_stopping_patience == 2


def test_the_repetition_warning_counts_passes_over_the_rows():
    config = _config("train.steps=600", "train.batch_size=128")
    warning = repetition_warning(config, 570)
    assert warning is not None and "570 training rows 135 times" in warning
    assert "data.validation_fraction" in warning
    assert repetition_warning(config, 11_695) is None  # 6.6 passes: the word-problem recipe
    with_split = _config("train.steps=600", "train.batch_size=128", "data.validation_fraction=0.1")
    assert "data.validation_fraction" not in repetition_warning(with_split, 570)
    stopping = _config("train.steps=600", "train.batch_size=128", "data.validation_fraction=0.1",
                       "train.best_checkpoint_metric=val/loss", "train.early_stopping_patience=3")
    assert repetition_warning(stopping, 570) is None  # its step count is a bound
    choosing = _config("train.steps=600", "train.batch_size=128", "data.validation_fraction=0.1",
                       "train.best_checkpoint_metric=val/loss")
    assert repetition_warning(choosing, 570) is None  # the validation split chooses what is kept


def test_the_final_line_names_each_split():
    line = describe_eval("after 30 steps", {"loss": 0.06, "val/loss": 0.9, "val/accuracy": 0.31,
                                            "eval/loss": 1.2, "eval/accuracy": 0.25})
    assert line == ("after 30 steps: train loss 0.06, val loss 0.9, val accuracy 0.31, eval loss 1.2, "
                    "eval accuracy 0.25")


class _Trainer:
    """`groups["actor_train"]` whose `save` writes a marker file holding the step it was told about."""

    def __init__(self):
        self.step = 0

    def call(self, method: str, path: str) -> None:
        assert method == "save"
        Path(path).mkdir(parents=True)
        (Path(path) / "weights").write_text(str(self.step))


def _best(tmp_path: Path, metric: str, patience: int | None) -> BestCheckpoint:
    config = SimpleNamespace(run_dir=tmp_path, train=SimpleNamespace(best_checkpoint_metric=metric,
                                                                     early_stopping_patience=patience))
    return BestCheckpoint(config)


@pytest.mark.parametrize(("metric", "values", "best_step", "stops_at"), [
    ("val/accuracy", [0.1, 0.3, 0.3, 0.2, 0.5], 40, None),      # ties are not a new best
    ("val/accuracy", [0.1, 0.3, 0.25, 0.3, 0.5], 10, 30),         # patience 2: stops at the second miss
    ("val/loss", [2.0, 1.5, 1.6, 1.4, 1.45], 30, None),
])
def test_the_best_checkpoint_follows_the_metric_and_patience(tmp_path, metric, values, best_step, stops_at):
    best, trainer = _best(tmp_path, metric, 2 if stops_at else 3), _Trainer()
    stopped_at = None
    for step, value in zip(range(0, 50, 10), values, strict=True):
        trainer.step = step
        if best.update(step, {metric: value, "eval/loss": 9.0}, {"actor_train": trainer}):
            stopped_at = step
            break
    assert stopped_at == stops_at
    assert best.step == best_step
    saved = json.loads((tmp_path / "checkpoints" / "best" / "best.json").read_text())
    assert saved == {"step": best_step, "metric": metric, "value": values[best_step // 10]}
    assert (tmp_path / "checkpoints" / "best" / "model" / "weights").read_text() == str(best_step)
    assert not (tmp_path / "checkpoints" / "best.partial").exists()


def test_a_resumed_run_goes_on_counting_evals_without_a_new_best(tmp_path):
    best = _best(tmp_path, "val/loss", 2)
    best.update(0, {"val/loss": 1.0}, {"actor_train": _Trainer()})
    best.update(10, {"val/loss": 1.2}, {"actor_train": _Trainer()})
    resumed = _best(tmp_path, "val/loss", 2)
    resumed.restore(json.loads(json.dumps(best.state())))
    assert resumed.update(20, {"val/loss": 1.1}, {}) == (
        "no validation metric improved for 2 evals (train.early_stopping_patience; best so far: val/loss 1 (step 0))")


def test_accuracy_at_zero_while_the_loss_falls_is_not_stopped(tmp_path):
    """The new user's task: val accuracy 0 for many evals while val loss falls, then it takes off. Patience 2
    would have ended the run at the third eval and kept step 0; the loss's records keep it going, and each tie
    at accuracy 0 goes to the lower loss, so the best is never the untrained model once the loss fell."""
    best, trainer = _best(tmp_path, "val/accuracy", 2), _Trainer()
    curve = [(0.0, 3.0), (0.0, 2.5), (0.0, 2.0), (0.0, 1.6), (0.0, 1.3), (0.2, 1.0), (0.6, 0.7)]
    for step, (accuracy, loss) in zip(range(0, 70, 10), curve, strict=True):
        trainer.step = step
        assert best.update(step, {"val/accuracy": accuracy, "val/loss": loss}, {"actor_train": trainer}) == ""
        assert best.step == step  # each eval is a new best: the same accuracy at a lower loss, or a higher one
    assert (tmp_path / "checkpoints" / "best" / "model" / "weights").read_text() == "60"


def test_patience_runs_out_once_neither_loss_nor_accuracy_moves(tmp_path):
    best, trainer = _best(tmp_path, "val/accuracy", 2), _Trainer()
    evals = [(0.5, 1.0), (0.4, 0.9), (0.4, 0.95), (0.45, 0.92)]  # step 10: a loss record, no new best
    reasons = [best.update(step, {"val/accuracy": a, "val/loss": loss}, {"actor_train": trainer})
               for step, (a, loss) in zip(range(0, 40, 10), evals, strict=True)]
    assert reasons[:3] == ["", "", ""] and best.step == 0
    assert reasons[3] == ("no validation metric improved for 2 evals (train.early_stopping_patience; best so far: "
                          "val/loss 0.9 (step 10), val/accuracy 0.5 (step 0))")


def test_the_progress_line_counts_epochs_as_train_epochs_does():
    """160 rows in batches of 64: 2 full batches a pass (32 rows left over each time). `train.epochs: 100` is
    200 steps, and the progress line's `epoch` reads 100 at step 200 (it read 80: step x batch / rows)."""
    config = with_resolved_steps(_config("train={epochs: 100, batch_size: 64, train_micro_batch_size: 64}"), 160)
    assert config.train.steps == 200
    step = SFTStep(config)
    step.inputs = SimpleNamespace(train=[None] * 160, validation=[])
    assert step.position(200) == {"epoch": 100.0}
    assert describe_data(config, step.inputs) == ("160 training rows, 64 a step, 200 steps (100 epochs; each row "
                                                  "about 80 times)")
