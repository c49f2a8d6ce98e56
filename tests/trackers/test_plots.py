"""curves.png: one labeled panel per metric, titled with what the curve is."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from rollflow.trackers.durable_files import append_records
from rollflow.trackers.plots import PANELS, curves_figure, plot_curves

ROOT = Path(__file__).resolve().parents[2]

ROWS = [{"step": 0, "eval/accuracy": 0.25},
        {"step": 1, "reward/mean": 0.5},
        {"step": 2, "reward/mean": 0.75, "eval/accuracy": 0.5}]


def _labels(figure) -> list[tuple[str, str, str]]:
    return [(axis.get_title(), axis.get_xlabel(), axis.get_ylabel()) for axis in figure.axes]


def test_each_panel_says_what_its_curve_is():
    figure = curves_figure(ROWS, ("reward/mean", "eval/accuracy"))
    assert _labels(figure) == [
        ("training reward (sampled, mean over the step's samples)\nreward/mean", "step", "reward"),
        ("held-out accuracy (greedy)\neval/accuracy", "step", "accuracy"),
    ]
    reward, accuracy = (axis.lines[0] for axis in figure.axes)
    assert list(reward.get_xdata()) == [1, 2] and list(reward.get_ydata()) == [0.5, 0.75]
    assert list(accuracy.get_xdata()) == [0, 2] and list(accuracy.get_ydata()) == [0.25, 0.5]


def test_keys_without_data_get_no_panel_and_unknown_keys_are_labeled_by_name():
    figure = curves_figure([*ROWS, {"step": 3, "my/metric": 1.0}], ("loss", "my/metric", "eval/accuracy"))
    assert _labels(figure) == [("my/metric\nmy/metric", "step", "my/metric"),
                               ("held-out accuracy (greedy)\neval/accuracy", "step", "accuracy")]
    assert curves_figure(ROWS, ("loss",)) is None


def test_every_key_the_pipelines_plot_has_a_described_panel():
    plotted = set(inspect.signature(plot_curves).parameters["keys"].default)
    for path in (ROOT / "rollflow" / "pipelines").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            # a step object's `plot_keys = (...)` (rollflow/pipelines/loop.py draws them)
            if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["plot_keys"]:
                plotted.update(ast.literal_eval(node.value))
    assert {"reward/mean", "eval/accuracy", "rollout/success", "loss", "dpo/loss"} <= plotted  # the scan found them
    assert plotted <= set(PANELS), f"describe in rollflow/trackers/plots.py PANELS: {plotted - set(PANELS)}"
    figure = curves_figure([{"step": step, **dict.fromkeys(PANELS, 0.5)} for step in range(3)], tuple(PANELS))
    assert len(figure.axes) == len(PANELS)
    for (title, x_label, y_label), key in zip(_labels(figure), PANELS):
        assert title == f"{PANELS[key].title}\n{key}" and x_label == "step" and y_label == PANELS[key].y_label


def test_plot_curves_writes_the_png_of_the_run(tmp_path):
    append_records(tmp_path / "metrics.jsonl", ROWS)
    out = plot_curves(tmp_path)
    assert out == tmp_path / "curves.png" and out.read_bytes().startswith(b"\x89PNG")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert plot_curves(empty) is None and not (empty / "curves.png").exists()
