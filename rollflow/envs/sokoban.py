"""Sokoban: push every box onto a target in a small seeded room.

Rooms are made from the reset seed as gym-sokoban (and ROLL) make them, by playing backwards: walls around
the edge and a few random inner walls, every box on its target, then a random walk of reverse moves (the
player steps, pulling the box behind it now and then). Of the states the walk passes, the one whose boxes
are farthest from the targets and that a breadth-first solver over (player, boxes) states solves in at most
`max_turns` moves is kept (the first `max_turns` states of the walk always are: the reversed walk solves
them), so every room is solvable within `max_turns` and the expert (the same solver) always wins.
"""

from __future__ import annotations

import random
from typing import Any

from rollflow.envs.actions import DIRECTIONS, parse_direction
from rollflow.envs.base import ENVS, StepResult
from rollflow.errors import ConfigError

INSTRUCTIONS = """\
The observation is the room, one row per line: # wall, _ floor, O target, X box, * box on a target, P you,
S you on a target. Reply with one move: Left, Down, Right or Up (a word anywhere in the reply, any case, or
the single letter L, D, R or U). Walking into a box pushes it if the cell behind it is free. Putting every box
on a target gives reward 1 and ends the episode."""

WALL, FLOOR, TARGET, BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET = "#", "_", "O", "X", "*", "P", "S"
MAX_ROOM_DRAWS = 2_000
EXPERT_SEARCH_MOVES = 64
PULL_CHANCE = 0.7  # of pulling the box behind the player on a reverse move, when there is one
KEEP_DIRECTION_CHANCE = 0.3  # of repeating the last reverse move: boxes travel farther than in a plain walk
REVERSE_WALK_FACTOR = 3  # the reverse walk is this many times max_turns long

Cell = tuple[int, int]
State = tuple[Cell, frozenset[Cell]]  # (player, boxes)


@ENVS.register("sokoban")
class Sokoban:
    """Sokoban with text observations.

    Args:
        dim: (rows, columns) of the room, outer walls included.
        num_boxes: boxes (and targets) in the room.
        max_turns: steps (valid or not) before the episode is truncated; every room is solvable within it.
        min_solution_steps: rooms whose shortest solution is shorter are redrawn (1 allows any).
        inner_walls: at most this many random wall cells inside the room.
        step_penalty: the reward of every valid move (e.g. -0.1), added to the 1.0 of the winning move.
        invalid_penalty: the reward of a step whose action cannot be parsed.
    """

    def __init__(
        self,
        dim: tuple[int, int] = (6, 6),
        num_boxes: int = 1,
        max_turns: int = 10,
        min_solution_steps: int = 1,
        inner_walls: int = 2,
        step_penalty: float = 0.0,
        invalid_penalty: float = -0.1,
    ):
        rows, columns = dim
        if rows < 3 or columns < 3 or (rows - 2) * (columns - 2) < num_boxes + 1 or num_boxes < 1:
            raise ConfigError(f"sokoban: a {rows}x{columns} room has no space for {num_boxes} box(es) and a player")
        if not 1 <= min_solution_steps <= max_turns:
            raise ConfigError(f"sokoban: need 1 <= min_solution_steps <= max_turns, got {min_solution_steps}, {max_turns}")
        self.dim = (rows, columns)
        self.num_boxes = num_boxes
        self.max_turns = max_turns
        self.min_solution_steps = min_solution_steps
        self.inner_walls = inner_walls
        self.step_penalty = step_penalty
        self.invalid_penalty = invalid_penalty
        self.walls: frozenset[Cell] = frozenset()
        self.targets: frozenset[Cell] = frozenset()
        self.player: Cell = (1, 1)
        self.boxes: frozenset[Cell] = frozenset()
        self.turns = 0
        self.done = False

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """Draw a solvable room.

        Args:
            seed: the episode; None draws one.

        Returns:
            (observation, info).
        """
        rng = random.Random(random.randrange(2**31) if seed is None else seed)
        for _ in range(MAX_ROOM_DRAWS):
            plan = self._draw_room(rng)
            if plan is not None and len(plan) >= self.min_solution_steps:
                break
        else:
            raise ConfigError(f"sokoban: no room needing {self.min_solution_steps}..{self.max_turns} moves in "
                              f"{MAX_ROOM_DRAWS} draws; raise max_turns or lower min_solution_steps")
        self.turns, self.done = 0, False
        observation = self.render()
        return observation, {"success": False, "anchor": observation}

    def _draw_room(self, rng: random.Random) -> list[str] | None:
        """Set walls, targets, boxes and player by a reverse walk; return the room's shortest solution (None
        when the walk never moved a box off its target)."""
        rows, columns = self.dim
        inside = [(r, c) for r in range(1, rows - 1) for c in range(1, columns - 1)]
        edge = {(r, c) for r in range(rows) for c in range(columns)} - set(inside)
        inner = set(rng.sample(inside, min(rng.randint(0, self.inner_walls), len(inside) - self.num_boxes - 1)))
        picked = rng.sample([cell for cell in inside if cell not in inner], self.num_boxes + 1)
        self.walls = frozenset(edge | inner)
        self.targets = frozenset(picked[:-1])
        state: State = (picked[-1], self.targets)
        visited: list[tuple[int, int, State]] = []  # (box distance to the targets, walk step, state)
        move = rng.choice(list(DIRECTIONS))
        for index in range(REVERSE_WALK_FACTOR * self.max_turns):
            if rng.random() >= KEEP_DIRECTION_CHANCE:
                move = rng.choice(list(DIRECTIONS))
            state = _reverse_move(self.walls, state, move, pull=rng.random() < PULL_CHANCE)
            distance = sum(min(abs(b[0] - t[0]) + abs(b[1] - t[1]) for t in self.targets) for b in state[1])
            visited.append((distance, index, state))
        for distance, _, candidate in sorted(visited, key=lambda item: item[:2], reverse=True):
            if distance == 0:
                return None
            plan = solve(self.walls, self.targets, candidate, self.max_turns)
            if plan is not None:  # always, for the first max_turns states of the walk
                self.player, self.boxes = candidate
                return plan
        return None

    def step(self, action: str) -> StepResult:
        """Move (and maybe push) by the model's text.

        Args:
            action: what the model wrote (see `INSTRUCTIONS`).

        Returns:
            (observation, reward, terminated, truncated, info).
        """
        move = parse_direction(action)
        if self.done:
            return self._result(0.0, move is None)
        self.turns += 1
        if move is None:
            return self._result(self.invalid_penalty, True)
        self.player, self.boxes = apply_move(self.walls, (self.player, self.boxes), move)
        self.done = self.boxes <= self.targets
        return self._result(self.step_penalty + (1.0 if self.done else 0.0), False)

    def _result(self, reward: float, invalid: bool) -> StepResult:
        observation = self.render()
        info = {"success": self.done, "invalid_action": invalid, "anchor": observation}
        truncated = not self.done and self.turns >= self.max_turns
        if self.done or truncated:
            info["outcome"] = "every box is on a target" if self.done else \
                f"out of turns: all {self.max_turns} moves used"
        return observation, reward, self.done, truncated, info

    def play_help(self) -> str:
        """The legend and the moves, for a person playing (`rollflow env play`)."""
        return (f"legend: {WALL} wall, {FLOOR} floor, {TARGET} target, {BOX} box, {BOX_ON_TARGET} box on a target, "
                f"{PLAYER} you, {PLAYER_ON_TARGET} you on a target\n"
                f"moves: Left, Down, Right, Up (or L, D, R, U); walk into a box to push it; put every box on a "
                f"target in {self.max_turns} moves")

    def render(self) -> str:
        """The room's rows joined by newlines (symbols in `INSTRUCTIONS`)."""
        rows, columns = self.dim
        lines = []
        for r in range(rows):
            line = []
            for c in range(columns):
                cell, on_target = (r, c), (r, c) in self.targets
                if cell in self.walls:
                    line.append(WALL)
                elif cell == self.player:
                    line.append(PLAYER_ON_TARGET if on_target else PLAYER)
                elif cell in self.boxes:
                    line.append(BOX_ON_TARGET if on_target else BOX)
                else:
                    line.append(TARGET if on_target else FLOOR)
            lines.append("".join(line))
        return "\n".join(lines)

    def expert_action(self) -> str:
        """The first move of a shortest solution from the current state (any move if none exists)."""
        plan = solve(self.walls, self.targets, (self.player, self.boxes), EXPERT_SEARCH_MOVES)
        return plan[0] if plan else "Up"

    def random_action(self, rng: random.Random) -> str:
        """A uniformly random move."""
        return rng.choice(list(DIRECTIONS))


def apply_move(walls: frozenset[Cell], state: State, move: str) -> State:
    """The state after `move`: a step, a push, or no change when blocked.

    Args:
        walls: wall cells.
        state: (player, boxes).
        move: "Left", "Down", "Right" or "Up".

    Returns:
        The new (player, boxes).
    """
    (row, column), boxes = state
    d_row, d_column = DIRECTIONS[move]
    ahead = (row + d_row, column + d_column)
    if ahead in walls:
        return state
    if ahead in boxes:
        behind = (ahead[0] + d_row, ahead[1] + d_column)
        if behind in walls or behind in boxes:
            return state
        return ahead, (boxes - {ahead}) | {behind}
    return ahead, boxes


def _reverse_move(walls: frozenset[Cell], state: State, move: str, pull: bool) -> State:
    """The state before a forward move: the player steps `move`, pulling the box behind it if `pull` (the
    forward move `-move` then pushes that box back)."""
    (row, column), boxes = state
    d_row, d_column = DIRECTIONS[move]
    ahead, behind = (row + d_row, column + d_column), (row - d_row, column - d_column)
    if ahead in walls or ahead in boxes:
        return state
    if pull and behind in boxes:
        return ahead, (boxes - {behind}) | {(row, column)}
    return ahead, boxes


def solve(walls: frozenset[Cell], targets: frozenset[Cell], start: State, max_moves: int) -> list[str] | None:
    """A shortest move sequence putting every box on a target (breadth-first over states).

    Args:
        walls: wall cells.
        targets: target cells.
        start: (player, boxes).
        max_moves: give up beyond this many moves.

    Returns:
        The moves, [] when already solved, or None when no solution of at most `max_moves` exists.
    """
    parents: dict[State, tuple[State, str] | None] = {start: None}
    frontier = [start]
    for _ in range(max_moves + 1):
        next_frontier = []
        for state in frontier:
            if state[1] <= targets:
                moves = []
                while parents[state] is not None:
                    state, move = parents[state]  # type: ignore[misc]
                    moves.append(move)
                return moves[::-1]
            for move in DIRECTIONS:
                after = apply_move(walls, state, move)
                if after not in parents:
                    parents[after] = (state, move)
                    next_frontier.append(after)
        frontier = next_frontier
    return None
