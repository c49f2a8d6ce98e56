"""An env for tests/envs/test_service.py, served by dotted path (`tests.envs.slow_env:make`): FrozenLake whose
steps can sleep, raise, or hang until `STEP_RELEASE` is set, or that lists tools, or whose reset hangs until
`RESET_RELEASE` is set."""

from __future__ import annotations

import threading
import time
from typing import Any

from rollflow.envs.frozenlake import FrozenLake

TOOLS = [{"type": "function", "function": {"name": "look", "description": "Look around.",
                                           "parameters": {"type": "object", "properties": {}}}}]
RESET_RELEASE = threading.Event()  # a hanging reset returns once this is set (or after HANG_LIMIT_S)
STEP_RELEASE = threading.Event()  # a hanging step goes on once this is set (or after HANG_LIMIT_S)
HANG_LIMIT_S = 60.0


class SlowEnv:
    """FrozenLake, its every step first sleeping `step_sleep_s` (then raising ValueError when `raise_on_step`);
    with `hang_reset`, its reset first waits for `RESET_RELEASE`; with `hang_step`, its every step first waits
    for `STEP_RELEASE` (slower than any limit, whatever the machine's speed)."""

    def __init__(self, step_sleep_s: float = 0.0, raise_on_step: bool = False, with_tools: bool = False,
                 hang_reset: bool = False, hang_step: bool = False, **frozenlake_kwargs: Any):
        self.env = FrozenLake(**frozenlake_kwargs)
        self.step_sleep_s, self.raise_on_step, self.with_tools = step_sleep_s, raise_on_step, with_tools
        self.hang_reset, self.hang_step = hang_reset, hang_step

    def reset(self, seed: int | None = None):
        if self.hang_reset:
            RESET_RELEASE.wait(HANG_LIMIT_S)
        return self.env.reset(seed)

    def step(self, action: str):
        if self.hang_step:
            STEP_RELEASE.wait(HANG_LIMIT_S)
        time.sleep(self.step_sleep_s)
        if self.raise_on_step:
            raise ValueError("the env broke on purpose\nsecond line")
        return self.env.step(action)

    def expert_action(self) -> str:
        return self.env.expert_action()

    def tools(self) -> list[dict[str, Any]]:
        return TOOLS if self.with_tools else []


def make(**kwargs: Any) -> SlowEnv:
    return SlowEnv(**kwargs)
