"""The env registry and `make_env`: built-in names, adapter prefixes, dotted paths, the protocol."""

from __future__ import annotations

import random
import re
import sys

import pytest

from rollflow.envs.base import ENVS, Env
from rollflow.envs.make import check_env_id, make_env
from rollflow.errors import ConfigError
from rollflow.registry import UnknownNameError

BUILTINS = ["countdown", "frozenlake", "guess_number", "sokoban"]  # the games (each has a scripted expert)
WRAPPERS = ["prompts", "tool_use"]  # a prompt dataset as an env, and tools around any env (tests/envs/test_tool_use.py)


def test_builtins_are_registered():
    make_env("frozenlake")  # imports the built-ins
    assert set(BUILTINS + WRAPPERS) <= set(ENVS.names())  # an env registered later joins them


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
    valid = re.escape(f"Valid: {', '.join(ENVS.names())}")
    with pytest.raises(UnknownNameError, match=rf"Did you mean 'frozenlake'\?.*{valid}"):
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
    with pytest.raises(ConfigError, match="module 'tests.envs.test_base' has no attribute 'no_such_factory'"):
        check_env_id("tests.envs.test_base:no_such_factory")


@pytest.mark.parametrize(("module", "source", "reason"), [
    ("syntax_env", "def make(:\n    pass\n", r"SyntaxError: invalid syntax \(.*syntax_env.py, line 1\)"),
    ("raising_env", "raise RuntimeError('boom at import')\n", r"RuntimeError: boom at import"),
    ("importing_env", "import no_such_package_here\n", r"ModuleNotFoundError: No module named 'no_such_package_here'"),
])
def test_a_user_env_module_that_fails_to_import_is_one_config_error(tmp_path, monkeypatch, module, source, reason):
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.chdir(tmp_path)  # a module in the working directory, named without a package: `module:factory`
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ConfigError, match=rf"^env '{module}:make': cannot import module '{module}' \({reason}"):
        check_env_id(f"{module}:make")


def test_a_module_without_a_dot_is_a_path_not_an_unknown_builtin(tmp_path, monkeypatch):
    (tmp_path / "lake_env.py").write_text("from tests.envs.test_base import make_small_lake as make\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "lake_env", raising=False)
    assert make_env("lake_env:make", max_turns=3).reset(0)[0] == "PG"
    with pytest.raises(ConfigError, match="cannot import module 'missing_env' .*looked on sys.path and in the "
                                          "working directory"):
        check_env_id("missing_env:make")
    with pytest.raises(ConfigError, match="is not of the form 'pkg.module:factory'"):
        check_env_id(":make")
