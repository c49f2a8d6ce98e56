"""FrozenLake: walk from the top-left corner to the goal at the bottom-right without falling into a hole.

Maps are drawn from the reset seed (each cell frozen with probability `1 - hole_fraction`, as gymnasium's
`generate_random_map`) and redrawn, deterministically, until the goal is reachable in at most `max_turns`
moves, so every episode can be won.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from rollflow.envs.actions import DIRECTIONS, parse_direction
from rollflow.envs.base import ENVS, StepResult
from rollflow.errors import ConfigError

INSTRUCTIONS = """\
The observation is the grid, one row per line: P you, _ frozen ice, O hole, G goal. The player covers the
cell it stands on (P on the goal or in a hole ends the episode). Reply with one move: Left, Down, Right or Up
(a word anywhere in the reply, any case, or the single letter L, D, R or U). Reaching G gives reward 1; a hole
ends the episode with 0; walking into the edge leaves you in place."""

IMAGE_INSTRUCTIONS = """\
The observation is an image of the grid, one 8x8-pixel square per cell: red you, light blue frozen ice, dark
blue hole, green goal. Reply with one move: Left, Down, Right or Up. Reaching the goal gives reward 1; a hole
ends the episode with 0; walking into the edge leaves you in place."""

PLAYER, FROZEN, HOLE, GOAL, START = "P", "_", "O", "G", "S"
CELL_PIXELS = 8  # one cell per image token of the bundled tiny VLM (4x4 patches merged 2x2)
CELL_COLOURS = {PLAYER: (230, 40, 40), FROZEN: (170, 210, 250), HOLE: (20, 30, 110), GOAL: (40, 190, 70)}
OBSERVATIONS = ("text", "image")
MAX_MAP_DRAWS = 10_000
_PERPENDICULAR = {"Left": ("Up", "Down"), "Right": ("Up", "Down"), "Up": ("Left", "Right"), "Down": ("Left", "Right")}


@ENVS.register("frozenlake")
class FrozenLake:
    """The FrozenLake grid world with text observations.

    Args:
        size: side of the square random map.
        hole_fraction: chance that a cell of a random map is a hole.
        slippery: the intended move happens with probability 1/3 and each perpendicular move with 1/3 (as
            gymnasium's `is_slippery`), drawn from a generator seeded by the reset seed.
        max_turns: steps (valid or not) before the episode is truncated.
        invalid_penalty: the reward of a step whose action cannot be parsed.
        fixed_map: rows of a map to use instead of random ones, in gymnasium's letters (S start, F frozen,
            H hole, G goal) or ours (`_` frozen, `O` hole); must have a start, a goal and a path between.
        observation: `text` (the grid's rows) or `image`: the grid drawn as an image (`board_image`, in
            `info["images"]`; the observation text is `<image>`, where the image goes), for a
            vision-language policy (`IMAGE_INSTRUCTIONS`). Either way `info["anchor"]` is the text grid.
    """

    def __init__(
        self,
        size: int = 4,
        hole_fraction: float = 0.2,
        slippery: bool = False,
        max_turns: int = 8,
        invalid_penalty: float = -0.1,
        fixed_map: list[str] | None = None,
        observation: str = "text",
    ):
        if observation not in OBSERVATIONS:
            raise ConfigError(f"frozenlake: observation must be one of {', '.join(OBSERVATIONS)}, got {observation!r}")
        if fixed_map is None and 2 * (size - 1) > max_turns:
            raise ConfigError(f"frozenlake: a {size}x{size} map needs max_turns >= {2 * (size - 1)}, got {max_turns}")
        if not 0.0 <= hole_fraction < 1.0:
            raise ConfigError(f"frozenlake: hole_fraction must be in [0, 1), got {hole_fraction}")
        self.size = size
        self.hole_fraction = hole_fraction
        self.slippery = slippery
        self.max_turns = max_turns
        self.invalid_penalty = invalid_penalty
        self.observation = observation
        self.fixed_map = _read_fixed_map(fixed_map) if fixed_map is not None else None
        self.grid: list[str] = []
        self.position = (0, 0)
        self.turns = 0
        self.done = False
        self.success = False
        self._rng = random.Random(0)

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """Draw the map (unless fixed) and put the player on the start.

        Args:
            seed: the episode; None draws one.

        Returns:
            (observation, info).
        """
        self._rng = random.Random(random.randrange(2**31) if seed is None else seed)
        if self.fixed_map is not None:
            self.grid, self.position = self.fixed_map
        else:
            self.grid = _random_map(self.size, 1.0 - self.hole_fraction, self.max_turns, self._rng)
            self.position = (0, 0)
        self.turns, self.done, self.success = 0, False, False
        return self._observed({"success": False, "anchor": self.render()})

    def step(self, action: str) -> StepResult:
        """Move the player by the model's text.

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
        if self.slippery:
            move = self._rng.choice([move, *_PERPENDICULAR[move]])
        row, column = self.position[0] + DIRECTIONS[move][0], self.position[1] + DIRECTIONS[move][1]
        if 0 <= row < len(self.grid) and 0 <= column < len(self.grid[0]):
            self.position = (row, column)
        cell = self.grid[self.position[0]][self.position[1]]
        self.done = cell in (HOLE, GOAL)
        self.success = cell == GOAL
        return self._result(1.0 if self.success else 0.0, False)

    def _result(self, reward: float, invalid: bool) -> StepResult:
        info = {"success": self.success, "invalid_action": invalid, "anchor": self.render()}
        truncated = not self.done and self.turns >= self.max_turns
        if self.done or truncated:
            info["outcome"] = ("reached the goal" if self.success else "fell into a hole") if self.done else \
                f"out of turns: all {self.max_turns} moves used"
        observation, info = self._observed(info)
        return observation, reward, self.done, truncated, info

    def _observed(self, info: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """(observation text, info) of the current state: the text grid, or `<image>` and the board image."""
        if self.observation == "image":
            return "<image>", {**info, "images": [self.board_image()]}
        return info["anchor"], info

    def board_image(self):
        """The grid as an RGB image, `CELL_PIXELS` per cell: the player red, ice light blue, holes dark blue,
        the goal green (a pixel of black between cells)."""
        from PIL import Image, ImageDraw

        rows = self.render().splitlines()
        image = Image.new("RGB", (len(rows[0]) * CELL_PIXELS, len(rows) * CELL_PIXELS), (0, 0, 0))
        draw = ImageDraw.Draw(image)
        for r, row in enumerate(rows):
            for c, cell in enumerate(row):
                top, left = r * CELL_PIXELS, c * CELL_PIXELS
                draw.rectangle([left + 1, top + 1, left + CELL_PIXELS - 2, top + CELL_PIXELS - 2], fill=CELL_COLOURS[cell])
        return image

    def play_help(self) -> str:
        """The legend and the moves, for a person playing (`rollflow env play`)."""
        slippery = "; the ice is slippery: a move goes sideways 2 times in 3" if self.slippery else ""
        return (f"legend: {PLAYER} you, {FROZEN} frozen ice, {HOLE} hole, {GOAL} goal\n"
                f"moves: Left, Down, Right, Up (or L, D, R, U); reach {GOAL} in {self.max_turns} moves without "
                f"falling into a hole{slippery}")

    def render(self) -> str:
        """The grid rows joined by newlines, the player drawn as `P` over its cell."""
        rows = [row.replace(START, FROZEN) for row in self.grid]
        row, column = self.position
        rows[row] = rows[row][:column] + PLAYER + rows[row][column + 1 :]
        return "\n".join(rows)

    def expert_action(self) -> str:
        """The first move of a shortest hole-free path to the goal (optimal when not slippery)."""
        path = _shortest_path(self.grid, self.position)
        return path[0] if path else "Right"

    def random_action(self, rng: random.Random) -> str:
        """A uniformly random move."""
        return rng.choice(list(DIRECTIONS))


def _random_map(size: int, p_frozen: float, max_moves: int, rng: random.Random) -> list[str]:
    """Rows of a random map whose goal is at most `max_moves` moves from the start (start cell marked S)."""
    for _ in range(MAX_MAP_DRAWS):
        cells = [[FROZEN if rng.random() < p_frozen else HOLE for _ in range(size)] for _ in range(size)]
        cells[0][0], cells[-1][-1] = START, GOAL
        grid = ["".join(row) for row in cells]
        path = _shortest_path(grid, (0, 0))
        if path is not None and len(path) <= max_moves:
            return grid
    raise ConfigError(f"frozenlake: no solvable {size}x{size} map in {MAX_MAP_DRAWS} draws; lower hole_fraction")


def _shortest_path(grid: list[str], start: tuple[int, int]) -> list[str] | None:
    """Moves of a shortest path from `start` to the goal avoiding holes (breadth-first), or None."""
    parents: dict[tuple[int, int], tuple[tuple[int, int], str] | None] = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if grid[cell[0]][cell[1]] == GOAL:
            moves = []
            while parents[cell] is not None:
                cell, move = parents[cell]  # type: ignore[misc]
                moves.append(move)
            return moves[::-1]
        if grid[cell[0]][cell[1]] == HOLE:
            continue
        for move, (d_row, d_column) in DIRECTIONS.items():
            row, column = cell[0] + d_row, cell[1] + d_column
            if 0 <= row < len(grid) and 0 <= column < len(grid[0]) and (row, column) not in parents:
                parents[(row, column)] = (cell, move)
                queue.append((row, column))
    return None


def _read_fixed_map(rows: list[str]) -> tuple[list[str], tuple[int, int]]:
    """(grid in our symbols with the start marked S, start position) of a user's map; ConfigError if bad."""
    table = str.maketrans({"F": FROZEN, "H": HOLE, "P": START})
    grid = [str(row).translate(table) for row in rows]
    if not grid or any(len(row) != len(grid[0]) for row in grid) or set("".join(grid)) - {FROZEN, HOLE, GOAL, START}:
        raise ConfigError(f"frozenlake: fixed_map must be equal-length rows of S F H G (or _ O), got {rows!r}")
    starts = [(r, c) for r, row in enumerate(grid) for c, cell in enumerate(row) if cell == START]
    if len(starts) != 1 or GOAL not in "".join(grid) or _shortest_path(grid, starts[0]) is None:
        raise ConfigError(f"frozenlake: fixed_map needs one start (S) and a reachable goal (G), got {rows!r}")
    return grid, starts[0]
