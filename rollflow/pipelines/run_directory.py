"""A run's directory (`output.dir/name`): preparing it, where each worker ran, checkpoints' driver state.

Every pipeline writes the same layout: `config.yaml`, `metrics.jsonl`, `samples.jsonl`, `placement.json`,
`tensorboard/`, `curves.png` and `checkpoints/step_N/` (the workers' state + `driver_state.json`).

A directory holds one run: a fresh run never writes into an earlier run's directory (it is moved aside), and a
resumed run continues exactly from its newest complete checkpoint, with the logs cut back to it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from rollflow.cluster.groups import WorkerGroups
from rollflow.config import RunConfigBase, dump_config
from rollflow.engines import check_engine_installed
from rollflow.errors import ConfigError, RollflowError
from rollflow.trackers.durable_files import truncate_records, write_atomically, write_failure_as_error

DRIVER_STATE = "driver_state.json"
STEP_LOGS = ("metrics.jsonl", "samples.jsonl", "eval_samples.jsonl")  # a `step` per record, cut back on resume


class RunFinished(RollflowError):
    """`resume: true` over a run whose newest checkpoint is already at (or past) `train.steps`: nothing to do.
    Raised before Ray starts; the CLI prints the message and exits with status 0."""

    exit_code = 0


class PreparedRunDir(NamedTuple):
    """What `prepare_run_dir` found and did.

    Attributes:
        resume_from: the checkpoint to resume from (`checkpoints/step_N`), or None for a fresh run.
        resumed_at: its step (N), or None.
        note: one line for the console when an earlier run's directory was moved aside, or when a resumed
            run's changed `train.steps` stretches its cosine learning-rate schedule; else None.
    """

    resume_from: Path | None
    resumed_at: int | None
    note: str | None


def resume_point(config: RunConfigBase) -> tuple[Path | None, int | None]:
    """(the newest complete checkpoint, its step) a `resume: true` run continues from; (None, None) for a
    fresh run. Changes nothing: a pipeline asks it first, before Ray and its workers start, so a resume with
    nothing to resume, or a run directory that cannot be written (`check_run_dir_writable`), starts nothing.

    Also refuses an inference engine whose package is not installed (`check_engine_installed`), in one line.

    Raises:
        ConfigError: `resume: true` without a complete checkpoint; a run directory that cannot be written; the
            engine's package missing.
        RunFinished: `resume: true` with the newest checkpoint at or past `train.steps` (nothing to do).
    """
    check_engine_installed(config.roles.actor_infer.engine)
    if not config.resume:
        check_run_dir_writable(config)
        return None, None
    run_dir = config.run_dir
    resume_from = latest_checkpoint(run_dir / "checkpoints")
    if resume_from is None:
        raise ConfigError(f"resume=true but {run_dir} has no complete checkpoint (checkpoints/step_N with "
                          f"{DRIVER_STATE}); set resume=false to start a new run")
    resumed_at = int(read_driver_state(resume_from)["step"])
    if resumed_at >= config.train.steps:
        raise RunFinished(f"{run_dir} already finished at step {resumed_at} (train.steps="
                          f"{config.train.steps}); raise train.steps to continue")
    check_run_dir_writable(config)
    return resume_from, resumed_at


def check_run_dir_writable(config: RunConfigBase) -> None:
    """That the run can create and write `config.run_dir` (`output.dir/name`): the nearest part of that path
    that exists is a directory, and a file can be created in it (and is removed again). Trying is the only
    test that holds for root, for whom `os.access` says yes to a read-only mount. A run directory that exists
    is tested itself, and its parent too when a fresh run will move it aside (`prepare_run_dir`).

    Raises:
        ConfigError: one line naming the path and why (a file in the way, a read-only file system, no
            permission).
    """
    run_dir = config.run_dir
    where = run_dir
    while not os.path.lexists(where) and where != where.parent:
        where = where.parent
    directories = [where]
    if where == run_dir and not config.resume and run_dir.is_dir() and any(run_dir.iterdir()):
        directories.append(run_dir.parent)  # the earlier run is renamed to a sibling
    for directory in directories:
        if not directory.is_dir():
            what = "a file, not a directory" if directory.is_file() else "not a directory"
            raise ConfigError(f"output.dir: cannot create the run directory {run_dir}: {directory} is {what}; "
                              "set output.dir to a directory")
        try:
            fd, probe = tempfile.mkstemp(prefix=".rollflow-write-test-", dir=directory)
            os.close(fd)
            os.unlink(probe)
        except OSError as err:
            raise ConfigError(f"output.dir: cannot write the run directory {run_dir}: {directory} is not writable "
                              f"({err.strerror or err}); set output.dir to a writable directory") from None


def prepare_run_dir(config: RunConfigBase) -> PreparedRunDir:
    """Make `config.run_dir` ready for this run and write the resolved `config.yaml` into it.

    A fresh run (`resume: false`) over an existing, non-empty directory moves that directory aside to the first
    free `<name>.1`, `<name>.2`, ... so two runs never mix. A resumed run continues from the newest complete
    checkpoint; `metrics.jsonl` and `samples.jsonl` lose the records of later steps (they run again) and any
    torn last line, so no step appears twice.

    Raises:
        ConfigError: `resume: true` without a complete checkpoint.
        RunFinished: `resume: true` with the newest checkpoint at or past `train.steps` (nothing to do).
        DiskFullError: the disk filled up writing the directory.
    """
    run_dir = config.run_dir
    resume_from, resumed_at = resume_point(config)
    note = None
    if config.resume:
        note = _schedule_note(run_dir / "config.yaml", config)
        for log in STEP_LOGS:
            truncate_records(run_dir / log, resumed_at)
    elif run_dir.is_dir() and any(run_dir.iterdir()):
        aside = _first_free_sibling(run_dir)
        run_dir.rename(aside)
        note = f"{run_dir} held an earlier run: moved it to {aside} (resume=true continues a run instead)"
    with write_failure_as_error(run_dir):
        run_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(run_dir / "config.yaml", dump_config(config))
    return PreparedRunDir(resume_from, resumed_at, note)


def save_checkpoint(run_dir: Path, groups: WorkerGroups, state: dict) -> Path:
    """`checkpoints/step_N`: model (HF format) + optimizer/RNG from the trainer (and critic), then the
    driver's `state` (written last: it marks the checkpoint complete). Raises DiskFullError on a full disk."""
    path = run_dir / "checkpoints" / f"step_{state['step']}"
    with write_failure_as_error(path):
        path.mkdir(parents=True, exist_ok=True)
        groups["actor_train"].call("save", str(path / "model"))
        if "critic" in groups:
            groups["critic"].call("save", str(path / "critic"))
    write_driver_state(path, state)
    return path


def latest_checkpoint(checkpoints: Path) -> Path | None:
    """The newest `step_N` under `checkpoints` whose driver state was written (so every part of it was)."""
    done = [(step, path) for path in checkpoints.glob("step_*")
            if (step := _checkpoint_step(path)) is not None]
    return max(done, key=lambda item: item[0], default=(None, None))[1]


def write_driver_state(checkpoint: Path, state: dict[str, Any]) -> None:
    """The driver's part of a checkpoint, written last and atomically: its presence marks the checkpoint
    complete.

    Raises:
        DiskFullError: the disk filled up.
    """
    write_atomically(checkpoint / DRIVER_STATE, json.dumps(state))


def read_driver_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / DRIVER_STATE).read_text())


def write_placement(path: Path, groups: WorkerGroups) -> None:
    """Where each worker of each role actually runs (node ids from Ray), next to the plan's devices; a role
    served by another role's workers (a hybrid engine) says which (`"in": "actor_train"`).

    Raises:
        DiskFullError: the disk filled up.
    """
    placement = {role: [{"worker": p.index, "node": node, "devices": list(p.devices),
                         **({"in": group.host} if group.host else {})}
                        for p, node in zip(group.placements, group.nodes())]
                 for role, group in groups.items()}
    write_atomically(path, json.dumps(placement, indent=1))


def _schedule_note(previous_config: Path, config: RunConfigBase) -> str | None:
    """One line when a resumed run changes `train.steps` under a cosine schedule: the trainer continues the
    schedule at its step, stretched to the new total (`rollflow.backends.base.load_scheduler_state`). None
    otherwise, or when the previous run's `config.yaml` cannot be read."""
    train = config.train
    try:
        previous = yaml.safe_load(previous_config.read_text())["train"]["steps"]
    except (OSError, yaml.YAMLError, TypeError, KeyError):
        return None
    if train.lr_schedule != "cosine" or not isinstance(previous, int) or previous == train.steps:
        return None
    return (f"train.steps {previous} -> {train.steps}: the cosine learning-rate schedule is stretched to the new "
            f"total (each step's learning rate is what a run with train.steps={train.steps} has there)")


def _checkpoint_step(path: Path) -> int | None:
    """N of a complete `step_N` checkpoint; None for an unfinished one (no readable driver state)."""
    try:
        step = int(path.name.removeprefix("step_"))
        json.loads((path / DRIVER_STATE).read_text())
    except (ValueError, OSError):  # not a step directory, driver state missing or torn
        return None
    return step


def _first_free_sibling(run_dir: Path) -> Path:
    """`<name>.1`, `<name>.2`, ...: the first that does not exist yet."""
    index = 1
    while os.path.lexists(run_dir.with_name(f"{run_dir.name}.{index}")):
        index += 1
    return run_dir.with_name(f"{run_dir.name}.{index}")
