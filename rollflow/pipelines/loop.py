"""The driver frame: the beats every pipeline shares, written once. A pipeline is a step object.

`run_pipeline(step, manage_ray)` runs, in order: the resume point; the roles' launch (Ray and the workers start
while the step checks its inputs); the run directory; the timeline, the stop signals and the tracker; the
placement (printed and written to `placement.json`); colocation; the initial eval (or the resume); then each
step: the step's rollout (interruptible: nothing of the step is kept yet), then in one critical section its
training, the eval on `eval.every_steps` and at the last step, the log (`metrics.jsonl`, `samples.jsonl`) and
the checkpoint on `output.save_every_steps` and at the last step. A stop signal saves the last finished step
(`output.save_on_interrupt`); the run ends with the final metrics (the first eval's under `initial_`), the
summary lines and the curves.

What a pipeline says is its `PipelineStep` (rlvr.py, agentic.py, supervised.py): no branch here names one.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rollflow.cluster.colocation import ColocationManager
from rollflow.cluster.groups import WorkerGroups
from rollflow.cluster.runtime import pinned_threads
from rollflow.errors import DiskFullError, RunDirUnwritableError
from rollflow.pipelines.interrupts import StopSignals
from rollflow.pipelines.run_directory import (
    PreparedRunDir,
    prepare_run_dir,
    read_driver_state,
    resume_point,
    save_checkpoint,
    write_placement,
)
from rollflow.pipelines.run_health import NoSignalWatch
from rollflow.spans import record, span
from rollflow.trackers import MetricsTracker
from rollflow.trackers.plots import plot_curves
from rollflow.trackers.samples import write_samples
from rollflow.trackers.timeline import STEP_SPAN, timeline_written
from rollflow.trackers.trackers import Column
from rollflow.workers.roles import RoleLaunch
from rollflow.workers.specs import worker_specs


class PipelineStep(Protocol):
    """What a pipeline says; the frame (`run_pipeline`) does the rest. Called in this order: `roles`,
    `launches_before_inputs`, `check_inputs`, `start_lines`, `start`, `load` or `evaluate(0)`,
    `state`, then per step `rollout`, `train`, `position`, `evaluate` and `stop_reason` (eval steps),
    `logged_samples`, `state`; at the end `after_run`, `summary_lines`, and `close` (always, once `start` ran).
    The optional hooks (`launches_before_inputs`, `start_lines`, `position`, `stop_reason`,
    `logged_samples`, `after_run`, `summary_lines`, `close`) have defaults in `StepDefaults`.

    Attributes:
        config: the run config; `check_inputs` may replace it (supervised `train.epochs` becomes steps).
        objective: what actor_train minimizes (a `rollflow.workers.objectives.OBJECTIVES` name), in its
            worker's spec (`rollflow.workers.specs`).
        phases: the roles each phase runs (`ColocationManager`); a `checkpoint` phase for the interrupt save.
        columns: what the console's step line shows.
        plot_keys: the metrics `curves.png` draws.
    """

    config: Any
    objective: str
    phases: dict[str, tuple[str, ...]]
    columns: tuple[Column, ...]
    plot_keys: tuple[str, ...]

    def roles(self) -> list[str]:
        """The roles the run starts, in start order."""

    def launches_before_inputs(self) -> bool:
        """Whether the workers start while `check_inputs` runs (False when their config waits on the data)."""

    def check_inputs(self, roles: list[str]) -> list[str]:
        """Check and encode the inputs while the workers start. Returns the warnings to print."""

    def start_lines(self) -> list[str]:
        """Lines printed under the placement (supervised: the data line)."""

    def start(self, groups: WorkerGroups, colocation: ColocationManager) -> None:
        """Build what needs the workers (the rollout, the advantage stage, ...); checks that need them too."""

    def load(self, checkpoint: Path, state: dict) -> str:
        """Resume from `checkpoint` whose driver state is `state`. Returns a note for the `resumed` line."""

    def evaluate(self, step: int) -> dict[str, float]:
        """The eval after `step` (0: before training): `eval/` metrics."""

    def state(self, step: int, initial_eval: dict) -> dict:
        """The driver state a checkpoint after `step` keeps (`driver_state.json`), `step` and `initial_eval`
        included."""

    def rollout(self, step: int) -> tuple[Any, dict[str, float]]:
        """What `step` trains on, made outside the critical section: (the step's work, its metrics so far)."""

    def train(self, step: int, work: Any) -> dict[str, float]:
        """Train on `work` (and sync the engines): the step's update, inside the critical section."""

    def position(self, step: int) -> dict[str, float]:
        """Where the run is in its data after `step`, logged with the step (supervised: `epoch`)."""

    def stop_reason(self, metrics: dict[str, float]) -> str:
        """Why the run ends after this eval step's `metrics` ("" to go on)."""

    def logged_samples(self, work: Any) -> list | None:
        """The step's samples for `samples.jsonl`; None writes no file."""

    def after_run(self, progress: Progress) -> dict[str, float]:
        """Metrics added to the final ones once the last step is done (supervised: the best checkpoint's)."""

    def summary_lines(self, final: dict[str, float], progress: Progress) -> list[str]:
        """The run's closing lines."""

    def close(self) -> None:
        """Stop what `start` built (the rollout's threads)."""


class StepDefaults:
    """The optional hooks of `PipelineStep`, with what a step that does not need them wants: workers started while the inputs are checked, no start lines, no data position, never an early
    stop, no samples logged, nothing after the run, no summary lines, nothing to close. A step class inherits
    these and writes only the hooks it needs."""

    def launches_before_inputs(self) -> bool:
        return True

    def start_lines(self) -> list[str]:
        return []

    def position(self, step: int) -> dict[str, float]:
        return {}

    def stop_reason(self, metrics: dict[str, float]) -> str:
        return ""

    def logged_samples(self, work: Any) -> list | None:
        return None

    def after_run(self, progress: Progress) -> dict[str, float]:
        return {}

    def summary_lines(self, final: dict[str, float], progress: Progress) -> list[str]:
        return []

    def close(self) -> None:
        return None


@dataclass
class Progress:
    """Where a run stands.

    Attributes:
        first_step: the step the run started after (0, or the checkpoint's).
        initial_eval: the first eval's metrics (a resumed run's come from its checkpoint).
        finished: the driver state after the last step done in full (`PipelineStep.state`).
        saved_step: the last step checkpointed.
        metrics: the last step's metrics.
        stopped: why the run ended early ("" when it did not).
    """

    first_step: int
    initial_eval: dict[str, float]
    finished: dict
    saved_step: int
    metrics: dict[str, float] = field(default_factory=dict)
    stopped: str = ""

    @property
    def finished_step(self) -> int:
        return self.finished["step"]


@dataclass
class Driver:
    """What the beats share once the workers are up."""

    config: Any
    groups: WorkerGroups
    colocation: ColocationManager
    tracker: MetricsTracker
    stop: StopSignals
    no_signal: NoSignalWatch = field(default_factory=NoSignalWatch)


def launch_roles(step: PipelineStep, roles: list[str], manage_ray: bool) -> RoleLaunch:
    """Start `step`'s roles (`RoleLaunch`), each worker given its spec from the step's config now."""
    return RoleLaunch(step.config, roles, worker_specs(step.config, roles, step.objective), manage_ray)


@pinned_threads(1)  # the driver only routes and scores; workers do the heavy lifting
def run_pipeline(step: PipelineStep, manage_ray: bool = True) -> dict[str, float]:
    """Run a pipeline's step object through the frame (the module's docstring). Returns the final metrics.

    Args:
        step: the pipeline's step object, holding the run config.
        manage_ray: start Ray (per `config.cluster`) and shut it down at the end. False runs in the caller's
            Ray session and leaves it up (tests run many short runs in one session).
    """
    began = time.time()
    resume_point(step.config)  # a resume with nothing to resume fails before anything starts
    roles = step.roles()
    launch = launch_roles(step, roles, manage_ray) if step.launches_before_inputs() else None
    with launch.cancelled_on_error() if launch else contextlib.nullcontext():  # a bad input stops the start
        with span("check inputs"):
            warnings = step.check_inputs(roles)
        for warning in warnings:
            print(f"rollflow: warning: {warning}", file=sys.stderr)
        prepared = prepare_run_dir(step.config)
    config = step.config
    launch = launch or launch_roles(step, roles, manage_ray)
    try:
        with timeline_written(config.run_dir, began) as worker_spans, StopSignals() as stop, \
                launch.running(worker_spans.take_from) as groups:
            final = run_with_workers(step, groups, stop, prepared)
    except KeyboardInterrupt:  # an interrupted run draws what it logged too (not where the disk refuses)
        with contextlib.suppress(OSError, DiskFullError, RunDirUnwritableError):  # the interrupt is what is said
            plot_curves(config.run_dir, step.plot_keys)
        raise
    # drawn once the workers stopped: drawing adds nothing to the run's peak memory
    plot_curves(config.run_dir, step.plot_keys)
    return final


def run_with_workers(step: PipelineStep, groups: WorkerGroups, stop: StopSignals,
                     prepared: PreparedRunDir) -> dict[str, float]:
    """The run once the workers are up: the start lines, the first eval or the resume, the steps, the summary."""
    config = step.config
    tracker = MetricsTracker(config.run_dir, config.output.trackers, config.train.steps, prepared.resumed_at,
                             columns=step.columns)
    if prepared.note:
        tracker.print(prepared.note)
    tracker.print(groups.plan.describe())
    for line in step.start_lines():
        tracker.print(line)
    write_placement(config.run_dir / "placement.json", groups)
    # asynchronous: the rollout runs through every phase, its roles are never offloaded
    asynchronous = bool(getattr(getattr(config, "rollout", None), "max_staleness", 0))
    pinned = frozenset(step.phases.get("rollout", ()) if asynchronous else ())
    colocation = ColocationManager(groups.plan, dict(groups), step.phases, pinned=pinned)
    driver = Driver(config, groups, colocation, tracker, stop)
    try:
        step.start(groups, driver.colocation)
        progress = begin(step, driver, prepared.resume_from)
        try:
            for number in range(progress.first_step + 1, config.train.steps + 1):
                if run_step(step, driver, progress, number):
                    break
        except KeyboardInterrupt:  # a stop signal: `Interrupted`, or what ray.get makes of it
            save_on_interrupt(driver, progress)
            raise
        # before `close`: the final evals (the best checkpoint's) still use what `start` built
        final = {**{f"initial_{k}": v for k, v in progress.initial_eval.items()}, **progress.metrics}
        final.update(step.after_run(progress))
    finally:
        step.close()
    if progress.stopped and progress.finished_step < config.train.steps:
        tracker.print(f"stopped after step {progress.finished_step} of {config.train.steps}: {progress.stopped}")
    for line in step.summary_lines(final, progress):
        tracker.print(line)
    tracker.close()
    return final


def begin(step: PipelineStep, driver: Driver, resume_from: Path | None) -> Progress:
    """Load the checkpoint to resume from, or run the initial eval (logged as step 0)."""
    if resume_from:
        state = read_driver_state(resume_from)
        first_step, initial_eval = state["step"], state.get("initial_eval", {})
        note = step.load(resume_from, state)
        driver.tracker.print(f"resumed from {resume_from} at step {first_step}{note}")
    else:
        first_step, initial_eval = 0, step.evaluate(0)
        driver.tracker.log(0, initial_eval)  # the console's step-0 line shows it
    return Progress(first_step, initial_eval, step.state(first_step, initial_eval), saved_step=first_step)


def run_step(step: PipelineStep, driver: Driver, progress: Progress, number: int) -> bool:
    """One step: rollout, then train, eval, log and checkpoint in a section a stop signal waits for. Returns
    whether it was the run's last (the last step, or one whose eval stopped the run)."""
    config, tracker = driver.config, driver.tracker
    started, step_began = time.perf_counter(), time.time()
    work, metrics = step.rollout(number)
    with driver.stop.critical():  # a stop signal waits until this step is trained, synced, logged and saved
        metrics.update(step.train(number, work))
        metrics.update(driver.colocation.pop_metrics())
        metrics.update(step.position(number))
        last = number == config.train.steps
        if last or config.eval.every_steps and number % config.eval.every_steps == 0:
            metrics.update(step.evaluate(number))
            progress.stopped = step.stop_reason(metrics)
            last = last or bool(progress.stopped)
        metrics["time/step"] = time.perf_counter() - started
        with span("log"):
            tracker.log(number, metrics)
            warning = driver.no_signal.check(number, metrics)
            if warning:
                print(f"rollflow: warning: {warning}", file=sys.stderr, flush=True)
            samples = step.logged_samples(work)
            if samples is not None:
                write_samples(config.run_dir / "samples.jsonl", number, samples, len(samples))
        progress.metrics, progress.finished = metrics, step.state(number, progress.initial_eval)
        save_every = config.output.save_every_steps
        if last or save_every and number % save_every == 0:
            with span("checkpoint"):
                save_checkpoint(config.run_dir, driver.groups, progress.finished)
            progress.saved_step = number
        record(STEP_SPAN, step_began, time.time(), step=number)
    return last


def save_on_interrupt(driver: Driver, progress: Progress) -> None:
    """After a stop signal: checkpoint the last finished step unless it is saved (`output.save_on_interrupt`),
    say how to continue, close the tracker."""
    config, tracker, finished = driver.config, driver.tracker, progress.finished_step
    if config.output.save_on_interrupt and finished > progress.saved_step:
        tracker.print(f"interrupted: saving step {finished} (interrupt again to skip it)")
        driver.colocation.enter("checkpoint")  # an interrupted rollout may have left the trainer offloaded
        save_checkpoint(config.run_dir, driver.groups, progress.finished)
    tracker.print(f"interrupted after step {finished}: resume=true continues from the newest checkpoint")
    tracker.close()
