"""The rollout core's settings (`CoreSettings`): the policy's knobs, read from a run's config in one place for
every pipeline that samples (`core_settings`)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CoreSettings:
    """The policy's knobs (from `rollout.*`)."""

    groups_per_step: int
    max_staleness: int = 0
    max_refill_groups: int = 0
    overprovision: float = 1.0
    long_round_every: int = 0
    partial_rollout: str = "continue"  # or "resubmit"
    staleness_control: str = "admission"  # or "drop"
    deterministic: bool = False  # seeds per group; rounds when synchronous and not over-provisioned
    lockstep: bool = False  # every step a round, whatever the rest (the batch-of-envs baseline)
    seed: int = 0
    max_in_flight: int = 64
    watchdog_s: float = 900.0

    @property
    def launched_per_step(self) -> int:
        return math.ceil(self.overprovision * self.groups_per_step - 1e-9)

    @property
    def tail_batching(self) -> bool:
        """Over-provisioned synchronous steps: cut the slowest groups and run them in long rounds."""
        return self.overprovision > 1 and self.max_staleness == 0

    @property
    def in_draw_order(self) -> bool:
        """Asynchronous steps take their groups in the order they were drawn (staleness bounded at admission)."""
        return self.max_staleness > 0 and self.staleness_control == "admission"

    @property
    def rounds(self) -> bool:
        return self.lockstep or (self.deterministic and self.max_staleness == 0 and self.overprovision == 1)


def core_settings(config, eval_only: bool = False) -> CoreSettings:
    """The core's settings for a run, the one place they are read from its config: `rollout.*` (the same keys
    in every pipeline that samples), `seed`, `roles.actor_infer.max_in_flight_requests` and
    `cluster.watchdog_s`. An eval-only core (`eval_only`, or a run without a `rollout` section: supervised runs'
    greedy eval) plays one group a step, deterministic unless `rollout.deterministic` says otherwise."""
    common = dict(seed=config.seed, max_in_flight=config.roles.actor_infer.max_in_flight_requests,
                  watchdog_s=config.cluster.watchdog_s)
    rollout = getattr(config, "rollout", None)
    if rollout is None or eval_only:
        return CoreSettings(groups_per_step=1, deterministic=rollout is None or rollout.deterministic, **common)
    return CoreSettings(
        rollout.groups_per_step,
        # no sample can be more versions old than the run has steps: a larger bound only draws keys past the end
        max_staleness=min(rollout.max_staleness, config.train.steps),
        max_refill_groups=rollout.refill_bound, overprovision=rollout.overprovision,
        long_round_every=rollout.long_round_every, partial_rollout=rollout.partial_rollout,
        staleness_control=rollout.staleness_control, deterministic=rollout.deterministic,
        lockstep=getattr(rollout, "lockstep", False), **common)
