"""Policies, `run_episode`, and `rollflow env play` (in-process and as a subprocess)."""

from __future__ import annotations

import argparse
import io
import random
import subprocess
import sys

import pytest

from rollflow.envs.frozenlake import FrozenLake
from rollflow.envs.play import add_play_parser, expert_policy, main, play_main, random_policy, run_episode
from rollflow.errors import ConfigError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_play_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["env", "play", *argv])


def test_run_episode_counts():
    env = FrozenLake(fixed_map=["SFG"], max_turns=5)
    actions = iter(["junk", "Left", "Right", "Right"])
    lines = []
    result = run_episode(env, lambda observation: next(actions), seed=0, echo=lines.append)
    # -0.1 (invalid) + 0 (wall) + 0 + 1 (goal)
    assert result == {"return": pytest.approx(0.9), "steps": 4, "success": True, "invalid": 1}
    assert lines[0] == "P_G" and "reward: -0.1 (invalid action)" in lines and lines[-1] == "terminated"


def test_run_episode_stops_at_max_steps():
    env = FrozenLake(fixed_map=["SFG"], max_turns=50)
    result = run_episode(env, lambda observation: "Left", seed=0, max_steps=7)
    assert result == {"return": 0.0, "steps": 7, "success": False, "invalid": 0}


def test_policies_need_a_builtin_env():
    with pytest.raises(ConfigError, match="expert_action"):
        expert_policy(object())
    with pytest.raises(ConfigError, match="random_action"):
        random_policy(object(), random.Random(0))


def test_play_expert(capsys):
    assert play_main(_args("frozenlake", "--policy", "expert", "--seed", "3")) == 0
    out = capsys.readouterr().out
    assert "success: True" in out and out.count("action: ") <= 8


def test_play_random_with_env_kwargs(capsys):
    argv = ("guess_number", "--policy", "random", "--env-kwargs", '{"high": 5, "max_turns": 2}')
    assert play_main(_args(*argv)) == 0
    out = capsys.readouterr().out
    assert out.startswith("guess 1-5\n") and out.count("action: ") <= 2


def test_play_random_gem_game_is_reproducible_from_the_seed(capsys):
    pytest.importorskip("gem")

    def play(seed: str) -> str:
        assert main(["gem:game:Minesweeper-v0-easy", "--policy", "random", "--seed", seed, "--max-steps", "6"]) == 0
        return capsys.readouterr().out

    out = play("5")
    assert "action: \\boxed{" in out and "Here is the current board layout:" in out  # GEM's action; the board
    assert play("5") == out and play("6") != out


def test_play_random_gem_game_without_a_random_action_is_a_user_error(capsys):
    pytest.importorskip("gem")
    assert play_main(_args("gem:game:TowerofHanoi-v0-easy", "--policy", "random")) == 2
    err = capsys.readouterr().err
    assert "has no random action" in err and err.count("\n") == 1 and "Traceback" not in err


def test_play_human_reads_stdin_and_ends_cleanly_at_eof(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Right\nblah\n"))
    assert play_main(_args("frozenlake", "--env-kwargs", '{"fixed_map": ["SFFG"]}')) == 0
    out = capsys.readouterr().out
    assert "\n_P_G\n" in out and "(invalid action)" in out and out.rstrip().endswith("end of input")


@pytest.mark.parametrize(("argv", "message"), [
    (("frozenlak",), "unknown environment 'frozenlak'"),
    (("frozenlake", "--env-kwargs", "{bad"), "not valid JSON"),
    (("frozenlake", "--env-kwargs", "[1]"), "must be a JSON object"),
    (("frozenlake", "--env-kwargs", '{"colour": 1}'), "colour"),
    (("gym:FrozenLake-v1", "--policy", "expert"), "no expert_action"),
])
def test_play_user_errors_are_one_line(capsys, argv, message):
    assert play_main(_args(*argv)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_play_as_a_subprocess():
    done = subprocess.run([sys.executable, "-m", "rollflow.envs.play", "frozenlake", "--policy", "expert",
                           "--seed", "3"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "success: True" in done.stdout
    done = subprocess.run([sys.executable, "-m", "rollflow.envs.play", "nope"], capture_output=True, text=True,
                          timeout=60, input="")
    assert done.returncode == 2 and "unknown environment 'nope'" in done.stderr and "Traceback" not in done.stderr


def test_rollflow_cli_env_play(capsys):
    """Once `rollflow/cli.py` wires `add_play_parser`, `rollflow env play` runs through the main CLI."""
    from rollflow import cli

    parser = cli.build_parser()
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    if "env" not in commands.choices:
        pytest.skip("`rollflow env` is not wired into rollflow/cli.py yet")
    assert cli.main(["env", "play", "sokoban", "--policy", "expert", "--seed", "1"]) == 0
    assert "success: True" in capsys.readouterr().out
    assert cli.main(["env", "play", "nope"]) == 2
