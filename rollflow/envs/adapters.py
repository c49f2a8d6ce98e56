"""Envs from other packages behind rollflow's text protocol: GEM (`gem:<id>`, see `GemTextEnv`) and
gymnasium (`gym:<id>`, see `GymTextEnv`).

Both packages are imported only when such an env is made.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import random
import re
import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from rollflow.envs.actions import parse_first_integer, parse_name
from rollflow.envs.base import Env, StepResult
from rollflow.errors import ConfigError
from rollflow.registry import Registry

_ANSI_HIGHLIGHT = re.compile(r"\x1b\[4[0-7]m(.*?)\x1b\[0m")  # a background colour marks the agent's cell
_ANSI_CODE = re.compile(r"\x1b\[[0-9;]*m")
# GEM's games draw from the process-wide `random` and `numpy.random` (their reset(seed) seeds those); an env
# worker plays many envs on threads of one process, so each GEM env's calls run with its own saved states swapped
# in, one env at a time (`GemTextEnv._own_random`).
_GLOBAL_RANDOM = threading.Lock()

# --- GEM -------------------------------------------------------------------------------------------------

# (the episode's observations so far, the actions between them, this step's info) -> what the model reads.
GemObservation = Callable[[list[str], list[str], dict[str, Any]], str]
GEM_OBSERVATIONS: Registry[GemObservation] = Registry("GEM observation mode")

# GEM's dense rewards add up to 1 only up to rounding: a solved Crosswords returns 0.9999999999999999.
SUCCESS_TOLERANCE = 1e-6
_ADAPTER_KWARGS = ("observation", "success_threshold")


@GEM_OBSERVATIONS.register("last")
def last_observation(observations: list[str], actions: list[str], info: dict[str, Any]) -> str:
    """`info["prefix"]`, this step's observation, `info["suffix"]` (where GEM's games put the board): the
    newest event and the current state, for `rollout.samples: trajectory`, whose context holds the earlier
    turns already."""
    return _framed(info, _line(observations[-1]))


@GEM_OBSERVATIONS.register("concat")
def concat_observations(observations: list[str], actions: list[str], info: dict[str, Any]) -> str:
    """GEM's `concat` wrapper (its choice for games): the prefix, every observation of the episode so far
    (the instructions first), the suffix. Each turn reads alone, as in `rollout.samples: step`."""
    return _framed(info, "".join(_line(text) for text in observations))


@GEM_OBSERVATIONS.register("concat_with_action")
def concat_observations_and_actions(observations: list[str], actions: list[str], info: dict[str, Any]) -> str:
    """GEM's `concat_with_action` wrapper: as `concat`, with each action after the observation it answered."""
    history = "".join(_line(text) for pair in zip(observations, actions) for text in pair)
    return _framed(info, history + _line(observations[-1]))


@GEM_OBSERVATIONS.register("raw")
def raw_observation(observations: list[str], actions: list[str], info: dict[str, Any]) -> str:
    """The env's observation alone (GEM without a wrapper): a game's board, in the suffix, is not shown."""
    return observations[-1]


def _line(text: str) -> str:
    """The text ending in a newline (GEM's `maybe_add_new_line`)."""
    return text + "\n" if text and not text.endswith("\n") else text


def _framed(info: dict[str, Any], body: str) -> str:
    return info.get("prefix", "") + body + info.get("suffix", "")


def make_gem_env(gem_id: str, observation: str = "last", success_threshold: float = 1.0, **kwargs: Any) -> GemTextEnv:
    """A GEM environment behind rollflow's protocol (see `GemTextEnv`).

    Args:
        gem_id: a GEM id, e.g. "game:GuessTheNumber-v0-easy".
        observation: how the model's observation is built, a name in `GEM_OBSERVATIONS` ("last", "concat",
            "concat_with_action", "raw").
        success_threshold: an episode that ends with a return (the sum of its rewards) at least this is a
            success.
        **kwargs: passed to `gem.make` (the env's constructor).

    Returns:
        The wrapped env.

    Raises:
        ConfigError: gem-llm is not installed, the id is unknown (the message names close ids), the observation
            mode is unknown (the message lists the valid ones), the env's module does not import, or the env
            does not take a keyword argument.
    """
    try:
        import gem
        from gem.envs.registration import ENV_REGISTRY
    except ImportError:
        raise ConfigError(f"env 'gem:{gem_id}': the gem-llm package is not installed (pip install gem-llm)") from None
    if gem_id not in ENV_REGISTRY:
        raise ConfigError(f"env 'gem:{gem_id}': unknown GEM id.{_close_ids(gem_id, ENV_REGISTRY)}")
    if observation not in GEM_OBSERVATIONS:
        chat = " (GEM's chat modes apply a tokenizer's chat template; rollflow applies it itself)" \
            if observation.startswith("concat_chat") else ""
        raise ConfigError(f"env 'gem:{gem_id}': {GEM_OBSERVATIONS.unknown_message(observation)}{chat}")
    _check_gem_kwargs(gem_id, ENV_REGISTRY[gem_id].entry_point, kwargs)
    try:
        env = gem.make(gem_id, **kwargs)
    except TypeError as err:  # a keyword argument of the wrong type
        raise ConfigError(f"env 'gem:{gem_id}': {_first_line(err)}") from None
    if not isinstance(env, Env):
        raise ConfigError(f"env 'gem:{gem_id}': {type(env).__name__} lacks reset(seed) / step(action)")
    return GemTextEnv(env, GEM_OBSERVATIONS.get(observation), success_threshold, f"gem:{gem_id}")


def _check_gem_kwargs(gem_id: str, entry_point: Any, kwargs: dict[str, Any]) -> None:
    """Fail on a keyword argument the env does not take: GEM's envs end their signature with `**_`, which
    drops an unknown (say, misspelt) name silently. An env that reads `**kwargs` itself is not checked."""
    if isinstance(entry_point, str):
        module_name, _, attribute = entry_point.partition(":")
        try:
            entry_point = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as err:
            raise ConfigError(f"env 'gem:{gem_id}': cannot import {module_name}:{attribute} "
                              f"({_first_line(err)})") from None
    try:
        parameters = list(inspect.signature(entry_point).parameters.values())
    except (TypeError, ValueError):  # no signature to check against
        return
    if any(p.kind is p.VAR_KEYWORD and p.name != "_" for p in parameters):
        return
    taken = sorted(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    unknown = [name for name in kwargs if name not in taken]
    if unknown:
        near = difflib.get_close_matches(unknown[0], [*taken, *_ADAPTER_KWARGS], n=1)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise ConfigError(f"env 'gem:{gem_id}' has no keyword argument {unknown[0]!r}.{hint} It takes: "
                          f"{', '.join(taken)}; the adapter: {', '.join(_ADAPTER_KWARGS)}")


def _numpy_random():
    """`numpy.random` (GEM requires numpy; imported when a GEM env is made, as gem is)."""
    import numpy

    return numpy.random


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


class GemTextEnv:
    """A GEM env behind rollflow's protocol.

    Observation: `observation_mode` of the episode's observations, actions and the step's `info["prefix"]`
    and `info["suffix"]`; GEM's games return the board there, not in the observation.

    `info["success"]`: the episode ended (terminated or truncated) with a return of at least
    `success_threshold`. GEM's games pay a solved game a total of 1 (`LanguageGameReward.success_reward`), at
    the last step (GuessTheNumber, TowerofHanoi, Sokoban, FifteenPuzzle) or spread over the steps as progress
    (Sudoku, Minesweeper, Mastermind, Wordle, Hangman, Game2048, Crosswords, WordSearch: the last step's
    reward can be 1/9), and less otherwise: partial credit when the turns run out, -0.1 for a format error.
    GEM's one-turn envs (math, code, qa, reasoning gym) pay 1 for a correct answer. An `info["success"]` the
    env sets itself is kept.

    Randomness: GEM's games draw from the global `random` and `numpy.random` (Minesweeper places its mines at
    the first reveal, Game2048 spawns tiles every move). Each adapter keeps its own copies of both states and
    swaps them in around every call of the game, under a lock: envs of one seed played side by side on threads
    of one env worker play the same game, as a group's comparison needs.

    `info["invalid_action"]`: the step's reward is GEM's format-error reward
    (`LanguageGameReward.format_error_reward`, -0.1), which GEM's games and code envs give, ending the
    episode, exactly when they cannot parse the action. A parsed but illegal move (a full tower, a guess
    out of range) is rewarded like a legal one (0): GEM gives no signal to flag it by.

    Args:
        env: the GEM env.
        observation_mode: (observations, actions, info) -> the model's observation (`GEM_OBSERVATIONS`).
        success_threshold: the return at or above which an ended episode is a success.
        name: the env's id, for error messages.
    """

    def __init__(self, env: Any, observation_mode: GemObservation, success_threshold: float, name: str):
        from gem.utils.constants import LanguageGameReward

        self.env = env
        self.observation_mode = observation_mode
        self.success_threshold = success_threshold
        self.name = name
        self.format_error_reward = LanguageGameReward.format_error_reward
        self.observations: list[str] = []
        self.actions: list[str] = []
        self.episode_return = 0.0
        self._random_states = (random.getstate(), _numpy_random().get_state())

    @contextmanager
    def _own_random(self):
        """This env's `random` / `numpy.random` states in the global generators for the block (see the class
        docstring); the process's own states are put back after."""
        numpy_random = _numpy_random()
        with _GLOBAL_RANDOM:
            saved = random.getstate(), numpy_random.get_state()
            random.setstate(self._random_states[0])
            numpy_random.set_state(self._random_states[1])
            try:
                yield
            finally:
                self._random_states = (random.getstate(), numpy_random.get_state())
                random.setstate(saved[0])
                numpy_random.set_state(saved[1])

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """Reset the wrapped env.

        Args:
            seed: passed to the wrapped env's `reset(seed=...)`.

        Returns:
            (observation, info).
        """
        with self._own_random():
            observation, info = self.env.reset(seed=seed)
        self.observations, self.actions, self.episode_return = [observation], [], 0.0
        return self.observation_mode(self.observations, self.actions, info), info

    def step(self, action: str) -> StepResult:
        """Step the wrapped env; add `success` and `invalid_action` to its info.

        Args:
            action: what the model wrote.

        Returns:
            (observation, reward, terminated, truncated, info).
        """
        with self._own_random():
            observation, reward, terminated, truncated, info = self.env.step(action)
        reward, terminated, truncated = float(reward), bool(terminated), bool(truncated)
        self.observations.append(observation)
        self.actions.append(info.get("parsed_action", action))  # what GEM's wrappers show of an action
        self.episode_return += reward
        success = (terminated or truncated) and self.episode_return >= self.success_threshold - SUCCESS_TOLERANCE
        info = {"success": success, "invalid_action": reward == self.format_error_reward, **info}
        return self.observation_mode(self.observations, self.actions, info), reward, terminated, truncated, info

    def random_action(self, rng: random.Random) -> str:
        """GEM's random action (`sample_random_action`), drawn from `rng`.

        GEM draws from the global `random` module, which its games' dynamics draw from too; so, with the process's
        state saved, it is seeded from `rng` for the draw and put back after: the action is reproducible from
        `rng`, and the game's own draws are unchanged.

        Args:
            rng: the random source.

        Returns:
            The action text.

        Raises:
            ConfigError: the env has no random action (GEM's TowerofHanoi).
        """
        with _GLOBAL_RANDOM:
            state = random.getstate()
            random.seed(rng.getrandbits(64))
            try:
                return self.env.sample_random_action()
            except NotImplementedError:
                raise ConfigError(f"env '{self.name}' has no random action (GEM's sample_random_action is not "
                                  "implemented)") from None
            finally:
                random.setstate(state)

    def close(self) -> None:
        """Close the wrapped env, if it can be closed (GEM's base env has no `close`)."""
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


# --- gymnasium -------------------------------------------------------------------------------------------


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

    def play_help(self) -> str:
        """The actions, for a person playing (`rollflow env play`)."""
        space = self.env.action_space
        numbers = f"{int(space.start)}..{int(space.start) + int(space.n) - 1}"
        if self.action_names is None:
            return f"moves: an action number, {numbers}"
        return f"moves: {', '.join(self.action_names)} (or the action number, {numbers})"

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
