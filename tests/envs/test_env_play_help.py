"""`rollflow env play` for a person: the legend of the board's symbols and the valid moves at the start and
after an invalid move, and why the episode ended (`info["outcome"]`: fell into a hole, reached the goal, out of
turns), played from scripted stdin."""

from __future__ import annotations

import argparse
import io
import sys

import pytest

from rollflow.envs.make import make_env
from rollflow.envs.play import add_play_parser, play_help, play_main

LAKE = '{"fixed_map": ["SFF", "FHF", "FFG"]}'  # the hole is Down, Right from the start; the goal 4 moves away
FROZENLAKE_HELP = ("legend: P you, _ frozen ice, O hole, G goal\n"
                   "moves: Left, Down, Right, Up (or L, D, R, U); reach G in 8 moves without falling into a hole")


def _play(monkeypatch, capsys, typed: str, *argv: str) -> list[str]:
    """The lines `rollflow env play ARGV` prints to a person typing `typed`; it must exit 0."""
    parser = argparse.ArgumentParser()
    add_play_parser(parser.add_subparsers(dest="command", required=True))
    monkeypatch.setattr(sys, "stdin", io.StringIO(typed))
    assert play_main(parser.parse_args(["env", "play", *argv])) == 0
    # input()'s prompt "> " has no newline of its own: each action line starts with it
    return [line.removeprefix("> ") for line in capsys.readouterr().out.splitlines()]


def test_the_legend_and_moves_come_first_and_again_after_an_invalid_move(monkeypatch, capsys):
    lines = _play(monkeypatch, capsys, "jump\nRight\n", "frozenlake", "--env-kwargs", LAKE)
    help_lines = FROZENLAKE_HELP.splitlines()
    assert lines[:3] == [*help_lines, "P__"]
    invalid = lines.index("reward: -0.1 (invalid action)")
    assert lines[invalid + 1: invalid + 3] == help_lines
    after_valid = lines.index("action: Right")
    assert help_lines[0] not in lines[after_valid:]  # a valid move is not followed by the legend


def test_a_fall_into_a_hole_says_so(monkeypatch, capsys):
    lines = _play(monkeypatch, capsys, "Down\nRight\n", "frozenlake", "--env-kwargs", LAKE)
    assert lines[-3:] == ["reward: 0 (fell into a hole)", "terminated",
                          "return: 0  steps: 2  success: False  invalid actions: 0"]


def test_reaching_the_goal_says_so(monkeypatch, capsys):
    lines = _play(monkeypatch, capsys, "R\nR\nD\nD\n", "frozenlake", "--env-kwargs", LAKE)
    assert lines[-3:-1] == ["reward: 1 (reached the goal)", "terminated"]


def test_running_out_of_turns_says_so(monkeypatch, capsys):
    lines = _play(monkeypatch, capsys, "Left\nxx\n", "frozenlake", "--env-kwargs",
                  '{"fixed_map": ["SFG"], "max_turns": 2}')
    assert lines[-3:-1] == ["reward: -0.1 (invalid action; out of turns: all 2 moves used)", "truncated"]


@pytest.mark.parametrize("env_id, typed, first_help_line, ending", [
    ("sokoban", "", "legend: # wall, _ floor, O target, X box, * box on a target, P you, S you on a target", None),
    ("guess_number", "20\n1\n",
     "moves: a number from 1 to 20; the answer is higher (the secret number is larger), lower (smaller) or "
     "correct; 2 guesses", "reward: 0 (out of turns: all 2 guesses used; the number was {secret})"),
    ("countdown", "1+1\n",
     "answer: an expression with + - * / and parentheses using each given number once, e.g. 3*5+7 (or "
     "<answer>3*5+7</answer>); one answer ends the episode", "reward: 0 (wrong answer; a right one: {solution})"),
])
def test_every_builtin_env_has_its_help(monkeypatch, capsys, env_id, typed, first_help_line, ending):
    kwargs = '{"max_turns": 2}' if env_id == "guess_number" else "{}"
    lines = _play(monkeypatch, capsys, typed, env_id, "--env-kwargs", kwargs)
    assert lines[0] == first_help_line
    if ending is not None:
        env = make_env(env_id, **({"max_turns": 2} if env_id == "guess_number" else {}))
        env.reset(0)  # the seed play used: the same secret, the same numbers
        expected = ending.format(secret=getattr(env, "secret", None), solution=getattr(env, "solution", None))
        assert expected in lines


def test_a_scripted_policy_prints_the_episode_alone(capsys):
    """The legend is for a person; `--policy expert` output starts at the board, and still says how it ended."""
    parser = argparse.ArgumentParser()
    add_play_parser(parser.add_subparsers(dest="command", required=True))
    assert play_main(parser.parse_args(["env", "play", "frozenlake", "--policy", "expert", "--env-kwargs", LAKE])) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "P__" and "reward: 1 (reached the goal)" in lines


def test_envs_without_help_play_as_before():
    class Bare:
        def reset(self, seed=None):
            return "start", {}

        def step(self, action):
            return "end", 0.0, True, False, {}

    assert play_help(Bare()) is None
    assert play_help(make_env("frozenlake")) == FROZENLAKE_HELP


def test_a_gym_env_lists_its_actions():
    pytest.importorskip("gymnasium")
    named = make_env("gym:FrozenLake-v1", action_names=["left", "down", "right", "up"])
    assert play_help(named) == "moves: left, down, right, up (or the action number, 0..3)"
    assert play_help(make_env("gym:FrozenLake-v1")) == "moves: an action number, 0..3"
