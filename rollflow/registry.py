"""Name -> implementation registries (losses, advantages, engines, backends, envs, rewards).

Plain Python that imports only `rollflow.errors` from the rest of rollflow, so every folder may use it.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Generic, TypeVar

from rollflow.errors import ConfigError, RollflowError

T = TypeVar("T")


class UnknownNameError(RollflowError, KeyError):
    """An unknown registry name. The message lists the valid names and the nearest match."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain.
        return str(self.args[0])


class Registry(Generic[T]):
    """A named collection of implementations.

    Args:
        kind: what the registry holds, used in error messages ("advantage estimator").
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator that registers `obj` under `name`; a duplicate name is an error."""

        def decorator(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        """Return the implementation for `name`, or raise `UnknownNameError` naming the valid ones."""
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(self.unknown_message(name)) from None

    def unknown_message(self, name: str) -> str:
        valid = sorted(self._entries)
        near = difflib.get_close_matches(name, valid, n=1)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        return f"unknown {self.kind} {name!r}.{hint} Valid: {', '.join(valid)}"

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)


def import_module(name: str) -> ModuleType:
    """Import module `name`, searching the current working directory too, as `python -m` users expect of
    their own modules: `my_rewards:score` finds `./my_rewards.py` under the `rollflow` command, whose
    `sys.path` starts at the command's own directory. The directory is appended, so an installed package
    of the same name still wins, and stays (a user module may import its neighbours later).

    Ray workers need nothing more: a local Ray starts them in the driver's working directory, with it on
    their `sys.path`.
    """
    try:
        cwd = os.getcwd()
    except OSError:  # the working directory was removed: nothing to add
        return importlib.import_module(name)
    if not any(os.path.abspath(entry or os.curdir) == cwd for entry in sys.path):
        sys.path.append(cwd)
    return importlib.import_module(name)


def import_object(spec: str):
    """Import `package.module:attribute` and return the attribute (a user module may sit in the current
    working directory: `import_module`)."""
    module_name, _, attribute = spec.partition(":")
    return getattr(import_module(module_name), attribute)


def import_factory(spec: str, kind: str) -> Callable:
    """The callable `module:attribute` names, for a user's own env, tool, ... given by dotted path (the module
    may sit in the working directory: `import_module`).

    Args:
        spec: `pkg.module:attribute`.
        kind: what it names, for the errors ("env", "tool").

    Raises:
        ConfigError: the path is malformed, the module fails to import (missing, a syntax error, an exception
            at import: the user's module's problem, said in one line), or the attribute is missing or not
            callable.
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{kind} {spec!r} is not of the form 'pkg.module:factory'")
    try:
        module = import_module(module_name)
    except Exception as err:  # noqa: BLE001  (anything raised at import is the user module's problem)
        reason = _one_line(err)
        if isinstance(err, SyntaxError) and err.lineno is not None:
            reason += f" ({err.filename}, line {err.lineno})"
        if isinstance(err, ModuleNotFoundError) and err.name == module_name.split(".")[0]:
            reason += f"; looked on sys.path and in the working directory {os.getcwd()}"
        raise ConfigError(f"{kind} {spec!r}: cannot import module {module_name!r} ({reason})") from None
    factory = getattr(module, attribute, None)
    if factory is None:
        raise ConfigError(f"{kind} {spec!r}: module {module_name!r} has no attribute {attribute!r}")
    if not callable(factory):
        raise ConfigError(f"{kind} {spec!r}: {attribute!r} is not callable")
    return factory


def _one_line(err: BaseException) -> str:
    """`Type: first line of the message` (a SyntaxError's own message, without its file and line)."""
    text = err.msg if isinstance(err, SyntaxError) and err.msg else str(err)
    lines = text.strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
