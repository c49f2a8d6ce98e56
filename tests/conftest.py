"""Shared fixtures: one thread per test process, a tiny random model saved to disk, one Ray per session."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)  # 2 shared cores: more OpenMP threads than our share slows small ops ~100x


def save_random_model(path, seed: int = 0, hidden: int = 64, layers: int = 2) -> str:
    """A random Qwen2 model with the char tokenizer, saved in HF format under `path`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rollflow.data.char_tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=2 * hidden, tie_word_embeddings=True,
        max_position_embeddings=64, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> str:
    return save_random_model(tmp_path_factory.mktemp("random_model"))


@pytest.fixture(scope="session")
def ray_session():
    """Start Ray once per test session (4 s); tests that need actors take this fixture."""
    from rollflow.cluster.runtime import start_ray, stop_ray

    start_ray(num_cpus=2)
    yield
    stop_ray()
