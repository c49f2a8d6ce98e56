"""Weights & Biases (`output.trackers: [..., wandb]`): one W&B run per rollflow run, resumed with it.

`wandb` is imported here only, when a run asks for it; the config check at load time tells a user without it
how to install it (`pip install "rollflow[wandb]"`). The W&B run's id is kept in the run directory
(`wandb_id`), so a run resumed with `resume: true` logs into the same W&B run. Online or offline is W&B's
choice, from its environment as always (`WANDB_MODE=offline` needs no network; `wandb sync` uploads later);
W&B's own files go to `wandb/` in the run directory. Unlike TensorBoard's, W&B's history cannot be cut back
on resume: W&B keeps what the interrupted run logged after its last checkpoint and ignores those steps when
the resumed run logs them again (its steps only increase).
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import yaml

from rollflow.trackers.durable_files import write_atomically

WANDB_ID_FILE = "wandb_id"


class WandbRun:
    """A started W&B run: `log` a step's metrics, `finish` at the end.

    Args:
        run: what `wandb.init` returned.
    """

    def __init__(self, run: Any):
        self.run = run

    @classmethod
    def start(cls, run_dir: Path) -> WandbRun:
        """Start (or resume) the W&B run of the rollflow run in `run_dir`.

        Reads the run's resolved `config.yaml` (written by `prepare_run_dir` before any tracker starts): the
        W&B project is `output.wandb_project`, the W&B run's name is the run's `name`, and the whole file is
        the W&B run's config. The id comes from `run_dir/wandb_id`, written the first time.

        Raises:
            DiskFullError: the disk filled up writing `wandb_id`.
        """
        import wandb

        config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
        return cls(wandb.init(project=config["output"]["wandb_project"], name=config["name"],
                              id=run_id(run_dir), resume="allow", config=config, dir=str(run_dir)))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Log one step's (finite) metrics at W&B step `step`."""
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        self.run.finish()


def run_id(run_dir: Path) -> str:
    """The W&B run id of the rollflow run in `run_dir`: the one in `wandb_id`, or a new one written there.

    A fresh run starts in an empty directory (`prepare_run_dir` moves an earlier run aside), so it gets a new
    id; a resumed run finds its own.
    """
    path = run_dir / WANDB_ID_FILE
    existing = path.read_text(encoding="utf-8").strip() if path.is_file() else ""
    if existing:
        return existing
    new = secrets.token_hex(4)  # 8 lowercase characters, the form of W&B's own ids
    write_atomically(path, new + "\n")
    return new
