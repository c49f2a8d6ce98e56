"""The environment protocol (GEM's convention) and the registry of environments by id.

An environment is text in, text out:

    observation, info = env.reset(seed)
    observation, reward, terminated, truncated, info = env.step(action_text)

`reset(seed)` with the same seed gives the same episode, so every env of a group (one seed, many
trajectories) starts from the same state and their returns are comparable. `step` takes whatever the model
wrote: an action it cannot parse is a turn with a penalty (`info["invalid_action"] = True`), never an
exception. Exceptions and hangs are the env worker's business (`rollflow.workers.env`): they fail the one
trajectory.

Conventional `info` keys (all optional):
    success: bool, the episode reached its goal (read on the last step; `eval/success`).
    invalid_action: bool, this step's action could not be parsed.
    anchor: str, a name of the state the action was taken in, for GiGPO's anchor-state groups; default: the
        observation text.
    tool_calls: int, tool calls made in this step (tool envs).
    outcome: str, on the step that ends the episode, why it ended, in a few words ("fell into a hole",
        "reached the goal", "out of turns: all 8 moves used"); `rollflow env play` prints it.

An env may also have `play_help() -> str`: for a person playing it (`rollflow env play`), a few lines with the
legend of its observation's symbols and the moves it accepts. Every built-in has one.

Envs are made from their ids by `rollflow.envs.make` (`make_env`, `check_env_id`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from rollflow.registry import Registry

StepResult = tuple[str, float, bool, bool, dict[str, Any]]


@runtime_checkable
class Env(Protocol):
    """What the env workers drive. GEM environments satisfy it unchanged."""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode; the same seed gives the same episode. Returns (observation, info)."""
        ...

    def step(self, action: str) -> StepResult:
        """Apply the model's text. Returns (observation, reward, terminated, truncated, info)."""
        ...


class ExpertEnv(Env, Protocol):
    """A built-in env that can also act by itself, so env code is tested without a model."""

    def expert_action(self) -> str:
        """A good action for the current state, as the model should write it (the scripted expert)."""
        ...

    def random_action(self, rng: random.Random) -> str:
        """A uniformly random valid action, as text."""
        ...


# Built-in envs: name -> factory(**env_kwargs) -> Env. Built-ins register themselves on import.
ENVS: Registry[Callable[..., Env]] = Registry("environment")
