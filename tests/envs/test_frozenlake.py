"""FrozenLake: seeded maps, the tolerant move parser, rewards, truncation, slipping, the expert."""

from __future__ import annotations

import random

import pytest

from rollflow.envs.actions import parse_direction
from rollflow.envs.frozenlake import FrozenLake
from rollflow.envs.play import expert_policy, random_policy, run_episode
from rollflow.errors import ConfigError

# A fixed map (gymnasium's default 4x4): S start, F frozen, H hole, G goal.
DEFAULT_MAP = ["SFFF", "FHFH", "FFFH", "HFFG"]


@pytest.mark.parametrize(("text", "expected"), [
    (" down.", "Down"),
    ("I go LEFT", "Left"),
    ("R", "Right"),
    ("r", "Right"),
    (" u\n", "Up"),
    ("<answer>Up</answer>", "Up"),
    ("left then right", "Left"),  # the first direction word wins
    ("Rightwards?", None),  # whole words only
    ("a", None),  # a single letter counts only if it is L, D, R or U
    ("I", None),
    ("", None),
    ("hello", None),
    ("\x00junk", None),
])
def test_parse_direction(text, expected):
    assert parse_direction(text) == expected


def test_observation_is_the_grid_with_our_symbols():
    env = FrozenLake(fixed_map=DEFAULT_MAP)
    observation, info = env.reset(0)
    assert observation == "P___\n_O_O\n___O\nO__G"
    assert info == {"success": False, "anchor": observation}


def test_same_seed_same_map_and_different_seeds_differ():
    env = FrozenLake()
    first = env.reset(7)[0]
    assert env.reset(7)[0] == first
    assert len({env.reset(seed)[0] for seed in range(20)}) > 10


def test_random_maps_keep_start_and_goal_and_are_solvable_within_max_turns():
    env = FrozenLake(size=5, hole_fraction=0.4, max_turns=10)
    for seed in range(50):
        rows = env.reset(seed)[0].split("\n")
        assert rows[0][0] == "P" and rows[-1][-1] == "G" and len(rows) == 5
        assert 8 <= len(_path(env)) <= 10  # Manhattan distance 8 is the shortest possible


def _path(env):
    from rollflow.envs.frozenlake import _shortest_path

    return _shortest_path(env.grid, env.position)


def test_goal_hole_and_wall_rewards():
    env = FrozenLake(fixed_map=DEFAULT_MAP)
    env.reset(0)
    # Left at the left edge: a valid move that stays in place.
    observation, reward, terminated, truncated, info = env.step("Left")
    assert (observation.split("\n")[0], reward, terminated, truncated) == ("P___", 0.0, False, False)
    assert info["success"] is False and info["invalid_action"] is False
    # Right, Down: into the hole at row 1, column 1 -> ends with 0.
    env.step("Right")
    _, reward, terminated, _, info = env.step("Down")
    assert (reward, terminated, info["success"]) == (0.0, True, False)
    # The path Down Down Right Down Right Right reaches the goal: reward 1 on the last move only.
    env.reset(0)
    rewards = [env.step(move)[1] for move in ["Down", "Down", "Right", "Down", "Right"]]
    observation, reward, terminated, truncated, info = env.step("Right")
    assert rewards == [0.0] * 5 and (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)
    assert observation.endswith("P")


@pytest.mark.parametrize("junk", ["", "hello", "\x00junk"])
def test_invalid_action_penalty_and_state_unchanged(junk):
    env = FrozenLake(fixed_map=DEFAULT_MAP, invalid_penalty=-0.25)
    before = env.reset(0)[0]
    observation, reward, terminated, truncated, info = env.step(junk)
    assert (observation, reward, terminated, truncated) == (before, -0.25, False, False)
    assert info["invalid_action"] is True and info["success"] is False
    assert env.position == (0, 0)


def test_truncation_at_max_turns():
    env = FrozenLake(fixed_map=DEFAULT_MAP, max_turns=3)
    env.reset(0)
    # Up at the top edge stays in place; invalid turns count too.
    assert env.step("Up")[3] is False
    assert env.step("junk")[3] is False
    _, _, terminated, truncated, info = env.step("Up")
    assert (terminated, truncated, info["success"]) == (False, True, False)


def test_slippery_is_reproducible_and_sometimes_slips():
    env = FrozenLake(fixed_map=["SFFFFFFF"] + ["FFFFFFFF"] * 6 + ["FFFFFFFG"], slippery=True, max_turns=100)

    def positions(seed):
        env.reset(seed)
        trace = []
        for _ in range(6):
            env.step("Right")
            trace.append(env.position)
        return trace

    assert positions(5) == positions(5)
    # "Right" from (r, c) lands on (r, c+1) (intended, 1/3), or slips Up / Down: (r-1, c) / (r+1, c), Up at
    # row 0 staying in place. All 6 moves of a seed are intended with probability (1/3)^6, so over 10 seeds
    # some slip; and no move ever goes Left.
    traces = [[(0, 0), *positions(seed)] for seed in range(10)]
    moves = [(b[0] - a[0], b[1] - a[1]) for trace in traces for a, b in zip(trace, trace[1:])]
    assert set(moves) <= {(0, 1), (1, 0), (-1, 0), (0, 0)}
    assert (0, 1) in moves and (1, 0) in moves


def test_expert_solves_every_seed_and_random_does_not():
    env = FrozenLake()
    expert = [run_episode(env, expert_policy(env), seed, max_steps=20) for seed in range(100)]
    assert all(result["success"] for result in expert)
    assert all(result["steps"] <= 8 for result in expert)
    rng = random.Random(0)
    randoms = [run_episode(env, random_policy(env, rng), seed, max_steps=20) for seed in range(100)]
    assert sum(result["success"] for result in randoms) < 30  # about 2-3% in practice


def test_expert_moves_along_a_shortest_path():
    env = FrozenLake(fixed_map=DEFAULT_MAP)
    env.reset(0)
    moves = []
    for _ in range(6):
        moves.append(env.expert_action())
        env.step(moves[-1])
    # From S: the hole at (1,1) forces Down Down first; the only 6-move paths go through row 2.
    assert moves[:2] == ["Down", "Down"] and env.success


def test_bad_config():
    with pytest.raises(ConfigError, match="max_turns >= 14"):
        FrozenLake(size=8, max_turns=8)
    with pytest.raises(ConfigError, match="reachable goal"):
        FrozenLake(fixed_map=["SH", "HG"])
