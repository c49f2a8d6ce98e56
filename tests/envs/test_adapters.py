"""The GEM and gymnasium adapters (skipped when the package is missing)."""

from __future__ import annotations

import math
import random
import re
import sys

import pytest

from rollflow.envs.adapters import GEM_OBSERVATIONS, make_gem_env, make_gym_env
from rollflow.envs.base import Env
from rollflow.envs.make import make_env
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


def _hanoi_moves(disks: int, source: str = "A", spare: str = "B", target: str = "C") -> list[str]:
    if disks == 0:
        return []
    return [*_hanoi_moves(disks - 1, source, target, spare), f"\\boxed{{{source} {target}}}",
            *_hanoi_moves(disks - 1, spare, source, target)]


def _play(env, seed: int, actions: list[str]) -> tuple[list, dict]:
    """Steps (observation, reward, terminated, truncated) until the episode ends, and the last info."""
    env.reset(seed)
    steps = []
    for action in actions:
        observation, reward, terminated, truncated, info = env.step(action)
        steps.append((observation, reward, terminated, truncated))
        if terminated or truncated:
            return steps, info
    raise AssertionError("the episode did not end")


@pytest.mark.parametrize("gem_id", ["game:TowerofHanoi-v0-easy", "game:Sudoku-v0-easy", "game:Minesweeper-v0-easy"])
def test_gem_games_show_the_board_they_keep_in_the_suffix(gem_id):
    gem = pytest.importorskip("gem")
    instructions, info = gem.make(gem_id).reset(seed=2)
    board = info["suffix"]  # GEM's observation is the instructions; the board is only here
    assert board.startswith("Here is the current") and board not in instructions
    observation, _ = make_gem_env(gem_id).reset(2)
    assert observation.startswith(instructions) and observation.endswith(board)


def test_gem_hanoi_board_follows_the_moves():
    pytest.importorskip("gem")
    env = make_gem_env("game:TowerofHanoi-v0-easy")
    observation, _ = env.reset(0)
    assert "A: [3, 2, 1]\nB: []\nC: []" in observation
    observation, reward, terminated, truncated, info = env.step("\\boxed{A C}")
    # `last`: this step's event and the board, not the instructions again (the trajectory holds them)
    assert observation.startswith("At turn 1, you moved disk 1 from tower A to tower C.\n")
    assert "A: [3, 2]\nB: []\nC: [1]" in observation and "You are playing" not in observation


@pytest.mark.parametrize("mode", ["concat", "concat_with_action"])
def test_gem_concat_modes_match_gems_own_wrappers(mode):
    gem = pytest.importorskip("gem")
    from gem.wrappers.observation_wrapper import ObservationWrapper

    ours = make_gem_env("game:Sudoku-v0-easy", observation=mode)
    # what GEM's WRAPPER_FACTORY[mode] builds (not imported: the factory loads GEM's tools, slowly)
    theirs = ObservationWrapper(gem.make("game:Sudoku-v0-easy"), include_action=mode == "concat_with_action",
                                include_chat_template=False)
    actions = ["\\boxed{1 1 1}", "\\boxed{9 9 9}", "I place \\boxed{2 2 3}", "junk"]
    expected = [theirs.reset(5)[0]] + [theirs.step(action)[0] for action in actions]
    assert [ours.reset(5)[0]] + [ours.step(action)[0] for action in actions] == expected
    assert expected[-1].count("You are playing") == 1 and ("I place" in expected[-1]) == (mode != "concat")


def test_gem_raw_mode_is_gems_observation_alone():
    pytest.importorskip("gem")
    env = make_gem_env("game:TowerofHanoi-v0-easy", observation="raw")
    assert "A: [3, 2, 1]" not in env.reset(0)[0]
    assert env.step("\\boxed{A C}")[0] == "At turn 1, you moved disk 1 from tower A to tower C."


def test_gem_unknown_observation_mode_lists_the_valid_ones():
    pytest.importorskip("gem")
    valid = re.escape(f"Valid: {', '.join(GEM_OBSERVATIONS.names())}")
    with pytest.raises(ConfigError, match=valid) as caught:
        make_env("gem:game:GuessTheNumber-v0-easy", observation="concat_hat")
    assert "'gem:game:GuessTheNumber-v0-easy'" in str(caught.value) and "Did you mean 'concat'" in str(caught.value)
    with pytest.raises(ConfigError, match="rollflow applies it itself"):
        make_env("gem:game:GuessTheNumber-v0-easy", observation="concat_chat")
    assert {"concat", "concat_with_action", "last", "raw"} <= set(GEM_OBSERVATIONS.names())


def test_gem_solved_games_succeed():
    pytest.importorskip("gem")
    # Tower of Hanoi by the known solution: 7 moves, GEM pays 1 at the last.
    steps, info = _play(make_gem_env("game:TowerofHanoi-v0-easy"), 0, _hanoi_moves(3))
    assert len(steps) == 7 and steps[-1][1:] == (1.0, True, False) and info["success"] is True
    # GuessTheNumber (1..10, 4 turns) by binary search on the hints: at most 4 guesses.
    env = make_gem_env("game:GuessTheNumber-v0-easy")
    for seed in range(5):
        env.reset(seed)
        low, high = 1, 10
        for _ in range(4):
            guess = (low + high) // 2
            observation, reward, terminated, truncated, info = env.step(f"\\boxed{{{guess}}}")
            if terminated:
                break
            low, high = (guess + 1, high) if "is higher" in observation else (low, guess - 1)
        assert (reward, terminated, info["success"]) == (1.0, True, True), observation


@pytest.mark.parametrize("gem_id", ["game:Sudoku-v0-easy", "game:Crosswords-v0-easy"])
def test_gem_solved_games_with_progress_rewards_succeed(gem_id):
    """Sudoku and Crosswords pay each right cell 1/cells: the last step gets a fraction, the return 1 (up to
    rounding: Crosswords' sums to 0.9999999999999999)."""
    gem = pytest.importorskip("gem")
    game = gem.make(gem_id)
    game.reset(seed=0)  # the same puzzle as the adapter's reset(0): its solution is the answer key
    if gem_id.startswith("game:Sudoku"):
        answers = [f"\\boxed{{{r + 1} {c + 1} {game.full_grid[r][c]}}}"
                   for r, cells in enumerate(game.board) for c, cell in enumerate(cells) if cell == 0]
    else:
        answers = [f"\\boxed{{{r} {c} {game.solution[r][c]}}}"
                   for r, cells in enumerate(game.board) for c, cell in enumerate(cells) if cell == "_"]
    steps, info = _play(make_gem_env(gem_id), 0, answers)
    assert len(steps) == len(answers) and steps[-1][1] < 0.5 and steps[-1][2:] == (True, False)
    assert sum(step[1] for step in steps) == pytest.approx(1.0) and info["success"] is True


def test_gem_lost_and_unfinished_games_do_not_succeed():
    pytest.importorskip("gem")
    env = make_gem_env("game:GuessTheNumber-v0-easy")
    env.reset(0)
    for guess in (1, 2, 3, 4):  # GEM's secret for seed 0 is 7: four wrong guesses, out of turns
        observation, reward, terminated, truncated, info = env.step(f"\\boxed{{{guess}}}")
        assert info["success"] is False and info["invalid_action"] is False
    assert terminated and reward == pytest.approx(1 - 3 / 9)  # out of turns: partial credit, 1 - distance / 9
    # Tower of Hanoi out of turns with one disk on C: partial credit 1/3, not a success.
    env = make_gem_env("game:TowerofHanoi-v0-easy", max_turns=2)
    steps, info = _play(env, 0, ["\\boxed{A C}"] * 2)  # disk 1 to C, then an illegal move
    assert steps[-1][1:] == (pytest.approx(1 / 3), True, True) and info["success"] is False


def test_gem_success_threshold_is_an_adapter_kwarg():
    pytest.importorskip("gem")
    env = make_env("gem:game:TowerofHanoi-v0-easy", max_turns=2, success_threshold=0.3)
    steps, info = _play(env, 0, ["\\boxed{A C}"] * 2)
    assert steps[-1][1] == pytest.approx(1 / 3) and info["success"] is True


def test_gem_format_errors_are_invalid_actions_and_illegal_moves_are_not():
    pytest.importorskip("gem")
    env = make_gem_env("game:TowerofHanoi-v0-easy")
    env.reset(0)
    observation, reward, terminated, truncated, info = env.step("\\boxed{B C}")  # B is empty: illegal, parsed
    assert (reward, terminated, info["invalid_action"]) == (0.0, False, False)
    observation, reward, terminated, truncated, info = env.step("move the small disk")  # no \boxed{}: unparsed
    assert (reward, terminated, info["invalid_action"], info["success"]) == (-0.1, True, True, False)


def test_gem_bad_kwarg_is_a_one_line_config_error():
    pytest.importorskip("gem")
    # GEM's envs take `**_`: gem.make would drop the misspelt name silently
    with pytest.raises(ConfigError) as caught:
        make_env("gem:game:GuessTheNumber-v0-easy", max_turn=3)
    message = str(caught.value)
    assert "'gem:game:GuessTheNumber-v0-easy'" in message and "'max_turn'" in message and "\n" not in message
    assert "Did you mean 'max_turns'?" in message and "max_number, max_turns, min_number" in message
    with pytest.raises(ConfigError, match="gem:game:TowerofHanoi-v0-easy"):
        make_env("gem:game:TowerofHanoi-v0-easy", num_disks="three")  # a TypeError in GEM's constructor


def test_gem_random_action_is_reproducible_and_leaves_the_game_alone():
    pytest.importorskip("gem")
    env = make_gem_env("game:Minesweeper-v0-easy")
    env.reset(4)
    state = random.getstate()
    first = [env.random_action(random.Random(7)) for _ in range(3)]
    assert random.getstate() == state  # GEM's games draw their dynamics (the mines) from the global state
    assert [env.random_action(random.Random(7)) for _ in range(3)] == first
    rng = random.Random(7)
    assert len({env.random_action(rng) for _ in range(20)}) > 1
    with pytest.raises(ConfigError, match="no random action"):
        make_gem_env("game:TowerofHanoi-v0-easy").random_action(random.Random(0))


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


def test_gem_envs_of_one_seed_played_side_by_side_play_the_same_game():
    """GEM's Minesweeper places its mines from the global `random` at the first reveal: two envs of one seed
    stepped in turn (as an env worker's threads do) drew from one shared state and got different boards."""
    pytest.importorskip("gem")
    first, second = make_gem_env("game:Minesweeper-v0-easy"), make_gem_env("game:Minesweeper-v0-easy")
    assert first.reset(3) == second.reset(3)
    random.seed(12345)  # the process's own state is the process's: left as it was
    before = random.getstate()
    for action in ["\\boxed{reveal 2 2}", "\\boxed{reveal 4 3}", "\\boxed{reveal 0 0}", "\\boxed{reveal 2 1}"]:
        assert first.step(action)[:4] == second.step(action)[:4]
    assert random.getstate() == before
