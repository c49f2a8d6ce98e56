"""Built-in synthetic visual tasks: small images and a question about them, with a fixed held-out split.

`count_shapes`: a 32x32 image is a 4x4 grid of 8x8 cells; some cells hold a red square, some a blue one,
on black. The question asks for the number of squares of one colour:

    {"prompt": "How many red squares?", "images": [<32x32 PIL image>], "answer": "3"}

A cell is 8x8 pixels, the area one image token of the bundled tiny vision-language model covers (4x4
patches merged 2x2), so each token sees one cell. The rows are drawn from a seeded generator: the same rows
on every machine for every run, the held-out split drawn apart from the training rows and holding no
layout that a training row has.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

from rollflow.registry import Registry

Row = dict

VISUAL_TASKS: Registry[Callable[[], tuple[list[Row], list[Row]]]] = Registry("visual task")

IMAGE_SIZE = 32
CELL = 8  # pixels per grid cell (4 x 4 cells)
COLOURS = {"red": (230, 40, 40), "blue": (40, 90, 235)}
NUM_TRAIN, NUM_EVAL = 6000, 500


def draw_cells(cells: dict[int, tuple[int, int, int]], size: int = IMAGE_SIZE, cell: int = CELL):
    """An RGB image of a grid of `cell`-pixel cells, black but for a square of `cells[index]`'s colour in each
    listed cell (index = row * cells per row + column), a pixel of margin around it."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (0, 0, 0))
    draw = ImageDraw.Draw(image)
    per_row = size // cell
    for index, colour in cells.items():
        top, left = (index // per_row) * cell, (index % per_row) * cell
        draw.rectangle([left + 1, top + 1, left + cell - 2, top + cell - 2], fill=colour)
    return image


def count_shapes_row(rng: random.Random) -> tuple[Row, tuple]:
    """One `count_shapes` row and its layout (to keep the held-out layouts apart from the training ones)."""
    asked, other = rng.sample(sorted(COLOURS), 2)
    count, distractors = rng.randint(1, 5), rng.randint(0, 4)
    cells = rng.sample(range((IMAGE_SIZE // CELL) ** 2), count + distractors)
    colours = {index: COLOURS[asked] for index in cells[:count]} | {index: COLOURS[other] for index in cells[count:]}
    layout = (asked, tuple(sorted(cells[:count])), tuple(sorted(cells[count:])))
    return {"prompt": f"How many {asked} squares?", "images": [draw_cells(colours)], "answer": str(count)}, layout


@VISUAL_TASKS.register("count_shapes")
def count_shapes_splits() -> tuple[list[Row], list[Row]]:
    """(6,000 training rows, 500 held-out rows) of `count_shapes`; answers 1..5, evenly spread."""
    held_out, held_layouts = [], set()
    rng = random.Random("count_shapes/eval")
    while len(held_out) < NUM_EVAL:
        row, layout = count_shapes_row(rng)
        if layout not in held_layouts:
            held_layouts.add(layout)
            held_out.append(row)
    train, rng = [], random.Random("count_shapes/train")
    while len(train) < NUM_TRAIN:
        row, layout = count_shapes_row(rng)
        if layout not in held_layouts:
            train.append(row)
    return train, held_out


@functools.cache
def visual_task_splits(task: str) -> tuple[list[Row], list[Row]]:
    """(training rows, held-out rows) of the visual task `task`, drawn once per process."""
    return VISUAL_TASKS.get(task)()
