"""The GEM and gymnasium adapters (skipped when the package is missing)."""

from __future__ import annotations

import math
import sys

import pytest

from rollflow.envs.adapters import make_gem_env, make_gym_env
from rollflow.envs.base import Env, make_env
from rollflow.errors import ConfigError


def _trajectory(env, seed: int, actions: list[str]) -> list:
    steps = [env.reset(seed)[0]]
    for action in actions:
        observation, reward, terminated, truncated, _ = env.step(action)
        steps.append((observation, reward, terminated, truncated))
        if terminated or truncated:
            break
    return steps


# --- GEM -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("gem_id", "action"), [
    ("game:GuessTheNumber-v0-easy", "\\boxed{5}"),
    ("game:Mastermind-v0-easy", "\\boxed{1 2}"),
])
def test_gem_games_follow_the_protocol(gem_id, action):
    pytest.importorskip("gem")
    env = make_env(f"gem:{gem_id}")
    assert isinstance(env, Env)
    observation, info = env.reset(3)
    assert isinstance(observation, str) and observation and isinstance(info, dict)
    observation, reward, terminated, truncated, info = env.step(action)
    assert isinstance(observation, str) and math.isfinite(reward)
    assert isinstance(terminated, bool) and isinstance(truncated, bool) and isinstance(info, dict)


def test_gem_seed_is_reproducible_and_episodes_end():
    pytest.importorskip("gem")
    env = make_gem_env("game:GuessTheNumber-v0-easy")  # 1..10, 4 turns
    guesses = [f"\\boxed{{{n}}}" for n in (1, 2, 3, 4, 5)]
    first = _trajectory(env, 11, guesses)
    assert _trajectory(env, 11, guesses) == first
    assert first[-1][2] or first[-1][3]  # within 4 turns: guessed right, or out of turns
    assert len(first) <= 5
    # Mastermind (10 turns) ends too, repeated guesses or not.
    env = make_gem_env("game:Mastermind-v0-easy")
    steps = _trajectory(env, 0, ["\\boxed{1 2}"] * 12)
    assert steps[-1][2] and len(steps) <= 11


def test_gem_unknown_id_names_close_ones():
    pytest.importorskip("gem")
    with pytest.raises(ConfigError, match="game:Sokoban-v0-easy"):
        make_env("gem:game:Sokoban-v0-eazy")


def test_gem_missing_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "gem", None)  # `import gem` raises ImportError
    with pytest.raises(ConfigError, match=r"gem-llm package is not installed \(pip install gem-llm\)"):
        make_env("gem:game:GuessTheNumber-v0-easy")


# --- gymnasium -------------------------------------------------------------------------------------------

NAMES = ["left", "down", "right", "up"]


def test_gym_frozenlake_text_and_actions():
    pytest.importorskip("gymnasium")
    env = make_env("gym:FrozenLake-v1", is_slippery=False, action_names=NAMES)
    observation, info = env.reset(0)
    # The ANSI rendering; the agent's highlighted cell in brackets. State 0 = top-left.
    assert observation == "[S]FFF\nFHFH\nFFFH\nHFFG" and info["anchor"] == "0"
    observation, reward, terminated, truncated, info = env.step("I go DOWN")
    assert "[F]HFH" in observation and info["anchor"] == "4" and (reward, terminated) == (0.0, False)
    observation, reward, terminated, truncated, info = env.step("2")  # action 2 = right: into the hole at 5
    assert "F[H]FH" in observation and info["invalid_action"] is False and terminated


@pytest.mark.parametrize("junk", ["", "hello", "\x00junk", "7", "-1"])
def test_gym_invalid_action(junk):
    pytest.importorskip("gymnasium")
    env = make_env("gym:FrozenLake-v1", is_slippery=False, invalid_penalty=-0.5)
    before, _ = env.reset(0)
    observation, reward, terminated, truncated, info = env.step(junk)
    assert (observation, reward, terminated, truncated) == (before, -0.5, False, False)
    assert info["invalid_action"] is True and info["anchor"] == "0"


def test_gym_default_invalid_penalty_is_zero_and_max_turns_counts_invalid_steps():
    pytest.importorskip("gymnasium")
    env = make_gym_env("FrozenLake-v1", max_turns=2)
    env.reset(0)
    assert env.step("junk")[1:4] == (0.0, False, False)
    assert env.step("junk")[3] is True


def test_gym_slippery_seed_is_reproducible():
    pytest.importorskip("gymnasium")
    env = make_gym_env("FrozenLake-v1")  # slippery by default
    actions = ["2", "1"] * 10
    assert _trajectory(env, 4, actions) == _trajectory(env, 4, actions)


def test_gym_cliffwalking():
    pytest.importorskip("gymnasium")
    env = make_env("gym:CliffWalking-v1", action_names=["up", "right", "down", "left"])
    observation, info = env.reset(0)
    rows = observation.split("\n")
    assert len(rows) == 4 and rows[-1].startswith("x") and rows[-1].endswith("T") and info["anchor"] == "36"
    # Right from the start (state 36) steps onto the cliff: -100 and back to the start.
    observation, reward, terminated, truncated, info = env.step("right")
    assert (reward, terminated, info["anchor"]) == (-100.0, False, "36")
    observation, reward, terminated, truncated, info = env.step("UP")
    assert (reward, info["anchor"]) == (-1.0, "24")  # one row up: 36 - 12


def test_gym_without_text_rendering_uses_str_of_the_observation():
    pytest.importorskip("gymnasium")
    env = make_env("gym:CartPole-v1")  # renders only images: the observation is str(array)
    observation, info = env.reset(0)
    assert observation.startswith("[") and observation == info["anchor"]
    assert math.isfinite(env.step("1")[1])


def test_gym_unknown_id_and_bad_options():
    pytest.importorskip("gymnasium")
    with pytest.raises(ConfigError, match="FrozenLake-v1"):
        make_env("gym:FrozenLak-v1")
    with pytest.raises(ConfigError, match="only Discrete action spaces"):
        make_env("gym:Pendulum-v1")  # Box actions
    with pytest.raises(ConfigError, match="3 action_names for 4 actions"):
        make_env("gym:FrozenLake-v1", action_names=["a", "b", "c"])


def test_gym_missing_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "gymnasium", None)
    with pytest.raises(ConfigError, match=r"gymnasium package is not installed"):
        make_env("gym:FrozenLake-v1")
