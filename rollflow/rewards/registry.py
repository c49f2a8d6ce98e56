"""The reward registry, dotted-path loading of user rewards, and the errors a reward can raise.

The reward contract (see DESIGN.md): `fn(completion: str, **row) -> float | dict[str, float]`, where the
row carries the prompt, the reference answer and any other dataset columns. Options (a time limit, a
penalty size) are keyword-only parameters with defaults; `resolve_reward(spec, options)` binds them.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from rollflow.registry import Registry

RewardFn = Callable[..., "float | dict[str, float]"]

REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function")


class RewardLoadError(ValueError):
    """A reward spec that names no registered reward and no importable function (one-line message)."""


class MissingColumnError(ValueError):
    """A reward needs a dataset column that the row does not carry."""


def require_column(row: Mapping[str, Any], column: str, reward: str) -> Any:
    """Return `row[column]`, or raise `MissingColumnError` naming the reward and the columns present.

    Args:
        row: the dataset row passed to the reward as keyword arguments.
        column: the column the reward needs.
        reward: the reward's name, for the message.

    Returns:
        The column's value (never None).
    """
    value = row.get(column)
    if value is None:
        present = ", ".join(sorted(row)) or "none"
        raise MissingColumnError(
            f"reward {reward!r} needs the dataset column {column!r}, but the row has: {present}"
        )
    return value


def _import_path(spec: str) -> Callable[..., Any]:
    """Import `pkg.module:attr` or `pkg.module.attr`; raise `RewardLoadError` with a one-line reason."""
    if ":" in spec:
        module_name, _, attr_path = spec.partition(":")
    else:
        module_name, _, attr_path = spec.rpartition(".")
    if not module_name or not attr_path:
        raise RewardLoadError(f"reward spec {spec!r} is not a path of the form 'pkg.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as error:  # any import-time failure is the user's module's problem; say which one
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
        raise RewardLoadError(f"reward {spec!r}: cannot import module {module_name!r} ({reason})") from error
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise RewardLoadError(f"reward {spec!r}: module {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardLoadError(f"reward {spec!r} is a {type(obj).__name__}, not a callable")
    return obj


def reward_option_names(fn: Callable[..., Any]) -> list[str]:
    """The options a reward accepts: its keyword-only parameters.

    Args:
        fn: a reward function.

    Returns:
        Sorted names of its keyword-only parameters.
    """
    params = inspect.signature(fn).parameters.values()
    return sorted(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


def resolve_reward(spec: str, options: Mapping[str, Any] | None = None) -> RewardFn:
    """Turn a reward spec from a config into a callable.

    Args:
        spec: a registered name (`"math_answer"`) or a dotted path to a function
            (`"my_pkg.rewards:score"` or `"my_pkg.rewards.score"`).
        options: keyword-only options to bind (e.g. `{"timeout_s": 2.0}`); each must be a keyword-only
            parameter of the function.

    Returns:
        The function, or a `functools.partial` with the options bound.

    Raises:
        RewardLoadError: the spec is neither a registered name nor an importable callable, or an option is
            not accepted. The message is one line.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise RewardLoadError(f"reward spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if spec in REWARD_FUNCTIONS:
        fn = REWARD_FUNCTIONS.get(spec)
    elif "." in spec or ":" in spec:
        fn = _import_path(spec)
    else:
        message = REWARD_FUNCTIONS.unknown_message(spec)
        raise RewardLoadError(f"{message} (or give a dotted path 'pkg.module:function')")
    if not options:
        return fn
    try:
        accepted = reward_option_names(fn)
    except (TypeError, ValueError):  # builtins / C callables without a signature: bind blindly
        return functools.partial(fn, **options)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise RewardLoadError(
            f"reward {spec!r} does not take option(s) {', '.join(unknown)}; "
            f"its options: {', '.join(accepted) or 'none'}"
        )
    return functools.partial(fn, **options)
