"""A run's directory (`output.dir/name`): preparing it, where each worker ran, checkpoints' driver state.

Every pipeline writes the same layout: `config.yaml`, `metrics.jsonl`, `samples.jsonl`, `placement.json`,
`tensorboard/`, `curves.png` and `checkpoints/step_N/` (the workers' state + `driver_state.json`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rollflow.cluster.groups import WorkerGroups
from rollflow.config import RunConfigBase, dump_config

DRIVER_STATE = "driver_state.json"


def prepare_run_dir(config: RunConfigBase) -> Path | None:
    """Create the run directory and write the resolved config. A fresh run (no `resume`, or nothing to
    resume) starts new metric and sample logs.

    Returns:
        The checkpoint to resume from: the newest complete `checkpoints/step_N`, or None.
    """
    run_dir = config.run_dir
    resume_from = latest_checkpoint(run_dir / "checkpoints") if config.resume else None
    if not resume_from and run_dir.exists():
        for stale in ("metrics.jsonl", "samples.jsonl"):
            (run_dir / stale).unlink(missing_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(config))
    return resume_from


def latest_checkpoint(checkpoints: Path) -> Path | None:
    """The newest `step_N` under `checkpoints` whose driver state was written (so every part of it was)."""
    done = [p for p in checkpoints.glob("step_*") if (p / DRIVER_STATE).is_file()]
    return max(done, key=lambda p: int(p.name.removeprefix("step_")), default=None)


def write_driver_state(checkpoint: Path, state: dict[str, Any]) -> None:
    """The driver's part of a checkpoint, written last: its presence marks the checkpoint complete."""
    (checkpoint / DRIVER_STATE).write_text(json.dumps(state))


def read_driver_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / DRIVER_STATE).read_text())


def write_placement(path: Path, groups: WorkerGroups) -> None:
    """Where each worker of each role actually runs (node ids from Ray), next to the plan's devices."""
    placement = {role: [{"worker": p.index, "node": node, "devices": list(p.devices)}
                        for p, node in zip(group.placements, group.nodes())]
                 for role, group in groups.items()}
    path.write_text(json.dumps(placement, indent=1))
