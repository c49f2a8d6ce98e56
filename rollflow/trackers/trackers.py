"""`MetricsTracker` fans one metrics dict per step out to the console, `metrics.jsonl`, TensorBoard and
Weights & Biases. What each metric means: docs/metrics.md (`rollflow.trackers.metric_names`)."""

from __future__ import annotations

import math
import queue
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from rollflow.trackers.durable_files import append_records

# metric key -> short label for the one-line console summary, in display order
CONSOLE_COLUMNS = {
    "reward/mean": "reward",
    "rollout/accuracy": "acc",
    "eval/accuracy": "eval_acc",
    "rollout/response_length": "len",
    "actor/kl": "kl",
    "rollout/tokens_per_second": "tok/s",
    "time/step": "step_s",
}


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
        clock: monotonic seconds, which time the steps for the ETA (tests pass a fake one).

    Raises:
        DiskFullError: (from `log`) the disk filled up writing `metrics.jsonl`.
    """

    def __init__(self, run_dir: Path, trackers: list[str], total_steps: int, resumed_at: int | None = None, *,
                 clock: Callable[[], float] = time.monotonic):
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
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
            append_records(self.jsonl, [{"step": step, **clean}])  # one write: never half a record
        if self.tensorboard:
            self.tensorboard.log(step, {key: value for key, value in clean.items() if math.isfinite(value)})
        if self.wandb:
            self.wandb.log(step, {key: value for key, value in clean.items() if math.isfinite(value)})
        if self.step_lines:
            parts = [f"[bold]step {step}/{self.total_steps}[/bold]"]
            for key, label in CONSOLE_COLUMNS.items():
                if key in clean:
                    value = clean[key]
                    parts.append(f"{label} {value:.0f}" if abs(value) >= 100 else f"{label} {value:.3g}")
            eta = self.step_timer.eta(self.total_steps - step)
            if eta is not None:
                parts.append(f"eta {format_duration(eta)}")
            self.console.print("  ".join(parts))

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
        self.seconds: list[float] = []  # of the steps this process ran, in order

    def lap(self, step: int) -> None:
        """Step `step` is done now."""
        now = self.clock()
        if step > 0:
            self.seconds.append(now - self.last)
        self.last = now

    def eta(self, steps_left: int) -> float | None:
        """Seconds the `steps_left` steps will take at the mean step time so far; None before the first step.

        The process's first step includes warm-up (engines and trainer compiling, caches filling, a resumed
        run's checkpoint loading), so it is left out of the mean once there is a second one.
        """
        if not self.seconds:
            return None
        steady = self.seconds[1:] or self.seconds
        return statistics.fmean(steady) * max(steps_left, 0)


def format_duration(seconds: float) -> str:
    """`45s`, `1m12s`, `2h05m`: whole seconds under an hour, whole minutes past it."""
    total = round(seconds)
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{total // 60}m{total % 60:02d}s"
    return f"{total // 3600}h{total % 3600 // 60:02d}m"
