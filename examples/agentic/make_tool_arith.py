"""Data for examples/agentic_tools.yaml: multiplications the tiny model cannot do in its head, and scripted
calculator traces for its SFT stage.

Writes, under --out:
- `train.jsonl`, `eval.jsonl`: prompt rows `{"prompt": "347*29", "answer": "10063"}` (a 3-digit times a 2-digit
  number), the RL env's episodes (`env: prompts` inside `tool_use`); the eval rows are held out.
- `sft_train.jsonl`, `sft_eval.jsonl`: chat rows with the calculator's schema in `tools`, in the format the RL
  rollout renders (the tokenizer's chat template with `tools=`): the user's prompt, the model's
  `<tool_call>` turn, the calculator's answer as a `tool` turn, the model's answer. The deliberate mistake:
  on prompts whose first digit is 1 to 4, 90% of the traces (`--mistake-rate`, chosen by a hash of the prompt)
  answer at once, without the tool, and wrongly. The SFT model learns to guess on those prompts (greedy
  decoding follows the majority) while it still samples a call now and then; RL, which pays right answers
  only, has that to fix. (Mistakes on a hash alone would not do: a model cannot learn a hash, so greedy
  decoding would call the tool everywhere.)

    python examples/agentic/make_tool_arith.py --out data/tool_arith
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

from rollflow.tools.base import make_tools


def problems(seed: int) -> list[tuple[int, int]]:
    """Every a*b with a in 100..999 and b in 10..99, shuffled by `seed`."""
    pairs = [(a, b) for a in range(100, 1000) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    return pairs


GUESSED_FIRST_DIGITS = "1234"  # the prompts on which the scripted traces mostly guess


def guessed(prompt: str, answer: int, mistake_rate: float) -> str | None:
    """The wrong answer this prompt's trace writes without the tool, or None when the trace calls the tool."""
    digest = int(hashlib.sha256(prompt.encode()).hexdigest(), 16)
    if prompt[0] not in GUESSED_FIRST_DIGITS or (digest % 1000) / 1000 >= mistake_rate:
        return None
    text = list(str(answer))
    position = (digest // 1000) % len(text)
    text[position] = str((int(text[position]) + 1 + (digest // 10_000) % 8) % 10)  # one digit off
    return "".join(text).lstrip("0") or "1"


def trace(a: int, b: int, calculator, mistake_rate: float) -> dict:
    """The SFT chat row of one prompt (see the module docstring)."""
    prompt, answer = f"{a}*{b}", a * b
    tools = [calculator.schema()]
    wrong = guessed(prompt, answer, mistake_rate)
    if wrong is not None:
        return {"tools": tools, "messages": [{"role": "user", "content": prompt},
                                             {"role": "assistant", "content": wrong}]}
    arguments = {"expression": prompt}
    call = "<tool_call>\n" + json.dumps({"name": calculator.name, "arguments": arguments}) + "\n</tool_call>"
    result = calculator.call(arguments)
    return {"tools": tools, "messages": [
        {"role": "user", "content": prompt}, {"role": "assistant", "content": call},
        {"role": "tool", "content": result}, {"role": "assistant", "content": result}]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/tool_arith")
    parser.add_argument("--eval", type=int, default=200, help="held-out prompts (RL eval)")
    parser.add_argument("--sft", type=int, default=6000, help="prompts of the SFT traces (from the train rows)")
    parser.add_argument("--mistake-rate", type=float, default=0.9,
                        help="share of the traces of prompts whose first digit is 1-4 that guess, wrongly")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pairs = problems(args.seed)
    held_out, train = pairs[: args.eval], pairs[args.eval:]
    calculator = make_tools(["calculator"])[0]
    files = {
        "train.jsonl": [{"prompt": f"{a}*{b}", "answer": str(a * b)} for a, b in train],
        "eval.jsonl": [{"prompt": f"{a}*{b}", "answer": str(a * b)} for a, b in held_out],
        "sft_train.jsonl": [trace(a, b, calculator, args.mistake_rate) for a, b in train[: args.sft]],
        "sft_eval.jsonl": [trace(a, b, calculator, args.mistake_rate) for a, b in held_out],
    }
    for name, rows in files.items():
        with open(out / name, "w") as file:
            for row in rows:
                file.write(json.dumps(row) + "\n")
        print(f"{name}: {len(rows)} rows -> {out / name}")


if __name__ == "__main__":
    main()
