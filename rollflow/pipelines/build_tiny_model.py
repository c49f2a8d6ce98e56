"""Build the bundled tiny model: a ~1M-parameter Qwen2 SFT-trained on two-digit addition to ~35-45%.

    python -m rollflow.pipelines.build_tiny_model --out rollflow/assets/tiny-qwen2-add --seed 0

It trains through the project's one training stack: chat rows become `Sample`s
(`rollflow.data.supervised`), `collate` pads them into a `Batch`, and a `torch` training backend takes one
optimizer step per batch with the `nll` objective. The randomly initialized model is saved to a temporary
directory first, and both the backend and an in-process `hf` engine (for evaluation) load it from there;
the engine receives the trained weights before every evaluation, as a rollout engine does.

SFT stops at the first evaluation where greedy accuracy on 200 held-out rows reaches
`--target-accuracy` (0.35). At that point the model answers in the right format (digits then `<eos>`)
but gets many sums wrong, which leaves RL (GRPO with an exact-match reward) plenty to improve.

The held-out rows are always `arithmetic_splits()`'s default split (seed 0, 500 rows), whatever
`--seed` is, so every consumer of the model can evaluate on rows it never saw. `--seed` sets the weight
initialization, the batch order and the sampling seeds of the temperature-1 diagnostics. Runs on one CPU
thread by default so a rebuild is bit-identical.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import transformers
from transformers import GenerationConfig, PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

from rollflow.backends import create_backend
from rollflow.backends.base import TrainerSettings
from rollflow.data.arithmetic import arithmetic_splits
from rollflow.data.char_tokenizer import build_char_tokenizer
from rollflow.data.sample import collate
from rollflow.data.supervised import chat_prompt_ids, encode_sft_rows, shuffled_batches
from rollflow.engines import create_engine
from rollflow.engines.base import Completion, GenerationRequest, SamplingParams
from rollflow.workers.objectives import OBJECTIVES

TINY_MODEL_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny-qwen2-add"
BUILD_INFO_FILE = "rollflow_build.json"

TASK = "add2"
NUM_EVAL_ROWS = 500  # the held-out split; the split itself uses arithmetic_splits' default seed
NUM_EVAL_ROWS_DURING_TRAINING = 200
LEARNING_RATE = 1e-3
WEIGHT_DECAY = 0.01  # torch.optim.AdamW's default, which the model has always been trained with
MAX_GRAD_NORM = 1.0
BATCH_SIZE = 128  # also the micro-batch size: one forward / backward pass per optimizer step
MAX_NEW_TOKENS = 4  # answers are at most 3 digits, plus <eos>
EVAL_BATCH_SIZE = 250  # most sequences the engine decodes together
SAMPLES_PER_PROMPT = 8  # for the temperature-1 diagnostics recorded next to the model
GENERATE_TIMEOUT_S = 600.0  # bound on one evaluation's generation (seconds on one CPU thread)


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


def save_untrained_model(path: str | Path, tokenizer: PreTrainedTokenizerBase) -> int:
    """Initialize the tiny model from torch's global RNG and save it with `tokenizer` in HF format.

    Args:
        path: the directory to write (the training backend and the engine load the model from it).
        tokenizer: the char tokenizer.

    Returns:
        The number of parameters.
    """
    model = Qwen2ForCausalLM(tiny_qwen2_config(tokenizer))
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        max_new_tokens=MAX_NEW_TOKENS,
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(parameter.numel() for parameter in model.parameters())


def trainer_settings(model_path: str) -> TrainerSettings:
    """The SFT trainer: AdamW (lr 1e-3, weight decay 0.01), constant LR, gradient norm clipped to 1, on CPU,
    one micro-batch per step."""
    return TrainerSettings(
        model_path=model_path,
        dtype="float32",
        lr=LEARNING_RATE,
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=MAX_GRAD_NORM,
        micro_batch_size=BATCH_SIZE,
        lr_schedule="constant",
        device="cpu",
    )


def main(argv: list[str] | None = None) -> int:
    """Build, train, evaluate and save the tiny model. Returns a process exit code."""
    args = parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)

    tokenizer = build_char_tokenizer()
    with tempfile.TemporaryDirectory(prefix="rollflow-tiny-model-") as initial_dir:
        num_params = save_untrained_model(initial_dir, tokenizer)
        backend = create_backend("torch", trainer_settings(initial_dir))
        engine = create_engine("hf", model_path=initial_dir, max_batch_size=EVAL_BATCH_SIZE, seed=args.seed,
                               device="cpu")
    print(f"Qwen2ForCausalLM with {num_params:,} parameters, vocabulary {len(tokenizer)}")

    train_rows, eval_rows = arithmetic_splits(TASK, num_eval=NUM_EVAL_ROWS)
    batches = shuffled_batches(encode_sft_rows(tokenizer, train_rows), BATCH_SIZE, seed=args.seed)
    loss_fn = OBJECTIVES["nll"]()
    try:
        step, accuracy = 0, 0.0
        while accuracy < args.target_accuracy:
            if step >= args.max_steps:
                print(
                    f"held-out accuracy {accuracy:.3f} < {args.target_accuracy} after {step} steps",
                    file=sys.stderr,
                )
                return 1
            step += 1
            metrics = backend.train_step(collate(next(batches), tokenizer.pad_token_id), loss_fn)
            if step % args.eval_every == 0:
                engine.update_weights(backend.named_weights(), version=step)
                accuracy = greedy_accuracy(
                    engine, tokenizer, eval_rows[:NUM_EVAL_ROWS_DURING_TRAINING], MAX_NEW_TOKENS
                )
                print(f"step {step:4d}  loss {metrics['loss']:.4f}  held-out greedy accuracy {accuracy:.3f}")

        engine.update_weights(backend.named_weights(), version=step)
        final = evaluate(engine, tokenizer, eval_rows, seed=args.seed)
    finally:
        engine.close()
    print(
        f"stopped after {step} steps: greedy accuracy {final['greedy_accuracy']:.3f} on {len(eval_rows)} held-out rows,"
        f" {final['greedy_well_formed']:.3f} well-formed; temperature 1: accuracy {final['sampled_accuracy']:.3f},"
        f" pass@{SAMPLES_PER_PROMPT} {final['sampled_pass_at_k']:.3f}"
    )

    args.out.mkdir(parents=True, exist_ok=True)
    backend.model.save_pretrained(args.out)  # the model alone: `backend.save` adds optimizer state
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
        "sft": {
            "learning_rate": LEARNING_RATE,
            "batch_size": BATCH_SIZE,
            "optimizer": "AdamW",
            "weight_decay": WEIGHT_DECAY,
            "max_grad_norm": MAX_GRAD_NORM,
            "backend": "torch",
            "objective": "nll",
        },
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


def generate(engine, requests: Sequence[GenerationRequest]) -> list[Completion]:
    """Run `requests` on an in-process engine (all submitted at once, so it batches them) and wait for all.

    Args:
        engine: an `InferenceEngine` that runs on the caller's event loop (`hf`).
        requests: the requests.

    Returns:
        One completion per request, in order. Raises TimeoutError after `GENERATE_TIMEOUT_S`.
    """

    async def generate_all() -> list[Completion]:
        pending = asyncio.gather(*(engine.generate(request) for request in requests))
        return await asyncio.wait_for(pending, GENERATE_TIMEOUT_S)

    return asyncio.run(generate_all())


def greedy_completions(
    engine, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], max_new_tokens: int
) -> list[list[int]]:
    """Greedy-decode an answer to each prompt (user message contents; the chat template is applied).

    Args:
        engine: an in-process inference engine (`hf`).
        tokenizer: the model's tokenizer (chat template).
        prompts: user message contents.
        max_new_tokens: generation budget per prompt.

    Returns:
        One list of generated token ids per prompt, in order, ending at (and including) the first eos
        token, or `max_new_tokens` long when no eos was produced.
    """
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    requests = [GenerationRequest(f"greedy-{index}", chat_prompt_ids(tokenizer, prompt), greedy)
                for index, prompt in enumerate(prompts)]
    return [completion.outputs[0].token_ids for completion in generate(engine, requests)]


def greedy_accuracy(
    engine, tokenizer: PreTrainedTokenizerBase, rows: Sequence[dict], max_new_tokens: int
) -> float:
    """Fraction of rows whose greedy completion, decoded without special tokens and stripped, equals
    `row["answer"]` exactly.

    Args:
        engine, tokenizer, max_new_tokens: as in `greedy_completions`.
        rows: `{"prompt": ..., "answer": ...}` dicts.

    Returns:
        Accuracy in [0, 1].
    """
    completions = greedy_completions(engine, tokenizer, [row["prompt"] for row in rows], max_new_tokens)
    return sum(_is_correct(ids, row, tokenizer) for ids, row in zip(completions, rows)) / len(rows)


def evaluate(engine, tokenizer: PreTrainedTokenizerBase, rows: list[dict], seed: int) -> dict[str, float]:
    """Greedy accuracy and answer format, plus temperature-1 sampling figures (what GRPO starts from).

    Args:
        engine: an in-process inference engine (`hf`) holding the weights to evaluate.
        tokenizer: the model's tokenizer.
        rows: `{"prompt": ..., "answer": ...}` dicts.
        seed: seeds the samples (request i draws with `SamplingParams.seed = seed * len(rows) + i`).

    Returns:
        `greedy_accuracy`; `greedy_well_formed`, the fraction of greedy completions that are 1-3 digits
        then eos; `sampled_accuracy`, the mean exact-match reward of `SAMPLES_PER_PROMPT` samples per row
        at temperature 1; and `sampled_pass_at_k`, the fraction of rows with at least one correct sample.
    """
    completions = greedy_completions(engine, tokenizer, [row["prompt"] for row in rows], MAX_NEW_TOKENS)
    accuracy = sum(_is_correct(ids, row, tokenizer) for ids, row in zip(completions, rows)) / len(rows)
    well_formed = sum(_is_digits_then_eos(ids, tokenizer) for ids in completions) / len(rows)

    requests = [
        GenerationRequest(
            f"sampled-{index}",
            chat_prompt_ids(tokenizer, row["prompt"]),
            SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, n=SAMPLES_PER_PROMPT,
                           seed=seed * len(rows) + index),
        )
        for index, row in enumerate(rows)
    ]
    correct = [
        [_is_correct(output.token_ids, row, tokenizer) for output in completion.outputs]
        for completion, row in zip(generate(engine, requests), rows)
    ]  # [rows][SAMPLES_PER_PROMPT]
    return {
        "greedy_accuracy": accuracy,
        "greedy_well_formed": well_formed,
        "sampled_accuracy": round(sum(map(sum, correct)) / (len(rows) * SAMPLES_PER_PROMPT), 4),
        "sampled_pass_at_k": round(sum(map(any, correct)) / len(rows), 4),
        "samples_per_prompt": SAMPLES_PER_PROMPT,
    }


def _is_correct(ids: list[int], row: dict, tokenizer: PreTrainedTokenizerBase) -> bool:
    return tokenizer.decode(ids, skip_special_tokens=True).strip() == row["answer"]


def _is_digits_then_eos(ids: list[int], tokenizer: PreTrainedTokenizerBase) -> bool:
    tokens = tokenizer.convert_ids_to_tokens(ids)
    return (
        2 <= len(tokens) <= 4 and tokens[-1] == tokenizer.eos_token and all(t.isdigit() for t in tokens[:-1])
    )


if __name__ == "__main__":
    sys.exit(main())
