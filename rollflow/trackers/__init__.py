"""Where metrics go: console progress line, metrics.jsonl, TensorBoard, Weights & Biases; what each metric
means (`metric_names`, docs/metrics.md); and the learning-curve plot."""

from rollflow.trackers.trackers import MetricsTracker

__all__ = ["MetricsTracker"]
