"""The env of tests/e2e/test_agentic_failures.py, given by dotted path (`tests.e2e.fragile_envs:make`, which the
env workers of the session's Ray import as the driver does): a game that never ends, or whose every step
raises (`breaks="step"`)."""

from __future__ import annotations

import time


class Env:
    def __init__(self, breaks: str = "nothing"):
        self.breaks = breaks

    def reset(self, seed=None):
        return "pick a number", {}

    def step(self, action):
        if self.breaks == "step":
            raise ValueError("the board is on fire")
        time.sleep(0.05)
        return "go on", 0.0, False, False, {}


def make(**kwargs) -> Env:
    return Env(**kwargs)
