"""The env registry and `make_env`: built-in names, adapter prefixes, dotted paths, the protocol."""

from __future__ import annotations

import random

import pytest

from rollflow.envs.base import ENVS, Env, check_env_id, make_env
from rollflow.errors import ConfigError
from rollflow.registry import UnknownNameError

BUILTINS = ["countdown", "frozenlake", "guess_number", "sokoban"]


def test_builtins_are_registered():
    make_env("frozenlake")  # imports the built-ins
    assert ENVS.names() == BUILTINS


@pytest.mark.parametrize("name", BUILTINS)
def test_builtins_follow_the_protocol(name):
    env = make_env(name)
    assert isinstance(env, Env)
    observation, info = env.reset(0)
    assert isinstance(observation, str) and info["success"] is False and isinstance(info["anchor"], str)
    action = env.random_action(random.Random(0))
    assert isinstance(action, str) and isinstance(env.expert_action(), str)
    observation, reward, terminated, truncated, info = env.step(action)
    assert isinstance(observation, str) and isinstance(reward, float)
    assert isinstance(terminated, bool) and isinstance(truncated, bool)
    assert isinstance(info["success"], bool) and info["invalid_action"] is False


@pytest.mark.parametrize("name", BUILTINS)
def test_builtins_take_max_turns_and_truncate(name):
    # A random lake must be winnable in max_turns (a 4x4 one needs 6): a fixed map is not checked for it.
    env = make_env(name, max_turns=1, **({"fixed_map": ["SFFG"]} if name == "frozenlake" else {}))
    env.reset(0)
    _, _, terminated, truncated, _ = env.step("not an action")
    assert (terminated, truncated) == (False, True)


def test_observations_are_compact():
    """A 256-position char-level model plays several turns: observations stay short."""
    lengths = {name: len(make_env(name).reset(0)[0]) for name in BUILTINS}
    assert lengths["frozenlake"] == 19 and lengths["sokoban"] == 41  # 4x4 and 6x6 grids with newlines
    assert lengths["guess_number"] == 10 and lengths["countdown"] <= 25


def test_unknown_builtin_lists_the_valid_names():
    with pytest.raises(UnknownNameError, match="Did you mean 'frozenlake'.*countdown, frozenlake, guess_number, sokoban"):
        make_env("frozenlak")
    with pytest.raises(UnknownNameError):
        check_env_id("nope")
    check_env_id("sokoban")
    check_env_id("gem:whatever")  # adapters check when the env is made


def make_small_lake(**kwargs):
    """A factory for the dotted-path test."""
    from rollflow.envs.frozenlake import FrozenLake

    return FrozenLake(fixed_map=["SG"], **kwargs)


def test_dotted_path_factory():
    env = make_env("tests.envs.test_base:make_small_lake", max_turns=3)
    assert env.reset(0)[0] == "PG"
    assert env.step("right")[1] == 1.0
    check_env_id("tests.envs.test_base:make_small_lake")
    with pytest.raises(ConfigError, match="cannot import"):
        check_env_id("tests.envs.test_base:no_such_factory")
