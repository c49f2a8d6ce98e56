"""`MetricsTracker` fans one metrics dict per step out to the console, `metrics.jsonl` and TensorBoard."""

from __future__ import annotations

import math
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


class MetricsTracker:
    """Log metrics per step.

    Args:
        run_dir: the run directory (`metrics.jsonl`, `tensorboard/` go there).
        trackers: any of "console", "jsonl", "tensorboard".
        total_steps: for the console's "step i/N".
        resumed_at: the checkpoint step a resumed run continues from: TensorBoard hides the events of later
            steps the interrupted run had written (they run again). `metrics.jsonl` was already cut back by
            `prepare_run_dir`.

    Raises:
        DiskFullError: (from `log`) the disk filled up writing `metrics.jsonl`.
    """

    def __init__(self, run_dir: Path, trackers: list[str], total_steps: int, resumed_at: int | None = None):
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.console = Console(highlight=False)
        self.step_lines = "console" in trackers  # one line per step; run messages always print
        self.jsonl = self.run_dir / "metrics.jsonl" if "jsonl" in trackers else None
        if self.jsonl:
            append_records(self.jsonl, [])  # the file exists from the start, as every tracker's output does
        self.tensorboard = None
        if "tensorboard" in trackers:
            from torch.utils.tensorboard import SummaryWriter

            purge_step = None if resumed_at is None else resumed_at + 1
            self.tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge_step)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
        if self.jsonl:
            append_records(self.jsonl, [{"step": step, **clean}])  # one write: never half a record
        if self.tensorboard:
            for key, value in clean.items():
                if math.isfinite(value):
                    self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.step_lines:
            parts = [f"[bold]step {step}/{self.total_steps}[/bold]"]
            for key, label in CONSOLE_COLUMNS.items():
                if key in clean:
                    value = clean[key]
                    parts.append(f"{label} {value:.0f}" if abs(value) >= 100 else f"{label} {value:.3g}")
            self.console.print("  ".join(parts))

    def print(self, message: str) -> None:
        self.console.print(message)

    def close(self) -> None:
        if self.tensorboard:
            self.tensorboard.close()
