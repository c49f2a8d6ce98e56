"""Write the synthetic preference set of docs/sft.md: for each two-digit sum, the right answer (chosen) and a
wrong one (rejected, off by 1 to 10).

    python examples/preferences/make_pairs.py --out data/add2_pairs

writes `train.jsonl` from add2's training rows and `eval.jsonl` from its 500 held-out rows (the split of
`rollflow.data.arithmetic.arithmetic_splits`), each row `{"prompt", "chosen", "rejected", "answer"}`.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from rollflow.data.arithmetic import arithmetic_splits


def pairs(rows: list[dict], rng: random.Random) -> list[dict]:
    out = []
    for row in rows:
        right = int(row["answer"])
        wrong = right + rng.choice([-1, 1]) * rng.randint(1, 10)
        if wrong < 0:
            wrong = right + rng.randint(1, 10)
        out.append({"prompt": row["prompt"], "chosen": row["answer"], "rejected": str(wrong),
                    "answer": row["answer"]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("data/add2_pairs"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    train, held_out = arithmetic_splits("add2", seed=0)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", train), ("eval.jsonl", held_out)):
        (args.out / name).write_text("".join(json.dumps(row) + "\n" for row in pairs(rows, rng)))
    print(f"{len(train)} train pairs, {len(held_out)} held-out pairs in {args.out}")


if __name__ == "__main__":
    main()
