"""Write the small datasets of docs/sft.md#a-few-hundred-rows: rows of a task the bundled model never saw.

    python examples/small_data/make_data.py --out data/small
    python examples/small_data/make_data.py --task add3 --sft-rows 1000 --out data/add3

`--task sub2` (the default): two-digit subtraction, `58-23` -> `35` (the larger operand first, so answers are
0..89). The bundled tiny model was trained on `23+58` only: it reads these prompts (digits and `-` are in its
tokenizer) but answers them as sums, greedy accuracy 0.

`--task add3`: three-digit addition, `641+159` -> `800`, operand pairs drawn from 100..999 (the bundled model
answers with two-digit sums: accuracy 0; under SFT it stays near 0 for its first ~100 steps, then takes off:
docs/sft.md#early-stopping).

`--task mul1`: a two- or three-digit number times one digit, `347*6` -> `2082` (slow to learn for the tiny
model: docs/sft.md#early-stopping).

Rows are `{"prompt", "answer"}`, disjoint by operand pair:

- `sft.jsonl`: `--sft-rows` (200) rows for SFT, which carves its validation split from them;
- `rl.jsonl`: `--rl-rows` (200) more rows, which only RL sees;
- `test.jsonl`: 500 held-out rows, the test set: reported, never chosen on.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def subtraction_rows(count: int, seed: int) -> list[dict[str, str]]:
    """Every `a-b` with `a` and `b` in 10..99 and `a >= b`: 4,095 rows (`count` and `seed` unused)."""
    return [{"prompt": f"{a}-{b}", "answer": str(a - b)} for a in range(10, 100) for b in range(10, a + 1)]


def three_digit_sums(count: int, seed: int) -> list[dict[str, str]]:
    """`count` distinct `a+b` with `a` and `b` in 100..999 (all 810,000 at most), drawn with `seed`, in operand
    order."""
    rng, pairs, count = random.Random(seed), set(), min(count, 900 * 900)
    while len(pairs) < count:
        pairs.add((rng.randint(100, 999), rng.randint(100, 999)))
    return [{"prompt": f"{a}+{b}", "answer": str(a + b)} for a, b in sorted(pairs)]


def one_digit_products(count: int, seed: int) -> list[dict[str, str]]:
    """Every `b*a` with `b` in 10..999 and `a` in 2..9: 7,920 rows (`count` and `seed` unused)."""
    return [{"prompt": f"{b}*{a}", "answer": str(a * b)} for a in range(2, 10) for b in range(10, 1000)]


TASKS = {"sub2": subtraction_rows, "add3": three_digit_sums, "mul1": one_digit_products}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("data/small"))
    parser.add_argument("--sft-rows", type=int, default=200, help="rows for SFT (and its validation split)")
    parser.add_argument("--rl-rows", type=int, default=200, help="more rows, for RL only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task", choices=sorted(TASKS), default="sub2", help="sub2 (default), add3 or mul1")
    args = parser.parse_args()
    everything = TASKS[args.task](500 + args.sft_rows + args.rl_rows, args.seed)
    if args.sft_rows < 1 or args.rl_rows < 0 or args.sft_rows + args.rl_rows > len(everything) - 500:
        parser.error(f"--sft-rows (at least 1) and --rl-rows together are at most {len(everything) - 500}")
    random.Random(args.seed).shuffle(everything)
    test, rest = everything[:500], everything[500:]
    parts = {"sft.jsonl": rest[:args.sft_rows], "rl.jsonl": rest[args.sft_rows: args.sft_rows + args.rl_rows],
             "test.jsonl": test}
    args.out.mkdir(parents=True, exist_ok=True)
    for name, part in parts.items():
        (args.out / name).write_text("".join(json.dumps(row) + "\n" for row in part))
    print(f"{args.sft_rows} SFT rows, {args.rl_rows} RL rows, {len(test)} held-out test rows in {args.out}")


if __name__ == "__main__":
    main()
