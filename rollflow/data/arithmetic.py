"""Built-in synthetic arithmetic tasks: deterministic prompt/answer rows with a fixed held-out split.

A task enumerates every problem it can pose, in a fixed order; `arithmetic_splits` shuffles that list
with the seed and cuts off the held-out rows. Because each problem appears exactly once, train and
held-out rows never share an operand pair.

Rows are plain dicts, the shape every rollflow dataset row has:

    {"prompt": "23+58", "answer": "81"}

`prompt` is the user message content (no chat markup; the tokenizer's chat template adds it) and
`answer` is the exact string a correct completion must produce.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from rollflow.registry import Registry

Row = dict[str, str]

ARITHMETIC_TASKS: Registry[Callable[[], list[Row]]] = Registry("arithmetic task")


@ARITHMETIC_TASKS.register("add2")
def addition_two_digit_rows() -> list[Row]:
    """Every `a+b` with `a` and `b` in 10..99: 8,100 rows, answers 20..198 (2 or 3 digits).

    Both operands have exactly two digits, so every prompt is 5 characters and each digit sits at the
    same position in every prompt. A small model learns this layout far faster, under SFT and under
    RL, than one with 0..99 operands, where the prompt length varies.

    Returns:
        Rows `{"prompt": f"{a}+{b}", "answer": str(a + b)}` in order of (a, b).
    """
    return [{"prompt": f"{a}+{b}", "answer": str(a + b)} for a in range(10, 100) for b in range(10, 100)]


@ARITHMETIC_TASKS.register("sum3")
def sum_three_one_digit_rows() -> list[Row]:
    """Every `a+b+c` with `a`, `b` and `c` in 0..9: 1,000 rows, answers 0..27 (1 or 2 digits).

    A second domain for multi-domain runs that the bundled tiny model's tokenizer covers (digits and `+`).
    The model was trained on `add2` only: it answers few of these at first (greedy accuracy ~0.01).

    Returns:
        Rows `{"prompt": f"{a}+{b}+{c}", "answer": str(a + b + c)}` in order of (a, b, c).
    """
    return [{"prompt": f"{a}+{b}+{c}", "answer": str(a + b + c)}
            for a in range(10) for b in range(10) for c in range(10)]


def default_num_eval(num_rows: int) -> int:
    """Held-out rows of a task of `num_rows` problems: a fifth of them, at most 500 (add2: 500, sum3: 200)."""
    return min(500, num_rows // 5)


def arithmetic_splits(task: str = "add2", seed: int = 0,
                      num_eval: int | None = None) -> tuple[list[Row], list[Row]]:
    """Split a task's problems into shuffled train rows and a held-out eval set fixed by `seed`.

    Args:
        task: name in `ARITHMETIC_TASKS` ("add2", "sum3").
        seed: shuffling seed; the same seed always gives identical rows in identical order.
        num_eval: number of held-out rows, the rest are train rows; None: `default_num_eval` (500 for add2).

    Returns:
        `(train_rows, eval_rows)`, disjoint, together covering every problem of the task once.
    """
    rows = ARITHMETIC_TASKS.get(task)()
    num_eval = default_num_eval(len(rows)) if num_eval is None else num_eval
    if not 0 < num_eval < len(rows):
        raise ValueError(f"num_eval must be in 1..{len(rows) - 1} for task {task!r}, got {num_eval}")
    # A private Random instance: independent of (and not disturbing) the global random state.
    random.Random(seed).shuffle(rows)
    return rows[num_eval:], rows[:num_eval]
