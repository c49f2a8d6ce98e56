"""Warnings a run gives about itself from its own metrics, once each, while it runs.

`NoSignalWatch`: every group of an RL step got equal rewards (`advantage/zero_std_group_frac` 1.0), so every
advantage is 0 and the step learned nothing. One such step is common early on a hard task; several in a row
mean the run is training on nothing (a task the model never solves, a reward that always says the same), and
a user looking at a flat reward curve should not have to find the metric to learn why.
"""

from __future__ import annotations

NO_SIGNAL_KEY = "advantage/zero_std_group_frac"
NO_SIGNAL_STEPS = 3  # steps in a row without a learning signal before the run says so


class NoSignalWatch:
    """Counts the steps in a row whose groups all had equal rewards; says so once, at `NO_SIGNAL_STEPS`.

    Args:
        steps: how many such steps in a row make the warning.
    """

    def __init__(self, steps: int = NO_SIGNAL_STEPS):
        self.steps = steps
        self.run = 0  # such steps in a row, up to now
        self.rewards: list[float] = []  # their mean rewards
        self.warned = False

    def check(self, step: int, metrics: dict[str, float]) -> str | None:
        """The warning, the first time `steps` steps in a row ending at `step` had no learning signal; else None."""
        share = metrics.get(NO_SIGNAL_KEY)
        if share is None or share < 1.0:
            self.run, self.rewards = 0, []
            return None
        self.run += 1
        self.rewards.append(metrics.get("reward/mean", float("nan")))
        if self.warned or self.run < self.steps:
            return None
        self.warned = True
        rewards = ", ".join(f"{value:.3g}" for value in self.rewards[-self.steps:])
        return (f"steps {step - self.steps + 1}-{step}: every group's samples got the same reward "
                f"({NO_SIGNAL_KEY} 1.0; reward/mean {rewards}), so every advantage is 0 and nothing is learned. "
                "The model may never solve these prompts (an easier task, SFT first, or a larger "
                "rollout.group_size), or the reward may score everything alike (`rollflow eval --config` shows "
                "scored samples: docs/rewards.md)")
