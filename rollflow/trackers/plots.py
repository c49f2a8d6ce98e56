"""`curves.png`: the run's learning curves against step, read back from `metrics.jsonl`.

One panel per metric, titled with what the curve is (a training metric is sampled at the rollout temperature,
a held-out one decoded greedily) and the key it plots; what every key means: docs/metrics.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from rollflow.trackers.durable_files import read_records, write_failure_as_error


class Panel(NamedTuple):
    title: str  # what the curve is
    y_label: str  # what the y axis measures


# The metrics the pipelines plot; another key gets a panel titled with the key itself.
PANELS = {
    "reward/mean": Panel("training reward (sampled, mean over the step's samples)", "reward"),
    "eval/accuracy": Panel("held-out accuracy (greedy)", "accuracy"),
    "loss": Panel("training loss (mean over the step's batch)", "loss"),
    "dpo/loss": Panel("training DPO loss (mean over the step's pairs)", "loss"),
    "eval/loss": Panel("held-out loss (NLL per response token)", "loss (nats / token)"),
    "eval/dpo/reward_accuracy": Panel("held-out preference accuracy (chosen reward > rejected)", "accuracy"),
    "rollout/return": Panel("training return (sampled, mean over the step's episodes)", "return"),
    "rollout/success": Panel("training success rate (sampled episodes)", "success rate"),
    "eval/success": Panel("held-out success rate (greedy)", "success rate"),
}


def curves_figure(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> Any:
    """The learning-curve figure of `metrics.jsonl` records: one panel per key that has data, in `keys` order.

    Args:
        rows: the records (`{"step": int, key: value, ...}`).
        keys: metric keys to plot.

    Returns:
        A `matplotlib.figure.Figure` (not attached to pyplot: nothing to close), or None when no key has data.
    """
    from matplotlib.figure import Figure

    series = {key: [(row["step"], row[key]) for row in rows if key in row] for key in keys}
    series = {key: points for key, points in series.items() if points}
    if not series:
        return None
    figure = Figure(figsize=(6 * len(series), 4), layout="constrained")
    for axis, (key, points) in zip(figure.subplots(1, len(series), squeeze=False)[0], series.items()):
        panel = PANELS.get(key, Panel(key, key))
        steps, values = zip(*points)
        axis.plot(steps, values, marker="o" if len(points) < 30 else None)
        axis.set_title(f"{panel.title}\n{key}", fontsize=10)
        axis.set_xlabel("step")
        axis.set_ylabel(panel.y_label)
        axis.grid(alpha=0.3)
    return figure


def plot_curves(run_dir: Path, keys: tuple[str, ...] = ("reward/mean", "eval/accuracy")) -> Path | None:
    """Draw `curves_figure` of the run's `metrics.jsonl` into `run_dir/curves.png`.

    Returns:
        The PNG's path; None when there is nothing to plot (no file is written).

    Raises:
        DiskFullError: the disk filled up writing the PNG.
    """
    rows = read_records(Path(run_dir) / "metrics.jsonl")  # a torn last line is left out
    figure = curves_figure(rows, keys)
    if figure is None:
        return None
    out = Path(run_dir) / "curves.png"
    with write_failure_as_error(out):
        figure.savefig(out, dpi=100)
    return out
