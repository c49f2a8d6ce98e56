"""Build the bundled tiny model: a ~1M-parameter Qwen2 SFT-trained on two-digit addition to ~35-45%.

    python -m rollflow.pipelines.build_tiny_model --out rollflow/assets/tiny-qwen2-add --seed 0

SFT stops at the first evaluation where greedy accuracy on 200 held-out rows reaches
`--target-accuracy` (0.35). At that point the model answers in the right format (digits then `<eos>`)
but gets many sums wrong, which leaves RL (GRPO with an exact-match reward) plenty to improve.

The held-out rows are always `arithmetic_splits()`'s default split (seed 0, 500 rows), whatever
`--seed` is, so every consumer of the model can evaluate on rows it never saw. `--seed` sets the weight
initialization and the batch order. Runs on one CPU thread by default so a rebuild is bit-identical.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import GenerationConfig, PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

from rollflow.data.arithmetic import arithmetic_splits
from rollflow.data.char_tokenizer import build_char_tokenizer
from rollflow.pipelines.sft import (
    chat_prompt_text,
    collate_sft,
    encode_sft_rows,
    greedy_accuracy,
    greedy_completions,
    sft_train_step,
    shuffled_batches,
)

TINY_MODEL_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny-qwen2-add"
BUILD_INFO_FILE = "rollflow_build.json"

TASK = "add2"
NUM_EVAL_ROWS = 500  # the held-out split; the split itself uses arithmetic_splits' default seed
NUM_EVAL_ROWS_DURING_TRAINING = 200
LEARNING_RATE = 1e-3
BATCH_SIZE = 128
MAX_NEW_TOKENS = 4  # answers are at most 3 digits, plus <eos>
EVAL_BATCH_SIZE = 250
SAMPLES_PER_PROMPT = 8  # for the temperature-1 diagnostics recorded next to the model


def tiny_qwen2_config(tokenizer: PreTrainedTokenizerBase, **overrides) -> Qwen2Config:
    """The tiny model's architecture: hidden 128, 4 layers, 4 query / 2 key-value heads, tied embeddings.

    The vocabulary is exactly the tokenizer's; 64 positions cover any arithmetic prompt and answer.
    `overrides` (e.g. `hidden_size=32, num_hidden_layers=1`) give smaller models of the same family for tests.
    """
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    return Qwen2Config(**{**settings, **overrides})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m rollflow.pipelines.build_tiny_model", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="directory to write the model into")
    parser.add_argument("--seed", type=int, default=0, help="weight initialization and batch order")
    parser.add_argument("--target-accuracy", type=float, default=0.35, help="stop SFT once reached")
    parser.add_argument("--eval-every", type=int, default=25, help="SFT steps between evaluations")
    parser.add_argument("--max-steps", type=int, default=2000, help="give up if the target is not reached")
    parser.add_argument("--num-threads", type=int, default=1, help="torch CPU threads")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Build, train, evaluate and save the tiny model. Returns a process exit code."""
    args = parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)

    tokenizer = build_char_tokenizer()
    model = Qwen2ForCausalLM(tiny_qwen2_config(tokenizer))
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        max_new_tokens=MAX_NEW_TOKENS,
    )
    num_params = sum(parameter.numel() for parameter in model.parameters())
    print(f"Qwen2ForCausalLM with {num_params:,} parameters, vocabulary {len(tokenizer)}")

    train_rows, eval_rows = arithmetic_splits(TASK, num_eval=NUM_EVAL_ROWS)
    batches = shuffled_batches(encode_sft_rows(tokenizer, train_rows), BATCH_SIZE, seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)

    step, accuracy = 0, 0.0
    while accuracy < args.target_accuracy:
        if step >= args.max_steps:
            print(
                f"held-out accuracy {accuracy:.3f} < {args.target_accuracy} after {step} steps",
                file=sys.stderr,
            )
            return 1
        step += 1
        metrics = sft_train_step(model, optimizer, collate_sft(next(batches), tokenizer.pad_token_id))
        if step % args.eval_every == 0:
            accuracy = greedy_accuracy(
                model, tokenizer, eval_rows[:NUM_EVAL_ROWS_DURING_TRAINING], EVAL_BATCH_SIZE, MAX_NEW_TOKENS
            )
            print(f"step {step:4d}  loss {metrics['loss']:.4f}  held-out greedy accuracy {accuracy:.3f}")

    final = evaluate(model, tokenizer, eval_rows, seed=args.seed)
    print(
        f"stopped after {step} steps: greedy accuracy {final['greedy_accuracy']:.3f} on {len(eval_rows)} held-out rows,"
        f" {final['greedy_well_formed']:.3f} well-formed; temperature 1: accuracy {final['sampled_accuracy']:.3f},"
        f" pass@{SAMPLES_PER_PROMPT} {final['sampled_pass_at_k']:.3f}"
    )

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    build_info = {
        "command": f"python -m rollflow.pipelines.build_tiny_model --out {args.out} --seed {args.seed}",
        "seed": args.seed,
        "task": TASK,
        "eval_split": {
            "function": "rollflow.data.arithmetic.arithmetic_splits",
            "seed": 0,
            "num_eval": NUM_EVAL_ROWS,
        },
        "sft": {"learning_rate": LEARNING_RATE, "batch_size": BATCH_SIZE, "optimizer": "AdamW"},
        "steps": step,
        "stop_rule": f"first eval (every {args.eval_every} steps, {NUM_EVAL_ROWS_DURING_TRAINING} held-out rows) "
        f"with greedy accuracy >= {args.target_accuracy}",
        "stop_accuracy": accuracy,
        "eval": final,
        "num_parameters": num_params,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (args.out / BUILD_INFO_FILE).write_text(json.dumps(build_info, indent=2) + "\n")
    print(f"saved to {args.out} in {time.perf_counter() - started:.0f} s")
    return 0


def evaluate(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase, rows: list[dict], seed: int
) -> dict[str, float]:
    """Greedy accuracy and answer format, plus temperature-1 sampling figures (what GRPO starts from).

    Returns:
        `greedy_accuracy`; `greedy_well_formed`, the fraction of greedy completions that are 1-3 digits
        then eos; `sampled_accuracy`, the mean exact-match reward of `SAMPLES_PER_PROMPT` samples per row
        at temperature 1; and `sampled_pass_at_k`, the fraction of rows with at least one correct sample.
    """
    accuracy = greedy_accuracy(model, tokenizer, rows, EVAL_BATCH_SIZE, MAX_NEW_TOKENS)
    completions = greedy_completions(
        model, tokenizer, [row["prompt"] for row in rows], EVAL_BATCH_SIZE, MAX_NEW_TOKENS
    )
    well_formed = sum(_is_digits_then_eos(ids, tokenizer) for ids in completions) / len(rows)

    torch.manual_seed(seed)
    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=MAX_NEW_TOKENS,
        num_return_sequences=SAMPLES_PER_PROMPT,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    texts = [chat_prompt_text(tokenizer, row["prompt"]) for row in rows]
    encoded = tokenizer(
        texts, padding=True, padding_side="left", add_special_tokens=False, return_tensors="pt"
    )
    model.eval()
    with torch.inference_mode():
        sequences = model.generate(**encoded, generation_config=config)  # [B * k, P + N]
    answers = tokenizer.batch_decode(sequences[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
    correct = torch.tensor(
        [
            answer.strip() == rows[index // SAMPLES_PER_PROMPT]["answer"]
            for index, answer in enumerate(answers)
        ]
    ).view(len(rows), SAMPLES_PER_PROMPT)  # [B, k]
    return {
        "greedy_accuracy": accuracy,
        "greedy_well_formed": well_formed,
        "sampled_accuracy": round(correct.float().mean().item(), 4),
        "sampled_pass_at_k": round(correct.any(dim=1).float().mean().item(), 4),
        "samples_per_prompt": SAMPLES_PER_PROMPT,
    }


def _is_digits_then_eos(ids: list[int], tokenizer: PreTrainedTokenizerBase) -> bool:
    tokens = tokenizer.convert_ids_to_tokens(ids)
    return (
        2 <= len(tokens) <= 4 and tokens[-1] == tokenizer.eos_token and all(t.isdigit() for t in tokens[:-1])
    )


if __name__ == "__main__":
    sys.exit(main())
