"""`curves.png`: training reward and eval accuracy against step, read back from `metrics.jsonl`."""

from __future__ import annotations

from pathlib import Path

from rollflow.trackers.durable_files import disk_full_as_error, read_records


def plot_curves(run_dir: Path, keys: tuple[str, ...] = ("reward/mean", "eval/accuracy")) -> Path | None:
    """Draw one panel per key that has data; returns the PNG path (None when there is nothing to plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_records(Path(run_dir) / "metrics.jsonl")  # a torn last line is left out
    series = {k: [(r["step"], r[k]) for r in rows if k in r] for k in keys}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    figure, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 3.5), squeeze=False)
    for axis, (key, points) in zip(axes[0], series.items()):
        steps, values = zip(*points)
        axis.plot(steps, values, marker="o" if len(points) < 30 else None)
        axis.set_title(key)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    out = Path(run_dir) / "curves.png"
    try:
        with disk_full_as_error(out):
            figure.savefig(out, dpi=100)
    finally:
        plt.close(figure)
    return out
