"""Shared fixtures: one thread per test process, a tiny random model saved to disk, one Ray per session."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)  # 2 shared cores: more OpenMP threads than our share slows small ops ~100x


def save_random_model(path, seed: int = 0, hidden: int = 64, layers: int = 2,
                      num_labels: int | None = None) -> str:
    """A random Qwen2 model with the char tokenizer, saved in HF format under `path`: a causal LM, or with
    `num_labels` a sequence classifier (a reward model)."""
    from transformers import Qwen2ForCausalLM, Qwen2ForSequenceClassification

    from rollflow.data.char_tokenizer import build_ascii_tokenizer
    from rollflow.fresh_model import fresh_qwen2_config

    tokenizer = build_ascii_tokenizer()
    labels = {} if num_labels is None else {"num_labels": num_labels}
    config = fresh_qwen2_config(tokenizer, hidden_size=hidden, num_layers=layers,
                               intermediate_size=2 * hidden, max_positions=64, **labels)
    torch.manual_seed(seed)
    model_class = Qwen2ForCausalLM if num_labels is None else Qwen2ForSequenceClassification
    model_class(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def step_samples():
    """A step's samples: two groups, with a truncated sample and a failed one (no response)."""
    from rollflow.data.sample import Sample, SampleStatus

    return [
        Sample([1, 2], [3, 4], [-0.5, -0.25], group_id=0, reward=1.0, rewards={"math_answer": 1.0}),
        Sample([1, 2], [5], [-1.0], group_id=0, reward=0.0, rewards={"math_answer": 0.0},
               status=SampleStatus.TRUNCATED),
        Sample([1], [6, 7, 8], [-0.1, -0.2, -0.3], group_id=1, reward=0.5, rewards={"math_answer": 0.5}),
        Sample([1], [], group_id=1, status=SampleStatus.FAILED),
    ]


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> str:
    return save_random_model(tmp_path_factory.mktemp("random_model"))


@pytest.fixture(scope="session")
def contract_model_dir(tmp_path_factory) -> str:
    """A random Qwen2 (head dim 32, 256 positions, decisive logits) with the char tokenizer."""
    from transformers import Qwen2ForCausalLM

    from rollflow.data.char_tokenizer import build_ascii_tokenizer
    from rollflow.fresh_model import fresh_qwen2_config

    path = tmp_path_factory.mktemp("contract_model")
    tokenizer = build_ascii_tokenizer()
    # initializer_range 0.2 (not 0.02) spreads the logits, so greedy argmaxes are never near-ties that
    # bf16 GPU kernels could flip.
    config = fresh_qwen2_config(tokenizer, hidden_size=64, intermediate_size=128, num_layers=2,
                               num_heads=2, num_kv_heads=1, max_positions=256,
                               initializer_range=0.2)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def vl_model_dir(tmp_path_factory) -> str:
    """The fresh (untrained) tiny Qwen2-VL with its processor, saved once per session; tests only read it."""
    from rollflow.fresh_model import save_fresh_vl_model

    path = tmp_path_factory.mktemp("tiny-vl")
    save_fresh_vl_model(path, seed=0)
    return str(path)


@pytest.fixture(scope="session")
def ray_session():
    """Start Ray once per test session (4 s); tests that need actors take this fixture."""
    from rollflow.cluster.ray_session import start_ray, stop_ray

    start_ray(num_cpus=2)
    yield
    stop_ray()


@contextlib.contextmanager
def mounted_tmpfs(mount_point: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted on `mount_point` with `options` (e.g. "size=64k,ro") for the block; the test is skipped
    where mounting is not allowed (it needs root and mount rights)."""
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount_point)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({options}) here (needs root and mount rights)")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "--lazy", str(mount_point)], check=True)  # a file may still be open
