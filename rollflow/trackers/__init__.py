"""Where metrics go: console progress line, metrics.jsonl, TensorBoard; and the learning-curve plot."""

from rollflow.trackers.trackers import MetricsTracker

__all__ = ["MetricsTracker"]
