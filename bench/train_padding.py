"""Seconds per training step and per logprob pass on a long-tailed batch: micro-batches trimmed to their own
rows (length-grouped, the default) against contiguous micro-batches at the batch's full width.

The batch is what an RL step looks like when a few responses run long: 512 rows, prompts of 8-12 tokens,
10% of the responses 40 tokens and the rest 4, in random order. Full width, every micro-batch pays for 40
response columns; length-grouped, the long rows share one or two micro-batches and the others are ~16
columns wide. The same `TorchBackend` runs both ways (`trim_micro_batches`, a real `backend_kwargs` knob),
on the bundled `tiny` model, with the actor's default loss; each backend starts from the same weights, so
the two losses are equal up to float rounding (printed as a check).

For each micro-batch size: one backend per way; rounds of one `forward_logprobs` and one `train_step` per
way, the two ways interleaved (so load from other processes hits both alike). The first `--warmup` rounds
are not timed (the first steps are 2-4x slower: Adam state, the allocator settling on each shape); the
fastest of the next `--repeats` is reported.

Usage: python bench/train_padding.py [--rows 512] [--micro-batch-sizes 256,64] [--threads 2] [--warmup 2]
                                     [--repeats 3]
Prints one JSON line: per micro-batch size the seconds of each way and full / trimmed. About 40 s on an idle
2-core CPU machine; on a loaded one the numbers mean little (look at the load average).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from rollflow.backends.torch_backend import TorchBackend


def long_tail_batch(rows: int, seed: int = 0):
    """`rows` samples: prompts of 8-12 tokens, 10% of responses 40 tokens and the rest 4, random advantages.

    Returns:
        The collated `Batch` with `extras["advantages"]` [B, T].
    """
    from rollflow.data.sample import Sample, collate

    gen = torch.Generator().manual_seed(seed)
    long_rows = set(torch.randperm(rows, generator=gen)[: rows // 10].tolist())
    samples = []
    for row in range(rows):
        prompt_length = int(torch.randint(8, 13, (1,), generator=gen))
        response_length = 40 if row in long_rows else 4
        tokens = torch.randint(3, 60, (prompt_length + response_length,), generator=gen).tolist()
        samples.append(Sample(prompt_ids=tokens[:prompt_length], response_ids=tokens[prompt_length:],
                              response_logprobs=[-1.0] * response_length, group_id=row // 8,
                              reward=float(row % 2)))
    batch = collate(samples, pad_token_id=0)
    batch.extras["advantages"] = torch.randn(rows, 1, generator=gen) * batch.response_mask  # [B, T]
    return batch


def measure(batch, micro_batch_size: int, warmup: int, repeats: int) -> dict[str, dict[str, float]]:
    """The fastest of `repeats` timed `forward_logprobs` and `train_step` calls of each way, after `warmup`
    untimed ones.

    Returns:
        {"full" | "trimmed": {"train_s", "logprobs_s", "loss" (of the first step)}}.
    """
    from rollflow.backends.base import TrainerSettings
    from rollflow.config import AlgorithmConfig
    from rollflow.workers.actor_loss import ActorLoss

    settings = TrainerSettings("tiny", lr=1e-5, micro_batch_size=micro_batch_size, device="cpu")
    loss_fn = ActorLoss(AlgorithmConfig(), temperature=1.0)
    backends = {"full": TorchBackend(settings, trim_micro_batches=False),
                "trimmed": TorchBackend(settings, trim_micro_batches=True)}
    results = {way: {"train_s": float("inf"), "logprobs_s": float("inf")} for way in backends}
    for round_index in range(warmup + repeats):
        for way, backend in backends.items():
            started = time.perf_counter()
            backend.forward_logprobs(batch)
            logprobs_s = time.perf_counter() - started
            started = time.perf_counter()
            loss = backend.train_step(batch, loss_fn)["loss"]
            train_s = time.perf_counter() - started
            results[way].setdefault("loss", loss)  # the first step's: both ways start from the same weights
            if round_index >= warmup:
                results[way]["logprobs_s"] = min(results[way]["logprobs_s"], logprobs_s)
                results[way]["train_s"] = min(results[way]["train_s"], train_s)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--micro-batch-sizes", default="256,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    batch = long_tail_batch(args.rows)
    result: dict[str, object] = {"bench": "train_padding", "rows": args.rows, "threads": args.threads,
                                 "width": [batch.prompt_length, batch.response_width],
                                 "load_average_1min": [os.getloadavg()[0]]}  # at the start and the end
    for micro_batch_size in (int(size) for size in args.micro_batch_sizes.split(",")):
        measured = measure(batch, micro_batch_size, args.warmup, args.repeats)
        full, trimmed = measured["full"], measured["trimmed"]
        result[f"micro_batch_{micro_batch_size}"] = {
            "train_s_full": round(full["train_s"], 3),
            "train_s_trimmed": round(trimmed["train_s"], 3),
            "train_ratio": round(full["train_s"] / trimmed["train_s"], 2),
            "logprobs_s_full": round(full["logprobs_s"], 3),
            "logprobs_s_trimmed": round(trimmed["logprobs_s"], 3),
            "logprobs_ratio": round(full["logprobs_s"] / trimmed["logprobs_s"], 2),
            "loss_diff": abs(full["loss"] - trimmed["loss"]),
        }
    result["load_average_1min"].append(os.getloadavg()[0])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
