"""Write the word-problem dataset of docs/sft.md: `What is 58 minus 23?` -> `35`, with `plus` and `minus`.

    python examples/word_problems/make_data.py --out data/word_problems

writes `train.jsonl` (rows `{"prompt", "answer"}`) and `eval.jsonl` (500 held-out rows, disjoint by operand
pair and operator). Operands are 10..99; a difference is never negative (the larger operand comes first).
The bundled model cannot even read these prompts (spaces, letters it never saw); a fresh ASCII model can.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def rows() -> list[dict[str, str]]:
    out = []
    for a in range(10, 100):
        for b in range(10, 100):
            out.append({"prompt": f"What is {a} plus {b}?", "answer": str(a + b)})
            if a >= b:
                out.append({"prompt": f"What is {a} minus {b}?", "answer": str(a - b)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("data/word_problems"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    everything = rows()
    random.Random(args.seed).shuffle(everything)
    held_out, train = everything[:500], everything[500:]
    args.out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train.jsonl", train), ("eval.jsonl", held_out)):
        (args.out / name).write_text("".join(json.dumps(row) + "\n" for row in part))
    print(f"{len(train)} train rows, {len(held_out)} held-out rows in {args.out}")


if __name__ == "__main__":
    main()
