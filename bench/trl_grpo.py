"""TRL reference: `trl.GRPOTrainer` doing rollflow's quickstart job, for start-up and per-step overhead.

Same job as `examples/quickstart.yaml`: the bundled tiny model (1M-parameter Qwen2, character tokenizer with a
chat template), add2 train prompts as conversational `prompt` messages (TRL applies the chat template), the
`math_answer` reward, GRPO with group-std scaling, beta=0 (no reference model), clip 0.2, lr 2e-4 with 5 warm-up
steps then cosine to 0, AdamW (0.9, 0.999), grad norm 1.0, 6 new tokens at temperature 1.0, fp32 on CPU with
2 torch threads. One generation round and one optimizer step over all P*G samples per step.

Measures, in this one process: `startup_s` (process start, read from /proc, to the first step's start),
`median_step_s` (wall time between consecutive step ends, over the steps after the first 2) and
`samples_per_s` = P*G / median_step_s, the peak RSS and PSS (MiB) summed over this process and its
descendants, the most processes and threads in that tree, and `final_reward` (mean reward of the last 5 steps).

TRL is not a rollflow dependency; make an environment that also sees torch, transformers and rollflow:

    python -m venv --system-site-packages /tmp/trlenv && /tmp/trlenv/bin/pip install trl
    /tmp/trlenv/bin/python bench/trl_grpo.py --prompts 8 --samples 8 --steps 30

Prints one JSON line on stdout; logs go to stderr.

Differences from rollflow that matter for fairness:
- Generation is `model.generate` (KV cache, static batch) on P*G rows: each prompt is repeated G times and
  prefilled G times, and the batch runs until its longest row stops; rollflow's `hf` engine prefills a prompt
  once for its G samples and drops rows as they finish (continuous batching).
- Generation and training share one process and one model (no weight sync, no Ray); rollflow runs
  them in separate workers.
- The train forward/backward runs all P*G samples as one micro-batch; the quickstart uses micro-batches of
  256 (same update: both normalize the loss over the whole batch's tokens).
- Rewards of completions that are not plain numbers go to math-verify's helper process (as in rollflow),
  which `processes` counts.
- Prompt order differs (TRL's seeded RepeatSampler vs rollflow's loader), so rewards match only on average.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

TORCH_THREADS = 2  # the benchmark machine's cores


def process_start_time() -> float:
    """Epoch seconds at which this process started, so start-up includes the interpreter and every import.

    /proc/self/stat gives the start in clock ticks since boot; /proc/uptime (10 ms resolution, unlike the
    whole-second boot time in /proc/stat) says how long ago boot was.
    """
    start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22
    uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - (uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))


class TreeSampler:
    """Peak summed RSS / PSS, process count and thread count of this process and its descendants (0.2 s)."""

    def __init__(self, interval_s: float = 0.2):
        self.interval_s = interval_s
        self.peak = {"rss_kb": 0, "pss_kb": 0, "processes": 0, "threads": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tree-sampler", daemon=True)

    def __enter__(self):
        if self.interval_s > 0:  # 0: no sampling (reading smaps_rollup costs CPU a timing run should not pay)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.interval_s > 0:
            self._thread.join(5)
            self.sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        total = {"rss_kb": 0, "pss_kb": 0, "processes": 0, "threads": 0}
        pending = [os.getpid()]
        while pending:
            pid = pending.pop()
            with contextlib.suppress(OSError, ValueError):  # a process may exit between reads
                status = _kb_fields(Path(f"/proc/{pid}/status").read_text(), ("VmRSS", "Threads"))
                rollup = _kb_fields(Path(f"/proc/{pid}/smaps_rollup").read_text(), ("Pss",))
                total["rss_kb"] += status.get("VmRSS", 0)
                total["threads"] += status.get("Threads", 0)
                total["pss_kb"] += rollup.get("Pss", 0)
                total["processes"] += 1
                for children in Path(f"/proc/{pid}/task").glob("*/children"):
                    pending.extend(int(child) for child in children.read_text().split())
        for key, value in total.items():
            self.peak[key] = max(self.peak[key], value)


def _kb_fields(text: str, names: tuple[str, ...]) -> dict[str, int]:
    """`Name:   123 kB` lines of a /proc file as {Name: 123}, for the given names."""
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in names:
            values[name] = int(rest.split()[0])
    return values


def math_reward(completions, answer, **kwargs) -> list[float]:
    """TRL reward function: rollflow's `math_answer` on each completion's text (conversational: a message list)."""
    from rollflow.rewards.math import math_answer

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [math_answer(text, answer=a) for text, a in zip(texts, answer, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--memory-interval", type=float, default=0.2,
                        help="seconds between memory samples of the process tree; 0: none (a timing run)")
    args = parser.parse_args()
    started = process_start_time()
    stdout, sys.stdout = sys.stdout, sys.stderr  # the Trainer prints its logs; stdout carries only the JSON

    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rollflow.data.arithmetic import arithmetic_splits
    from rollflow.models import BUNDLED_MODELS

    torch.set_num_threads(TORCH_THREADS)
    train_rows, _ = arithmetic_splits("add2", seed=0)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": r["prompt"]}] for r in train_rows],
                                 "answer": [r["answer"] for r in train_rows]})
    model_dir = str(BUNDLED_MODELS["tiny"])
    batch = args.prompts * args.samples

    class StepClock(TrainerCallback):
        def __init__(self):
            self.first_begin, self.ends, self.rewards = None, [], []

        def on_step_begin(self, args, state, control, **kwargs):
            if self.first_begin is None:
                self.first_begin = time.time()

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.time())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.rewards.append(logs["reward"])

    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as output_dir, TreeSampler(args.memory_interval) as tree:
        config = GRPOConfig(
            output_dir=output_dir, report_to="none", save_strategy="no", eval_strategy="no",
            use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,  # TRL defaults: bf16, checkpointing
            seed=0, dataloader_num_workers=0, logging_steps=1, disable_tqdm=True,
            # HF's warm-up starts at lr 0 on the first step (rollflow's at lr/5): the schedule lags one step.
            max_steps=args.steps, learning_rate=2e-4, warmup_steps=5, lr_scheduler_type="cosine",
            weight_decay=0.0, max_grad_norm=1.0,
            # One generation round of P*G samples and one optimizer step per training step.
            per_device_train_batch_size=batch, gradient_accumulation_steps=1, steps_per_generation=1,
            num_generations=args.samples, num_iterations=1,
            max_completion_length=6, temperature=1.0, top_p=1.0, top_k=0,
            beta=0.0, epsilon=0.2, scale_rewards="group",
            # "dapo": sum of token losses / active tokens of the whole batch = rollflow's token_mean. With one
            # process and one micro-batch it equals "bnpo" (which normalizes per micro-batch).
            loss_type="dapo",
        )
        clock = StepClock()
        trainer = GRPOTrainer(model=model_dir, reward_funcs=math_reward, args=config, train_dataset=dataset,
                              processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[clock])
        trainer.train()

    steps = [clock.ends[0] - clock.first_begin] + [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    median_step = statistics.median(steps[2:] or steps)
    result = {
        "impl": "trl", "trl_version": trl.__version__, "prompts": args.prompts, "samples": args.samples,
        "steps": args.steps, "torch_threads": TORCH_THREADS,
        "startup_s": round(clock.first_begin - started, 2),
        "median_step_s": round(median_step, 3),
        "samples_per_s": round(batch / median_step, 1),
        "peak_rss_mb": round(tree.peak["rss_kb"] / 1024, 1),
        "peak_pss_mb": round(tree.peak["pss_kb"] / 1024, 1),
        "processes": tree.peak["processes"], "threads": tree.peak["threads"],
        "final_reward": round(statistics.mean(clock.rewards[-5:]), 3) if clock.rewards else None,
    }
    print(json.dumps(result), file=stdout, flush=True)


if __name__ == "__main__":
    main()
