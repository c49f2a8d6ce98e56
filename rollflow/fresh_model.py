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


def save_fresh_vl_model(out_dir: str | Path, seed: int = 0, hidden_size: int = 128, num_layers: int = 4,
                        num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 512,
                        max_positions: int = 256, vision_depth: int = 2, vision_width: int = 64,
                        vision_heads: int = 4, image_size: int = 32, rope_theta: float = 1e6) -> int:
    """Randomly initialize a small Qwen2-VL (the architecture of `Qwen2VLForConditionalGeneration`) and save
    it in HF format with the ASCII tokenizer plus the vision tokens (`build_ascii_vl_tokenizer`) and its image
    processor (`preprocessor_config.json`).

    The language model is the tiny Qwen2's (`fresh_qwen2_config`'s sizes); the vision tower cuts an image into
    4x4-pixel patches (two frames of one image, as Qwen2-VL does), runs `vision_depth` blocks of width
    `vision_width`, and merges 2x2 patches into one token of the language model's width: a 32x32 image is
    64 patches and 16 tokens. The image processor resizes every image to about `image_size` squared pixels
    (sides rounded to multiples of 8).

    `rope_theta` is the language model's rotary base (the bundled tiny-vl's: 1e6, Qwen2's). Qwen2-VL's
    multimodal rope gives an image's rows and columns the rotary pairs of the lowest frequencies, so at 1e6
    and this head size (16 pairs) two columns of a 4x4 image differ by under 1e-3 radians: the model counts
    the squares of a colour but can not tell where one is. Measured with a plain transformers loop
    (December 2026, chance 25%): which column a red square is in, 38% after 500 steps at 1e6, 100% after 300 at
    100. A task that needs positions (a board) wants `rope_theta` 100; counting learns better at 1e6 (the
    VLM quickstart's GRPO: 0.47 -> 0.58 at 100 against 0.48 -> 0.95 at 1e6).

    Returns:
        The number of parameters (tied embeddings counted once).

    Raises:
        ConfigError: as `save_fresh_model`.
    """
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from rollflow.data.char_tokenizer import build_ascii_vl_tokenizer

    out_dir = Path(out_dir)
    tokenizer = build_ascii_vl_tokenizer(max_positions)
    text = fresh_qwen2_config(tokenizer, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
                              max_positions)
    half_head = hidden_size // num_heads // 2  # rotary pairs per head, split over (time, height, width)
    sections = [half_head - 2 * (half_head * 3 // 8), half_head * 3 // 8, half_head * 3 // 8]
    if vision_width % vision_heads or (vision_width // vision_heads) % 2:
        raise ConfigError(f"vision_width {vision_width} / vision_heads {vision_heads} must be a whole, even head size")
    if not (isinstance(rope_theta, (int, float)) and 0 < rope_theta < float("inf")):
        raise ConfigError(f"rope_theta must be a positive, finite number, got {rope_theta!r}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        what = "a directory that is not empty" if out_dir.is_dir() else "a file"
        raise ConfigError(f"{out_dir} is {what}; give a new or empty directory")
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in
           ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")}
    config = Qwen2VLConfig(
        text_config={**text.to_dict(), "model_type": "qwen2_vl_text",
                     "rope_scaling": {"type": "mrope", "mrope_section": sections,
                                      "rope_theta": float(rope_theta)}},
        vision_config={"depth": vision_depth, "embed_dim": vision_width, "hidden_size": hidden_size,
                       "num_heads": vision_heads, "mlp_ratio": 2, "patch_size": 4, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "in_channels": 3},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None
    )
    pixels = image_size * image_size
    image_processor = Qwen2VLImageProcessorPil(size={"shortest_edge": pixels, "longest_edge": pixels},
                                               patch_size=4, merge_size=2, temporal_patch_size=2)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    image_processor.save_pretrained(out_dir)
    return sum(parameter.numel() for parameter in model.parameters())
