"""`timeline.json` and `timeline.png`: where a run's time went, per worker and phase.

`timeline.json` is a Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing): one process row
per lane (the driver, then each worker "<role> <index>"), a span per driver phase and per worker method call
(`rollflow.spans`). Spans of one lane that overlap in time (an engine serving concurrent requests,
the driver's reward threads) go to sub-rows.

`timeline.png` draws one typical step: the step of median duration among the run's steps after the first
(which carries warm-up), one lane per worker, phases coloured by name.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from rollflow.errors import DiskFullError
from rollflow.spans import DRIVER_LANE, take
from rollflow.trackers.durable_files import write_atomically

STEP_SPAN = "step"  # the driver span around one training step (args: step)


def lane_order(lanes: Iterable[str]) -> list[str]:
    """The driver first, then workers by role and index."""
    def key(lane: str) -> tuple:
        role, _, index = lane.rpartition(" ")
        return (lane != DRIVER_LANE, role or lane, int(index) if index.isdigit() else 0, lane)
    return sorted(set(lanes), key=key)


def assign_rows(spans: list[dict[str, Any]]) -> list[int]:
    """A sub-row per span of one lane so that spans in a row nest or follow each other, never cross: the
    first row whose open spans all contain this one, or that is free by its start."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i]["start"], -spans[i]["end"]))
    open_ends: list[list[float]] = []  # per row: ends of the spans still open, innermost last
    rows = [0] * len(spans)
    for i in order:
        start, end = spans[i]["start"], spans[i]["end"]
        for row, ends in enumerate(open_ends):
            while ends and ends[-1] <= start:
                ends.pop()
            if not ends or end <= ends[-1]:  # free, or nests inside the innermost open span
                ends.append(end)
                rows[i] = row
                break
        else:
            open_ends.append([end])
            rows[i] = len(open_ends) - 1
    return rows


def lane_rows(spans: list[dict[str, Any]], lanes: Iterable[str] | None = None
              ) -> list[tuple[str, list[tuple[dict[str, Any], int]]]]:
    """Per lane (`lanes`, default those of `spans` in `lane_order`), its spans with their sub-row
    (`assign_rows`)."""
    result = []
    for lane in lane_order(s["lane"] for s in spans) if lanes is None else lanes:
        mine = [s for s in spans if s["lane"] == lane]
        result.append((lane, list(zip(mine, assign_rows(mine)))))
    return result


def chrome_trace(spans: list[dict[str, Any]]) -> dict[str, Any]:
    """The Chrome trace-event document of `spans`: times in microseconds from the first span, whose
    `time.time()` is `otherData.origin_unix_s`."""
    if not spans:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    origin = min(s["start"] for s in spans)
    events: list[dict[str, Any]] = []
    for pid, (lane, placed) in enumerate(lane_rows(spans)):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": lane}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
        for s, row in placed:
            events.append({"ph": "X", "name": s["name"], "cat": lane.rpartition(" ")[0] or lane, "pid": pid,
                           "tid": row, "ts": round((s["start"] - origin) * 1e6, 1),
                           "dur": round(max(s["end"] - s["start"], 0.0) * 1e6, 1), "args": s.get("args", {})})
    # the origin as wall-clock time, so a trace lines up with what happened outside the run (a benchmark's clock)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"origin_unix_s": origin}}


def typical_step(spans: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The driver's step span of median duration among the steps after the first (the only one if a single
    step ran); None when no step ran."""
    steps = sorted((s for s in spans if s["lane"] == DRIVER_LANE and s["name"] == STEP_SPAN),
                   key=lambda s: s["start"])
    if not steps:
        return None
    later = steps[1:] or steps
    median = statistics.median_low([s["end"] - s["start"] for s in later])
    return next(s for s in later if s["end"] - s["start"] == median)


class WorkerSpans:
    """The workers' spans, taken once just before they stop (`running_roles(..., before_stop=...)`)."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []

    def take_from(self, groups) -> None:
        """Take every worker's spans (`WorkerGroups.gather_spans`)."""
        self.spans = groups.gather_spans()


@contextlib.contextmanager
def timeline_written(run_dir: Path, since: float) -> Iterator[WorkerSpans]:
    """On leaving the block, normally or not, write the run's timeline into `run_dir` (when it exists): this
    process's spans since `since` (`time.time()`) and the workers', which the block hands the yielded
    `WorkerSpans` before they stop (`running_roles(..., before_stop=spans.take_from)`). Enter it outside
    `running_roles`: the picture is drawn after the workers stopped, so drawing's imports and memory never add
    to the run's peak. A timeline that cannot be written is a warning, never the run's failure (and not even
    a warning when the run is stopping because the disk is full: its own error line says so)."""
    workers = WorkerSpans()
    stopping_on: BaseException | None = None
    try:
        yield workers
    except BaseException as err:
        stopping_on = err
        raise
    finally:
        spans = [s for s in take() if s["end"] >= since] + workers.spans
        if Path(run_dir).is_dir():
            try:
                write_timeline(run_dir, spans)
            except Exception as err:  # noqa: BLE001 - a picture must not fail a run
                if not (isinstance(err, DiskFullError) and isinstance(stopping_on, DiskFullError)):
                    print(f"rollflow: warning: could not write the timeline: {type(err).__name__}: {err}",
                          file=sys.stderr)


def write_timeline(run_dir: Path, spans: list[dict[str, Any]], picture: bool = True) -> Path | None:
    """Write `timeline.json` (every span) and, when `picture` and a step ran, `timeline.png` (one typical
    step) into `run_dir`. Returns the JSON path (None when there were no spans)."""
    if not spans:
        return None
    path = Path(run_dir) / "timeline.json"
    write_atomically(path, json.dumps(chrome_trace(spans)))
    step = typical_step(spans)
    if picture and step is not None:
        plot_step(spans, step, Path(run_dir) / "timeline.png")
    return path


def plot_step(spans: list[dict[str, Any]], step: dict[str, Any], out: Path) -> Path:
    """Draw the spans inside `step`'s window: a row per lane and sub-row, bars coloured by span name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start, end = step["start"], step["end"]
    inside = [s for s in spans if s["end"] > start and s["start"] < end and s is not step]
    rows: list[tuple[str, list[dict[str, Any]]]] = []  # (label, spans) top to bottom
    for lane, placed in lane_rows(inside, lane_order(s["lane"] for s in spans)):  # every lane, even idle ones
        by_row: dict[int, list] = {}
        for s, row in placed:
            by_row.setdefault(row, []).append(s)
        for row in sorted(by_row) or [0]:
            rows.append((lane if row == 0 else "", by_row.get(row, [])))
    names = sorted({s["name"] for s in inside})
    palette = plt.get_cmap("tab20")
    colour = {name: palette(i % 20) for i, name in enumerate(names)}
    figure, axis = plt.subplots(figsize=(11, 0.45 * len(rows) + 1.6))
    for y, (_, row_spans) in enumerate(rows):
        for s in row_spans:
            left, right = max(s["start"], start) - start, min(s["end"], end) - start
            axis.broken_barh([(left, max(right - left, 1e-4))], (y - 0.4, 0.8), color=colour[s["name"]])
    axis.set_yticks(range(len(rows)), [label for label, _ in rows])
    axis.invert_yaxis()
    axis.set_xlim(0, end - start)
    axis.set_xlabel("seconds from the start of the step")
    number = step.get("args", {}).get("step")
    axis.set_title(f"step {number}: {end - start:.3f} s (the run's median step)" if number is not None
                   else f"one step: {end - start:.3f} s")
    axis.grid(axis="x", alpha=0.3)
    handles = [matplotlib.patches.Patch(color=colour[name], label=name) for name in names]
    axis.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    figure.tight_layout()
    try:
        figure.savefig(out, dpi=100)
    finally:
        plt.close(figure)
    return out
