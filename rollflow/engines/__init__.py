"""Inference engines behind one protocol (`base.InferenceEngine`), looked up by name and imported lazily.

A module for vLLM or SGLang is imported only when that engine is selected, and imports its library only
when the engine is constructed; the modules are named so they never shadow the `vllm` / `sglang` packages.
"""

from __future__ import annotations

from typing import Any

from rollflow.registry import Registry, import_object

# name -> "module:class"; the module is imported on first use.
ENGINES: Registry[str] = Registry("inference engine")
ENGINES.register("hf")("rollflow.engines.hf:HFEngine")
ENGINES.register("vllm")("rollflow.engines.vllm_engine:VLLMEngine")
ENGINES.register("sglang")("rollflow.engines.sglang_engine:SGLangEngine")


def create_engine(name: str, **kwargs: Any):
    """Import and construct engine `name` (see `ENGINES.names()`)."""
    return import_object(ENGINES.get(name))(**kwargs)
