"""Envs from other packages: GEM (`gem:<id>`, returned as is) and gymnasium (`gym:<id>`, wrapped into text).

Both packages are imported only when such an env is made.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from rollflow.envs.actions import parse_first_integer, parse_name
from rollflow.envs.base import Env, StepResult
from rollflow.errors import ConfigError

_ANSI_HIGHLIGHT = re.compile(r"\x1b\[4[0-7]m(.*?)\x1b\[0m")  # a background colour marks the agent's cell
_ANSI_CODE = re.compile(r"\x1b\[[0-9;]*m")


def make_gem_env(gem_id: str, **kwargs: Any) -> Env:
    """A GEM environment, unchanged (GEM envs already follow the protocol).

    Args:
        gem_id: a GEM id, e.g. "game:GuessTheNumber-v0-easy".
        **kwargs: passed to `gem.make`.

    Returns:
        The env.

    Raises:
        ConfigError: gem-llm is not installed, or the id is unknown (the message names close ids).
    """
    try:
        import gem
        from gem.envs.registration import ENV_REGISTRY
    except ImportError:
        raise ConfigError(f"env 'gem:{gem_id}': the gem-llm package is not installed (pip install gem-llm)") from None
    if gem_id not in ENV_REGISTRY:
        raise ConfigError(f"env 'gem:{gem_id}': unknown GEM id.{_close_ids(gem_id, ENV_REGISTRY)}")
    env = gem.make(gem_id, **kwargs)
    if not isinstance(env, Env):
        raise ConfigError(f"env 'gem:{gem_id}': {type(env).__name__} lacks reset(seed) / step(action)")
    return env


def make_gym_env(
    gym_id: str,
    action_names: list[str] | None = None,
    invalid_penalty: float = 0.0,
    max_turns: int | None = None,
    **kwargs: Any,
) -> GymTextEnv:
    """A gymnasium env with a `Discrete` action space, wrapped into text (see `GymTextEnv`).

    Args:
        gym_id: a gymnasium id, e.g. "FrozenLake-v1".
        action_names: names of the actions in order (e.g. ["left", "down", "right", "up"]); the model may
            write a name or the action's integer.
        invalid_penalty: the reward of a step whose action cannot be parsed.
        max_turns: truncate after this many steps, invalid ones included (gymnasium's own time limit, which
            counts only valid steps, applies too).
        **kwargs: passed to `gymnasium.make`.

    Returns:
        The wrapped env.

    Raises:
        ConfigError: gymnasium is not installed, the id is unknown, or the action space is not `Discrete`.
    """
    try:
        import gymnasium
    except ImportError:
        raise ConfigError(f"env 'gym:{gym_id}': the gymnasium package is not installed (pip install gymnasium)") from None
    if gym_id not in gymnasium.registry:
        raise ConfigError(f"env 'gym:{gym_id}': unknown gymnasium id.{_close_ids(gym_id, gymnasium.registry)}")
    env = gymnasium.make(gym_id, **kwargs)
    if "render_mode" not in kwargs and "ansi" in env.metadata.get("render_modes", []):
        env.close()
        env = gymnasium.make(gym_id, render_mode="ansi", **kwargs)
    if not isinstance(env.action_space, gymnasium.spaces.Discrete):
        env.close()
        raise ConfigError(f"env 'gym:{gym_id}': only Discrete action spaces are supported, not {env.action_space}")
    if action_names is not None and len(action_names) != env.action_space.n:
        env.close()
        raise ConfigError(f"env 'gym:{gym_id}': {len(action_names)} action_names for {env.action_space.n} actions")
    return GymTextEnv(env, action_names, invalid_penalty, max_turns)


class GymTextEnv:
    """A gymnasium env behind the text protocol.

    Observations are the env's ANSI text rendering when it has one (escape codes removed; a highlighted
    cell, the agent's, is shown in brackets: `[S]FFF`), else `str(observation)`. `info["anchor"]` is
    `str(observation)`, the env's own state id. An action is the first action name the text contains (with
    `action_names`), else its first integer; anything else, or an integer outside the action space, is an
    invalid turn: `invalid_penalty`, `info["invalid_action"] = True`, the state and observation unchanged.

    Args:
        env: the gymnasium env (its action space `Discrete`).
        action_names: action names in order, or None.
        invalid_penalty: the reward of an invalid turn.
        max_turns: truncate after this many steps (invalid ones included), or None.
    """

    def __init__(self, env: Any, action_names: list[str] | None, invalid_penalty: float, max_turns: int | None):
        self.env = env
        self.action_names = action_names
        self.invalid_penalty = invalid_penalty
        self.max_turns = max_turns
        self.turns = 0
        self._observation = ""
        self._anchor = ""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """Reset the wrapped env.

        Args:
            seed: passed to the wrapped env's `reset(seed=...)`.

        Returns:
            (observation, info).
        """
        observation, info = self.env.reset(seed=seed)
        self.turns = 0
        self._set_observation(observation)
        return self._observation, {**info, "anchor": self._anchor}

    def step(self, action: str) -> StepResult:
        """Parse the model's text into an action and step the wrapped env.

        Args:
            action: what the model wrote.

        Returns:
            (observation, reward, terminated, truncated, info).
        """
        self.turns += 1
        index = self.parse_action(action)
        turns_up = self.max_turns is not None and self.turns >= self.max_turns
        if index is None:
            info = {"invalid_action": True, "anchor": self._anchor}
            return self._observation, self.invalid_penalty, False, turns_up, info
        observation, reward, terminated, truncated, info = self.env.step(index)
        self._set_observation(observation)
        info = {**info, "invalid_action": False, "anchor": self._anchor}
        return self._observation, float(reward), bool(terminated), bool(truncated) or turns_up, info

    def parse_action(self, text: str) -> int | None:
        """The action the text names.

        Args:
            text: what the model wrote.

        Returns:
            The action (an element of the `Discrete` space), or None.
        """
        space = self.env.action_space
        if self.action_names is not None:
            named = parse_name(text, self.action_names)
            if named is not None:
                return int(space.start) + named
        number = parse_first_integer(text)
        return number if number is not None and space.start <= number < space.start + space.n else None

    def _set_observation(self, observation: Any) -> None:
        self._anchor = str(observation)
        rendering = self.env.render() if self.env.render_mode == "ansi" else None
        if isinstance(rendering, str):
            text = _ANSI_CODE.sub("", _ANSI_HIGHLIGHT.sub(r"[\1]", rendering))
            self._observation = "\n".join(line for line in text.splitlines() if line.strip())
        else:
            self._observation = self._anchor

    def close(self) -> None:
        """Close the wrapped env."""
        self.env.close()


def _close_ids(name: str, ids: Any) -> str:
    near = difflib.get_close_matches(name, list(ids), n=3, cutoff=0.5)
    return f" Close ids: {', '.join(near)}" if near else " (no close id)"
