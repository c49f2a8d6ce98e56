"""Making an env from its id, and checking an id at config load.

Env ids: a built-in name (`frozenlake`, `sokoban`, `countdown`, `guess_number`), `gem:<GEM id>` (any
environment of the `gem-llm` package), `gym:<gymnasium id>` (gymnasium envs with text observations), or a
path `package.module:factory` (or `module:factory` for a file `module.py` in the working directory) to a callable
returning an env.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from rollflow.envs import builtin  # noqa: F401  (registers the built-in envs)
from rollflow.envs.adapters import make_gem_env, make_gym_env
from rollflow.envs.base import ENVS, Env
from rollflow.errors import ConfigError
from rollflow.registry import import_module

_ADAPTER_PREFIXES = ("gem:", "gym:")


def make_env(env_id: str, **env_kwargs: Any) -> Env:
    """A new env for `env_id` (see the module docstring for the forms of an id).

    Raises:
        UnknownNameError: an unknown built-in name (the message lists the valid ones).
        ConfigError: an adapter's package is missing, or a dotted path does not import.
    """
    if env_id.startswith("gem:"):
        return make_gem_env(env_id[len("gem:") :], **env_kwargs)
    if env_id.startswith("gym:"):
        return make_gym_env(env_id[len("gym:") :], **env_kwargs)
    if ":" in env_id:  # a built-in name has no ':'
        return _from_dotted_path(env_id)(**env_kwargs)
    return ENVS.get(env_id)(**env_kwargs)


def check_env_id(env_id: str) -> None:
    """Fail at config load, not in a worker: an unknown built-in, or a dotted path that does not import."""
    if env_id.startswith(_ADAPTER_PREFIXES):
        return  # the adapters check their package when the env is made
    if ":" in env_id:
        _from_dotted_path(env_id)
    else:
        ENVS.get(env_id)


def _from_dotted_path(env_id: str) -> Callable[..., Env]:
    """The factory `module:attribute` names (the module may sit in the working directory: `import_module`).

    Raises:
        ConfigError: the path is malformed, the module fails to import (missing, a syntax error, an exception
            at import: the user's module's problem, said in one line), or the attribute is missing or not
            callable.
    """
    module_name, _, attribute = env_id.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"env {env_id!r} is not of the form 'pkg.module:factory'")
    try:
        module = import_module(module_name)
    except Exception as err:  # noqa: BLE001  (anything raised at import is the user module's problem)
        reason = _one_line(err)
        if isinstance(err, SyntaxError) and err.lineno is not None:
            reason += f" ({err.filename}, line {err.lineno})"
        if isinstance(err, ModuleNotFoundError) and err.name == module_name.split(".")[0]:
            reason += f"; looked on sys.path and in the working directory {os.getcwd()}"
        raise ConfigError(f"env {env_id!r}: cannot import module {module_name!r} ({reason})") from None
    factory = getattr(module, attribute, None)
    if factory is None:
        raise ConfigError(f"env {env_id!r}: module {module_name!r} has no attribute {attribute!r}")
    if not callable(factory):
        raise ConfigError(f"env {env_id!r}: {attribute!r} is not callable")
    return factory


def _one_line(err: BaseException) -> str:
    """`Type: first line of the message` (a SyntaxError's own message, without its file and line)."""
    text = err.msg if isinstance(err, SyntaxError) and err.msg else str(err)
    lines = text.strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
