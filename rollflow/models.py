"""Loading models and tokenizers: the bundled tiny model, a local HF directory, or a hub id.

All three go through `AutoModelForCausalLM` / `AutoTokenizer`, so the code path that loads the bundled
model is the one that loads a real model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rollflow.errors import ModelLoadError

BUNDLED_MODELS = {"tiny": Path(__file__).parent / "assets" / "tiny-qwen2-add"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(path: str) -> str:
    """Map a bundled name (`tiny`) to its directory, check a local directory (a LoRA checkpoint resolves to
    its `merged/` model), or pass a hub id through."""
    if path in BUNDLED_MODELS:
        if not (BUNDLED_MODELS[path] / "config.json").is_file():
            raise ModelLoadError(f"bundled model {path!r} is missing from {BUNDLED_MODELS[path]}; "
                                 "rebuild it with `rollflow build-tiny-model`")
        return str(BUNDLED_MODELS[path])
    expanded = Path(path).expanduser()
    if expanded.exists():
        if (expanded / "adapter_config.json").is_file() and (expanded / "merged" / "config.json").is_file():
            return str(expanded / "merged")  # a LoRA checkpoint: its merged full model serves as the model
        if not (expanded / "config.json").is_file():
            raise ModelLoadError(f"model path {path!r} is not a Hugging Face model directory (no config.json)")
        return str(expanded)
    if path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise ModelLoadError(f"model path {path!r} does not exist")
    return path  # a hub id like "Qwen/Qwen2.5-0.5B"; transformers resolves it (its cache when offline)


def _quiet_transformers() -> None:
    """No per-load progress bars or advisory warnings in worker logs."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """Load the tokenizer at `path` (bundled name, directory or hub id); pad token defaults to EOS."""
    from transformers import AutoTokenizer

    _quiet_transformers()
    resolved = resolve_model_path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolved, trust_remote_code=trust_remote_code)
    except Exception as err:  # transformers raises many types (OSError, ValueError, HTTP errors)
        raise ModelLoadError(f"cannot load tokenizer from {path!r}: {_first_line(err)}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(path: str, dtype: str = "float32", trust_remote_code: bool = False) -> torch.nn.Module:
    """Load a causal LM for training or inference (eval mode; the caller switches to train)."""
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    resolved = resolve_model_path(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            resolved, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code
        )
    except Exception as err:
        raise ModelLoadError(f"cannot load model from {path!r}: {_first_line(err)}") from None
    return model.eval()


def eos_token_ids(model: torch.nn.Module, tokenizer=None) -> list[int]:
    """All EOS ids: the generation config's (int or list) plus the tokenizer's."""
    ids: set[int] = set()
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif generation_eos:
        ids.update(generation_eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    config_eos = getattr(model.config, "eos_token_id", None)
    if isinstance(config_eos, int):
        ids.add(config_eos)
    return sorted(ids)


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]
