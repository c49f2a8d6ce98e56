"""Sokoban: seeded solvable rooms, pushes, rewards, truncation, the solver-backed expert."""

from __future__ import annotations

import random
import time

import pytest

from rollflow.envs.play import expert_policy, random_policy, run_episode
from rollflow.envs.sokoban import Sokoban, apply_move, solve
from rollflow.errors import ConfigError


def _set_room(env: Sokoban, rows: list[str]) -> None:
    """Put a hand-drawn room (our symbols) into a reset env."""
    cells = {(r, c): ch for r, row in enumerate(rows) for c, ch in enumerate(row)}
    env.dim = (len(rows), len(rows[0]))
    env.walls = frozenset(cell for cell, ch in cells.items() if ch == "#")
    env.targets = frozenset(cell for cell, ch in cells.items() if ch in "O*S")
    env.boxes = frozenset(cell for cell, ch in cells.items() if ch in "X*")
    env.player = next(cell for cell, ch in cells.items() if ch in "PS")
    env.turns, env.done = 0, False


def test_render_symbols():
    env = Sokoban()
    env.reset(0)
    _set_room(env, ["######", "#_X_O#", "#_*S_#", "######"])
    assert env.render() == "######\n#_X_O#\n#_*S_#\n######"


def test_push_onto_target_wins():
    env = Sokoban(step_penalty=-0.1)
    env.reset(0)
    _set_room(env, ["######", "#PX_O#", "######"])
    observation, reward, terminated, truncated, info = env.step("Right")
    assert observation == "######\n#_PXO#\n######"
    assert reward == pytest.approx(-0.1) and (terminated, info["success"]) == (False, False)
    observation, reward, terminated, truncated, info = env.step("right")
    assert observation == "######\n#__P*#\n######"
    assert reward == pytest.approx(0.9)  # 1.0 for the win + the step penalty -0.1
    assert (terminated, truncated, info["success"]) == (True, False, True)


def test_blocked_moves_leave_the_state():
    env = Sokoban()
    env.reset(0)
    _set_room(env, ["######", "#PXX_#", "#___O#", "######"])
    before = env.render()
    assert env.step("Right")[0] == before  # two boxes in a row do not move
    assert env.step("Up")[0] == before  # a wall
    walls = env.walls
    assert apply_move(walls, ((1, 3), frozenset({(1, 4)})), "Right") == ((1, 3), frozenset({(1, 4)}))  # box into wall


def test_solver_finds_shortest_solution():
    env = Sokoban()
    env.reset(0)
    _set_room(env, ["#######", "#P_X_O#", "#######"])
    # Walk 1 right to the box, then push it 2 cells: Right x3.
    assert solve(env.walls, env.targets, (env.player, env.boxes), 10) == ["Right"] * 3
    assert solve(env.walls, env.targets, (env.player, env.boxes), 2) is None
    # Box in a corner away from the target: unsolvable.
    _set_room(env, ["#####", "#X_O#", "#_P_#", "#####"])
    assert solve(env.walls, env.targets, (env.player, env.boxes), 30) is None


def test_same_seed_same_room_and_different_seeds_differ():
    env = Sokoban()
    first = env.reset(11)[0]
    assert env.reset(11)[0] == first
    assert len({env.reset(seed)[0] for seed in range(20)}) > 10
    rows = first.split("\n")
    assert len(rows) == 6 and all(len(row) == 6 for row in rows)
    assert rows[0] == "######" and first.count("X") == 1 and first.count("O") + first.count("S") == 1


@pytest.mark.parametrize("junk", ["", "hello", "\x00junk"])
def test_invalid_action_penalty_and_state_unchanged(junk):
    env = Sokoban(invalid_penalty=-0.5)
    before = env.reset(3)[0]
    observation, reward, terminated, truncated, info = env.step(junk)
    assert (observation, reward, terminated, truncated) == (before, -0.5, False, False)
    assert info["invalid_action"] is True and info["success"] is False


def test_truncation_at_max_turns():
    env = Sokoban(max_turns=2)
    env.reset(0)
    _set_room(env, ["#######", "#P_X_O#", "#######"])
    assert env.step("Left")[3] is False  # into the wall
    _, _, terminated, truncated, info = env.step("Left")
    assert (terminated, truncated, info["success"]) == (False, True, False)


def test_expert_solves_every_seed_within_max_turns_and_random_does_not():
    env = Sokoban()
    expert = [run_episode(env, expert_policy(env), seed, max_steps=50) for seed in range(100)]
    assert all(result["success"] for result in expert)
    assert all(result["steps"] <= env.max_turns for result in expert)
    rng = random.Random(0)
    randoms = [run_episode(env, random_policy(env, rng), seed, max_steps=50) for seed in range(100)]
    assert sum(result["success"] for result in randoms) < 40  # about 20 in practice


def test_two_boxes_and_generation_is_fast():
    env = Sokoban(dim=(7, 7), num_boxes=2, max_turns=20, min_solution_steps=4)
    start = time.perf_counter()
    for seed in range(20):
        observation = env.reset(seed)[0]
        assert observation.count("X") + observation.count("*") == 2
    assert (time.perf_counter() - start) / 20 < 0.05
    result = run_episode(env, expert_policy(env), 0, max_steps=40)
    assert result["success"] and result["steps"] >= 4


def test_bad_config():
    with pytest.raises(ConfigError, match="no space"):
        Sokoban(dim=(3, 3), num_boxes=1)
    with pytest.raises(ConfigError, match="min_solution_steps"):
        Sokoban(max_turns=3, min_solution_steps=5)
