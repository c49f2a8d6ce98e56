"""Training backends behind one interface (`base.TrainingBackend`), looked up by name and imported lazily.

A backend class is constructed as `cls(settings: TrainerSettings, **backend_kwargs)`: the shared settings
come from typed config keys, and the keyword arguments of the class after `settings` are its own knobs
(`backend_kwargs` in the config).
"""

from __future__ import annotations

import ast
import difflib
import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rollflow.errors import ConfigError
from rollflow.registry import Registry, UnknownNameError, import_object, source_definition

if TYPE_CHECKING:
    from rollflow.backends.base import TrainerSettings, TrainingBackend

# name -> "module:class"; the module is imported on first use.
BACKENDS: Registry[str] = Registry("training backend")
BACKENDS.register("torch")("rollflow.backends.torch_backend:TorchBackend")
BACKENDS.register("fsdp2")("rollflow.backends.fsdp2:FSDP2Backend")
BACKENDS.register("sim")("rollflow.backends.sim:SimBackend")  # simulated GPUs (cluster.device: sim)


def backend_class(name: str) -> type:
    """Import and return the class of backend `name`; an unknown name raises ConfigError naming the valid
    ones."""
    try:
        spec = BACKENDS.get(name)
    except UnknownNameError as error:
        raise ConfigError(str(error)) from None
    return import_object(spec)


def backend_kwarg_names(name: str) -> list[str]:
    """The backend-specific keyword arguments backend `name` takes (its constructor's, after `settings`), read
    from its module's source (no torch imported); a class without an `__init__` of its own is imported."""
    try:
        spec = BACKENDS.get(name)
    except UnknownNameError as error:
        raise ConfigError(str(error)) from None
    cls = source_definition(spec)
    init = next((node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "__init__"),
                None) if isinstance(cls, ast.ClassDef) else None
    if init is not None:
        arguments = [*init.args.posonlyargs, *init.args.args][1:] + init.args.kwonlyargs  # after `self`
        return [argument.arg for argument in arguments if argument.arg != "settings"]
    parameters = inspect.signature(backend_class(name)).parameters.values()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in parameters if p.kind in named and p.name != "settings"]


def check_backend_kwargs(name: str, kwargs: Mapping[str, Any]) -> None:
    """Check `kwargs` against the keyword arguments of backend `name`, without constructing it.

    Only the keys are checked; a backend validates the values when constructed.

    Raises:
        ConfigError: one line naming the unknown keys and the valid ones (or an unknown backend name).
    """
    if not kwargs:
        return  # always valid; and does not import the backend module (the config builds its defaults early)
    valid = backend_kwarg_names(name)
    unknown = sorted(set(kwargs) - set(valid))
    if not unknown:
        return
    from rollflow.backends.settings import SETTINGS_FIELDS

    notes = []
    settings_keys = [key for key in unknown if key in SETTINGS_FIELDS]
    if settings_keys:
        notes.append(f"rollflow sets {', '.join(settings_keys)} from typed config keys, not backend_kwargs")
    for key in unknown:
        near = difflib.get_close_matches(key, valid, n=1)
        if near and key not in SETTINGS_FIELDS:
            notes.append(f"did you mean {near[0]!r} for {key!r}?")
    accepted = f"valid keys: {', '.join(valid)}" if valid else "it takes none"
    raise ConfigError(f"unknown backend_kwargs {', '.join(unknown)} for the {name!r} training backend; "
                      + "; ".join([accepted, *notes]))


def create_backend(name: str, settings: TrainerSettings, **backend_kwargs: Any) -> TrainingBackend:
    """Import and construct training backend `name` (see `BACKENDS.names()`).

    Args:
        name: a `BACKENDS` name.
        settings: the shared settings.
        backend_kwargs: backend-specific keyword arguments (e.g. fsdp2's `mixed_precision`).

    Returns:
        The backend (a collective to construct under a data-parallel backend: every rank calls this).

    Raises:
        ConfigError: an unknown backend name or backend_kwargs key.
    """
    check_backend_kwargs(name, backend_kwargs)
    return backend_class(name)(settings, **backend_kwargs)
