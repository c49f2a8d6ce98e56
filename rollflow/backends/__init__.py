"""Training backends behind one interface, looked up by name and imported lazily."""

from __future__ import annotations

from typing import Any

from rollflow.registry import Registry, import_object

# name -> "module:class"; the module is imported on first use.
BACKENDS: Registry[str] = Registry("training backend")
BACKENDS.register("torch")("rollflow.backends.torch_backend:TorchBackend")
BACKENDS.register("fsdp2")("rollflow.backends.fsdp2:FSDP2Backend")


def create_backend(name: str, **kwargs: Any):
    """Import and construct training backend `name` (see `BACKENDS.names()`)."""
    return import_object(BACKENDS.get(name))(**kwargs)
