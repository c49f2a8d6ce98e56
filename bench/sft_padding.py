"""SFT tokens per second with length-grouped, trimmed micro-batches (the default) against contiguous
micro-batches at the batch's full width, on a batch of mixed-length conversations.

The batch is what SFT data looks like when a few rows are long: 512 rows, 90% one-line word problems
(`What is 58 minus 23?` -> `35`, ~30 tokens) and 10% multi-turn chats of ~200 tokens, in random order,
encoded by the pipelines' `ConversationEncoder` with the ASCII tokenizer of the bundled `tiny` model. Full
width, every micro-batch pays for the longest row; length-grouped, the long rows share one or two
micro-batches. The same `TorchBackend` runs both ways (`trim_micro_batches`, a `backend_kwargs` knob) with
the `nll` objective, from the same weights (the first losses are printed as a check). Rounds of one
`train_step` per way, interleaved; the first `--warmup` rounds untimed, the fastest of `--repeats` reported.
Tokens per second counts trained (assistant) tokens.

Usage: python bench/sft_padding.py [--rows 512] [--micro-batch-size 64] [--threads 2]
Prints one JSON line. About 30 s on an idle 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

from rollflow.backends.base import TrainerSettings
from rollflow.backends.torch_backend import TorchBackend
from rollflow.data.sample import collate
from rollflow.data.supervised import ConversationEncoder
from rollflow.models import load_tokenizer
from rollflow.workers.objectives import NLLLoss


def mixed_rows(rows: int, seed: int = 0) -> list[dict]:
    """90% word problems, 10% chats of three exchanges with ~30-character turns."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if rng.random() < 0.1:
            turns = []
            for _ in range(3):
                turns.append({"role": "user", "content": f"Add {a} and {b}, then explain the carry step."})
                turns.append({"role": "assistant", "content": f"{a} plus {b} is {a + b}; the ones carry over."})
                a, b = rng.randint(10, 99), rng.randint(10, 99)
            out.append({"messages": turns})
        else:
            out.append({"prompt": f"What is {a} plus {b}?", "response": str(a + b)})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    encoder = ConversationEncoder(load_tokenizer("tiny"), max_tokens=256)
    samples = [encoder.encode(row) for row in mixed_rows(args.rows)]
    batch = collate(samples, pad_token_id=0)
    tokens = float(batch.response_mask.sum())
    settings = TrainerSettings("tiny", lr=1e-5, micro_batch_size=args.micro_batch_size, device="cpu")
    backends = {"full": TorchBackend(settings, trim_micro_batches=False),
                "trimmed": TorchBackend(settings, trim_micro_batches=True)}
    best = {way: float("inf") for way in backends}
    first_loss = {}
    for round_index in range(args.warmup + args.repeats):
        for way, backend in backends.items():
            started = time.perf_counter()
            loss = backend.train_step(batch, NLLLoss())["loss"]
            seconds = time.perf_counter() - started
            first_loss.setdefault(way, loss)
            if round_index >= args.warmup:
                best[way] = min(best[way], seconds)
    print(json.dumps({
        "bench": "sft_padding", "rows": args.rows, "micro_batch_size": args.micro_batch_size,
        "threads": args.threads, "width": batch.input_ids.shape[1], "trained_tokens": int(tokens),
        "tokens_per_s_full": round(tokens / best["full"]), "tokens_per_s_trimmed": round(tokens / best["trimmed"]),
        "speedup": round(best["full"] / best["trimmed"], 2),
        "loss_diff": abs(first_loss["full"] - first_loss["trimmed"]), "load_average_1min": os.getloadavg()[0],
    }))


if __name__ == "__main__":
    main()
