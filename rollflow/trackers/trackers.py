"""`MetricsTracker` fans one metrics dict per step out to the console, `metrics.jsonl`, TensorBoard and
Weights & Biases. What each metric means: docs/metrics.md (`rollflow.trackers.metric_names`)."""

from __future__ import annotations

import math
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from rich.console import Console

from rollflow.trackers.durable_files import append_records


class Column(NamedTuple):
    """One entry of the console's step line: `<label> <value>` when the step logged `key`.

    Attributes:
        key: the metric (docs/metrics.md).
        label: its short name on the line.
        held: shown on every line from the step that logged it until a step logs it again (an eval's
            results, so a supervised run's line always says where the last eval left the model).
    """

    key: str
    label: str
    held: bool = False


# The step line of each pipeline, in display order.
RL_COLUMNS = (
    Column("reward/mean", "reward"),
    Column("rollout/accuracy", "acc"),
    Column("eval/accuracy", "eval_acc"),
    Column("rollout/response_length", "len"),
    Column("actor/kl", "kl"),
    Column("rollout/tokens_per_second", "tok/s"),
    Column("time/step", "step_s"),
)
SUPERVISED_COLUMNS = (  # SFT and distillation: the training loss, the last eval's loss and greedy accuracy
    Column("loss", "loss"),
    Column("epoch", "epoch"),
    Column("val/loss", "val_loss", held=True),
    Column("val/accuracy", "val_acc", held=True),
    Column("eval/loss", "eval_loss", held=True),
    Column("eval/accuracy", "eval_acc", held=True),
    Column("time/step", "step_s"),
)
DPO_COLUMNS = (  # DPO's `loss` is a surrogate with the right gradient; `dpo/loss` is the real one
    Column("dpo/loss", "loss"),
    Column("dpo/reward_accuracy", "pref_acc"),
    Column("val/dpo/reward_accuracy", "val_pref_acc", held=True),
    Column("val/accuracy", "val_acc", held=True),
    Column("eval/dpo/reward_accuracy", "eval_pref_acc", held=True),
    Column("eval/accuracy", "eval_acc", held=True),
    Column("time/step", "step_s"),
)
AGENTIC_COLUMNS = (
    Column("rollout/success", "success"),
    Column("rollout/return", "return"),
    Column("eval/success", "eval_success"),
    Column("rollout/turns", "turns"),
    Column("time/step", "step_s"),
)
RECENT_STEPS = 10  # the ETA's step time: the mean of this many latest steps
WALL_TIME_KEY = "time/unix"  # each metrics.jsonl record's wall-clock time (docs/metrics.md, "The record")


TB_FLUSH_S = 10  # how stale TensorBoard's files may be while a run runs


class TensorBoardThread:
    """A TensorBoard event file written from a thread of its own.

    One `add_scalar` builds an event and hands it to TensorBoard's writer thread, a lock and often a GIL
    hand-off each: ~100 metrics took the step's own thread 6-11 ms on a 2-core machine. Here the step hands
    over its whole dict at once and the scalars are written while the driver waits on its workers. The writer
    flushes every TB_FLUSH_S, and on `close`: flushing every step cost a small run ~5% of its step time.
    """

    def __init__(self, log_dir: Path, purge_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(log_dir), purge_step=purge_step, flush_secs=TB_FLUSH_S)
        self._steps: queue.SimpleQueue[tuple[int, dict[str, float]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="rollflow-tensorboard", daemon=True)
        self._thread.start()

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._steps.put((step, scalars))

    def _write(self) -> None:
        while (item := self._steps.get()) is not None:
            step, scalars = item
            for key, value in scalars.items():
                self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        """Write what is queued, flush and close the file."""
        self._steps.put(None)
        self._thread.join()
        self._writer.close()


class MetricsTracker:
    """Log metrics per step.

    Args:
        run_dir: the run directory (`metrics.jsonl`, `tensorboard/`, `wandb/` and `wandb_id` go there; W&B
            also reads the run's `config.yaml`, see `WandbRun`).
        trackers: any of "console", "jsonl", "tensorboard", "wandb".
        total_steps: for the console's "step i/N" and its ETA.
        resumed_at: the checkpoint step a resumed run continues from: TensorBoard hides the events of later
            steps the interrupted run had written (they run again). `metrics.jsonl` was already cut back by
            `prepare_run_dir`.
        columns: what the console's step line shows (the pipeline step's `columns`; RLVR's by default).
        clock: monotonic seconds, which time the steps for the ETA (tests pass a fake one).
        wall_clock: Unix seconds, which stamp each `metrics.jsonl` record (`time/unix`).

    Raises:
        DiskFullError: (from `log`) the disk filled up writing `metrics.jsonl`.
    """

    def __init__(self, run_dir: Path, trackers: list[str], total_steps: int, resumed_at: int | None = None, *,
                 columns: tuple[Column, ...] = RL_COLUMNS, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.columns = columns
        self.held: dict[str, float] = {}  # the latest value of each held column
        self.wall_clock = wall_clock
        # soft_wrap: a line stays one line in a file or a pipe (rich would wrap it at 80 columns there)
        self.console = Console(highlight=False, soft_wrap=True)
        self.step_lines = "console" in trackers  # one line per step; run messages always print
        self.jsonl = self.run_dir / "metrics.jsonl" if "jsonl" in trackers else None
        if self.jsonl:
            append_records(self.jsonl, [])  # the file exists from the start, as every tracker's output does
        self.tensorboard = None
        if "tensorboard" in trackers:
            purge_step = None if resumed_at is None else resumed_at + 1
            self.tensorboard = TensorBoardThread(self.run_dir / "tensorboard", purge_step)
        self.wandb = None
        if "wandb" in trackers:
            from rollflow.trackers.wandb_run import WandbRun

            self.wandb = WandbRun.start(self.run_dir)
        self.step_timer = StepTimer(clock)  # after the trackers start: W&B's start-up is not a step's time

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Write step `step`'s numeric metrics (other values are left out) to every tracker.

        Args:
            step: 0 for the eval before training, then 1 .. total_steps; each call after a step's work ends
                that step's time for the ETA.
            metrics: metric name -> value (names: docs/metrics.md).
        """
        self.step_timer.lap(step)
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
        if self.jsonl:
            # the record alone has a wall-clock time: TensorBoard and W&B stamp each point themselves
            record = {"step": step, WALL_TIME_KEY: round(self.wall_clock(), 3), **clean}
            append_records(self.jsonl, [record])  # one write: never half a record
        if self.tensorboard:
            self.tensorboard.log(step, {key: value for key, value in clean.items() if math.isfinite(value)})
        if self.wandb:
            self.wandb.log(step, {key: value for key, value in clean.items() if math.isfinite(value)})
        self.held.update({column.key: clean[column.key] for column in self.columns
                          if column.held and column.key in clean})
        if self.step_lines:
            self.console.print(self.step_line(step, clean))

    def step_line(self, step: int, metrics: dict[str, float]) -> str:
        """`step i/N`, then `<label> <value>` for each column the step logged (or holds), then the ETA."""
        parts = [f"[bold]step {step}/{self.total_steps}[/bold]"]
        for column in self.columns:
            value = metrics.get(column.key, self.held.get(column.key) if column.held else None)
            if value is not None:
                parts.append(f"{column.label} {value:.0f}" if abs(value) >= 100 else f"{column.label} {value:.3g}")
        eta = self.step_timer.eta(self.total_steps - step)
        if eta is not None:
            parts.append(f"eta {format_duration(eta)}")
        return "  ".join(parts)

    def print(self, message: str) -> None:
        self.console.print(message)

    def close(self) -> None:
        """Flush and close the trackers (the W&B run finishes); a second call does nothing."""
        if self.tensorboard:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb:
            self.wandb.finish()
            self.wandb = None


class StepTimer:
    """Wall time of the steps this process ran, for the ETA. A step's time runs from the previous `lap` (the
    previous step's log, or the tracker's start) to its own, so it includes the step's eval, checkpoint and
    logging; step 0 (the eval before training) is not a step and is not counted.

    Args:
        clock: monotonic seconds.
    """

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.last = clock()
        self.first: float | None = None  # the process's first step: warm-up
        self.recent: deque[float] = deque(maxlen=RECENT_STEPS)  # the latest steps after it, newest last

    def lap(self, step: int) -> None:
        """Step `step` is done now."""
        now = self.clock()
        if step > 0:
            if self.first is None:
                self.first = now - self.last
            else:
                self.recent.append(now - self.last)
        self.last = now

    def eta(self, steps_left: int) -> float | None:
        """Seconds the `steps_left` steps will take at the mean time of the latest `RECENT_STEPS` steps; None
        before the first step.

        The latest steps, not all: after a slow patch (a busy machine, a stalled worker) the estimate is right
        again `RECENT_STEPS` steps later, where a mean over the run carries the patch to its end. The
        process's first step includes warm-up (engines and trainer compiling, caches filling, a resumed run's
        checkpoint loading), so it is left out once there is a second one.
        """
        if self.first is None:
            return None
        step_seconds = statistics.fmean(self.recent) if self.recent else self.first
        return step_seconds * max(steps_left, 0)


def format_duration(seconds: float) -> str:
    """`45s`, `1m12s`, `2h05m`: whole seconds under an hour, whole minutes past it."""
    total = round(seconds)
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{total // 60}m{total % 60:02d}s"
    return f"{total // 3600}h{total % 3600 // 60:02d}m"
