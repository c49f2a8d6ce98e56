"""One RL step for every pipeline that samples: what RLVR and agentic runs share, written once.

`RLStep` (a `rollflow.pipelines.loop.PipelineStep`) holds the rollout core's life (built in `start`, asked for
each step's batch, told of new weights, checkpointed and resumed, closed), the weight versions and their
verified sync, the logprob parity check on the first step a driver runs, and the update's sequence: reference
log-probs, the trainer's own log-probs, values, advantages, the critic's and the actor's updates, then the sync.

A pipeline supplies what differs (`RLVRStep` in rlvr.py, `AgenticStep` in agentic.py): its inputs' check, its
group program (`build_core`), its advantage stage, what it makes of a batch of samples (`checked`: failures,
warnings, metrics), its eval and its console.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rollflow.cluster.colocation import ColocationManager
from rollflow.cluster.groups import WorkerGroups
from rollflow.data.sample import Batch, Sample, collate
from rollflow.pipelines.loop import StepDefaults
from rollflow.pipelines.phases import reference_logprobs, sync_weights
from rollflow.rollout.core import RolloutCore, RolloutResult
from rollflow.rollout.filters import usable
from rollflow.spans import span
from rollflow.workers.parity import check_logprob_parity, parity_probe

# The roles each phase of a step runs (what `ColocationManager` onloads; colocated idle roles are offloaded).
PHASES: dict[str, tuple[str, ...]] = {
    "rollout": ("actor_infer", "reward", "env"),  # model rewards score groups, envs play, while others generate
    "reference": ("reference",),
    "old_logprobs": ("actor_train",),  # the trainer's logprobs; the LoRA reference (actor_train, adapters off)
    "values": ("critic",),
    "critic_train": ("critic",),
    "actor_train": ("actor_train",),
    "weight_sync": ("actor_train", "actor_infer"),  # the trainer exports, the engines load
    "checkpoint": ("actor_train", "critic"),  # saving on interrupt, whatever phase the signal cut short
}


class AdvantageStep(Protocol):
    """An RL pipeline's advantage stage (`AdvantageStage` for RLVR, `EpisodeAdvantages` for agentic runs)."""

    needs_policy_logprobs: bool  # the trainer's logprobs (`old_logprobs`) come first

    def __call__(self, batch: Batch) -> dict[str, float]:
        """Fill `batch.extras["advantages"]` (and `returns` where a critic trains); return its metrics."""
        ...

    def state(self) -> dict | None:
        """What a checkpoint keeps of it (running statistics), or None."""
        ...

    def load_state(self, state: dict | None) -> None: ...


@dataclass
class StepSamples:
    """A step's rollout: the samples it trains on, and those `samples.jsonl` gets."""

    usable: list[Sample]
    logged: list[Sample]


class RLStep(StepDefaults):
    """The shared RL step (the module docstring). Subclasses set `columns` and `plot_keys` and implement
    `roles`, `check_inputs`, `build_core`, `build_advantages`, `checked`, `evaluate` and `pad_token_id`;
    they may override `resume_note`, `logged_samples` and `summary_lines`.

    Attributes:
        core: the rollout core (`start` builds it).
        version: the version of the weights the engines hold.
        advantages: the advantage stage (`build_advantages`, an `AdvantageStep`).
    """

    objective = "policy_gradient"
    phases = PHASES

    def __init__(self, config):
        self.config = config
        self.core: RolloutCore | None = None
        self.version = 0
        self.syncs = 0
        self.parity_due = bool(config.checks.logprob_parity_samples)  # the first step this driver runs
        self.sync_args = (int(config.cluster.weight_sync_bucket_mb * 2**20), config.checks.weight_checksum)

    # ---- what a pipeline supplies ------------------------------------------------------------------------
    @property
    def pad_token_id(self) -> int:
        raise NotImplementedError

    def build_core(self, groups: WorkerGroups) -> RolloutCore:
        """The run's rollout core over `groups` (once the workers are up and checked)."""
        raise NotImplementedError

    def build_advantages(self) -> AdvantageStep:
        """The advantage stage of the run."""
        raise NotImplementedError

    def checked(self, step: int, result: RolloutResult) -> tuple[StepSamples, dict[str, float]]:
        """The core's batch for `step` made into what the step trains on and logs, with its metrics (failures
        raised or warned of as the pipeline says)."""
        raise NotImplementedError

    def resume_note(self, regenerated: int) -> str:
        """The `resumed` line's note: the keys drawn but not trained before the checkpoint, played again."""
        return f" ({regenerated} groups drawn but not trained then are played again)" if regenerated else ""

    # ---- the step --------------------------------------------------------------------------------------
    def start(self, groups: WorkerGroups, colocation: ColocationManager) -> None:
        self.groups, self.colocation = groups, colocation
        self.advantages = self.build_advantages()
        self.core = self.build_core(groups)

    def load(self, checkpoint: Path, state: dict) -> str:
        """The trainer's (and critic's) weights, the core's position and the advantage statistics; then the
        engines get the weights."""
        groups = self.groups
        groups["actor_train"].call("load", str(checkpoint / "model"), state["step"])
        if "critic" in groups:
            groups["critic"].call("load", str(checkpoint / "critic"), state["step"])
        regenerated = self.core.load_state(core_state(state))
        self.advantages.load_state(state.get("advantage_stage"))
        self.version = sync_weights(groups, self.colocation, *self.sync_args)["sync/version"]
        return self.resume_note(regenerated)

    def state(self, step: int, initial_eval: dict) -> dict:
        """The driver's part of a checkpoint after `step`: the step, the core's position (with the keys drawn
        but not trained yet, which a resume plays again) and the advantage statistics."""
        state = {"step": step, "stream": self.core.state(), "initial_eval": initial_eval}
        advantage_state = self.advantages.state()
        if advantage_state is not None:
            state["advantage_stage"] = advantage_state
        return state

    def rollout(self, step: int) -> tuple[StepSamples, dict[str, float]]:
        """The core's batch for `step` (asynchronous: made while the last step trained), checked; on the first
        step this driver runs, the parity check on its samples."""
        self.colocation.enter("rollout")
        with span("rollout"):
            result = self.core.next_batch(step, self.version)
        work, metrics = self.checked(step, result)
        if self.parity_due:
            self.parity_due = False
            metrics.update(self.logprob_parity(work.usable))
        return work, metrics

    def train(self, step: int, work: StepSamples) -> dict[str, float]:
        """Reference and trainer log-probs and values as needed, advantages, the critic and actor updates, the
        weight sync. A step whose samples were all filtered trains nothing."""
        if not work.usable:
            return {}
        config = self.config
        batch = collate(work.usable, self.pad_token_id)
        metrics = self.update(batch, step)
        self.syncs += 1
        corrupt = self.syncs == config.checks.fault_injection_flip_sync_byte_at
        metrics.update(sync_weights(self.groups, self.colocation, *self.sync_args, corrupt))
        self.version = int(metrics["sync/version"])
        self.core.weights_updated()
        return metrics

    def update(self, batch: Batch, step: int) -> dict[str, float]:
        """Reference logprobs and values as needed, advantages, then the critic and actor updates."""
        config, groups, colocation = self.config, self.groups, self.colocation
        actor = groups["actor_train"]
        timings = {}  # the driver's wait for each forward pass before the update (`rollflow diagnose` reads them)
        if config.algorithm.needs_reference:
            started = time.perf_counter()
            with span("reference"):
                batch.extras["ref_logprobs"] = reference_logprobs(batch, groups, colocation,
                                                                  config.roles.reference.backend)
            timings["time/reference"] = time.perf_counter() - started
        old_metrics = {}
        exact = config.algorithm.old_logprobs == "exact"  # each token's under its sampling version's weights
        if exact or self.advantages.needs_policy_logprobs:
            started = time.perf_counter()
            colocation.enter("old_logprobs")
            with span("old_logprobs"):
                if exact:
                    batch.extras["old_logprobs"], old_metrics = actor.call("compute_old_logprobs", batch)
                else:
                    batch.extras["old_logprobs"] = actor.call("compute_logprobs", batch)
            timings["time/old_logprobs"] = time.perf_counter() - started
        if "critic" in groups:
            colocation.enter("values")
            with span("values"):
                batch.extras["values"] = groups["critic"].call("compute_values", batch)
        with span("advantages"):
            metrics = {**self.advantages(batch), **old_metrics, **timings}
        if "critic" in groups:
            colocation.enter("critic_train")
            with span("critic_train"):
                metrics.update(groups["critic"].call("train", batch))
        if step > config.train.critic_warmup_steps:
            colocation.enter("actor_train")
            with span("actor_train"):
                metrics.update(actor.call("train", batch))
        return metrics

    def logged_samples(self, work: StepSamples) -> list[Sample]:
        return work.logged

    def logprob_parity(self, samples: list[Sample]) -> dict[str, float]:
        """The check that the trainer and every engine worker run the same model (`ParityError`), on up to
        `checks.logprob_parity_samples` samples per engine worker."""
        candidates = usable(samples)
        probe = [candidates[i] for i in parity_probe(candidates, self.config.checks.logprob_parity_samples)]
        if not probe:
            return {}
        batch = collate(probe, self.pad_token_id)
        self.colocation.enter("old_logprobs")
        trainer_logprobs = self.groups["actor_train"].call("compute_logprobs", batch)
        return {"check/logprob_max_abs_diff": check_logprob_parity(
            batch, trainer_logprobs, self.config.checks.logprob_parity_tolerance)}

    def close(self) -> None:
        if self.core is not None:
            self.core.close()


def core_state(state: dict) -> dict:
    """The core's part of a driver state: `stream`; agentic checkpoints of older releases kept it as `rollout`,
    and before the rollout core as `{"next_group": N}`."""
    if "stream" in state:
        return state["stream"]
    rollout = state["rollout"]
    if "next_group" not in rollout:
        return rollout
    return {"sampler": {"next": rollout["next_group"]}, "next_index": rollout["next_group"], "pending": []}
