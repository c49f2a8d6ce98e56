"""A fresh (randomly initialized) small Qwen2 causal LM with the character-level ASCII tokenizer.

    rollflow new-model --out models/fresh --seed 0

The architecture defaults are the bundled tiny model's (`rollflow.pipelines.build_tiny_model`): hidden
128, 4 layers, 4 query / 2 key-value heads, MLP 512, tied embeddings, float32; with the 262-token
`build_ascii_tokenizer` vocabulary and 256 positions that is 1,018,752 parameters. The directory it writes is
a plain Hugging Face model directory (`config.json` says `model_type: qwen2`), so `rollflow.models`, the
engines and the training backends load it like any other model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

from rollflow.data.char_tokenizer import build_ascii_tokenizer
from rollflow.errors import ConfigError


def fresh_qwen2_config(
    tokenizer: PreTrainedTokenizerBase,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    max_positions: int = 256,
    **extra,
) -> Qwen2Config:
    """The config of a small Qwen2 whose vocabulary is exactly `tokenizer`'s.

    Args:
        tokenizer: gives the vocabulary size (`len(tokenizer)`) and the pad / eos ids.
        hidden_size: width of the residual stream.
        num_layers: decoder layers.
        num_heads: query heads; `hidden_size / num_heads` is the head size, which must be even (rotary
            embeddings rotate pairs of dimensions).
        num_kv_heads: key-value heads; must divide `num_heads` (grouped-query attention).
        intermediate_size: width of each MLP.
        max_positions: the context length, prompt and response together.
        **extra: other `Qwen2Config` fields (e.g. `initializer_range`, `num_labels` for a reward model).

    Returns:
        A float32 `Qwen2Config` with tied input / output embeddings and no bos token.

    Raises:
        ConfigError: a size that is not a positive integer, or heads that do not divide (one line naming
            the numbers to change).
    """
    sizes = {"hidden_size": hidden_size, "num_layers": num_layers, "num_heads": num_heads,
             "num_kv_heads": num_kv_heads, "intermediate_size": intermediate_size, "max_positions": max_positions}
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if hidden_size % num_heads:
        raise ConfigError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}; change one so "
                          "that it is")
    if (hidden_size // num_heads) % 2:
        raise ConfigError(f"the head size hidden_size / num_heads = {hidden_size // num_heads} is odd, and rotary "
                          "embeddings need an even one; change hidden_size or num_heads")
    if num_heads % num_kv_heads:
        raise ConfigError(f"num_heads {num_heads} is not divisible by num_kv_heads {num_kv_heads}; change one so "
                          "that it is")
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        dtype="float32",
        **extra,
    )


def save_fresh_model(out_dir: str | Path, seed: int = 0, **sizes: int) -> int:
    """Randomly initialize a small Qwen2 causal LM and save it, with the ASCII tokenizer, in HF format.

    The weights depend only on `seed` and the sizes: they are drawn from a forked torch RNG, so the
    caller's global RNG state is left as it was.

    Args:
        out_dir: the directory to write; it must not exist or be empty.
        seed: seeds the weight initialization.
        **sizes: `fresh_qwen2_config`'s size arguments (`hidden_size`, `num_layers`, `num_heads`,
            `num_kv_heads`, `intermediate_size`, `max_positions`).

    Returns:
        The number of parameters (tied embeddings counted once).

    Raises:
        ConfigError: `out_dir` is a file or a non-empty directory, or a size is invalid (one line).
    """
    out_dir = Path(out_dir)
    tokenizer = build_ascii_tokenizer()
    config = fresh_qwen2_config(tokenizer, **sizes)  # a bad size fails before anything is written
    tokenizer.model_max_length = config.max_position_embeddings
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        what = "a directory that is not empty" if out_dir.is_dir() else "a file"
        raise ConfigError(f"{out_dir} is {what}; give a new or empty directory")

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar in a command's output
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return sum(parameter.numel() for parameter in model.parameters())
