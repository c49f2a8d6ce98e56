"""The reward registry, loading user rewards by dotted path or file path, and the errors a reward can raise.

The reward contract (see DESIGN.md): `fn(completion: str, **row) -> float | dict[str, float]`, where the
row carries the prompt, the reference answer and any other dataset columns. Options (a time limit, a
penalty size) are keyword-only parameters with defaults; `resolve_reward(spec, options)` binds them.

A reward that needs a model or a service (an LLM judge, a reward model) is registered as a `ModelReward`
instead of a function: the name of a *scorer* class that scores a whole group in one call, built once in a
reward worker (`rollflow.workers.reward`), and a dataclass of its options, checked on the driver.

A user reward is named by dotted path, `my_pkg.rewards:score` (its module importable: on `sys.path` or in the
working directory), or by file path, `rewards/score.py:score` (relative to the working directory, or
absolute), which is loaded from that file whatever `sys.path` holds (`load_reward_file`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from rollflow.errors import RollflowError
from rollflow.registry import Registry, import_module, import_object

RewardFn = Callable[..., "float | dict[str, float]"]
Row = dict[str, Any]

REWARD_FUNCTIONS: Registry[Any] = Registry("reward function")  # RewardFn or ModelReward
FILE_MODULE_PREFIX = "_rollflow_reward_file_"  # modules `load_reward_file` loads are named this + stem + hash


@dataclass(frozen=True)
class ScoreError:
    """A sample a model reward could not score (e.g. the judge service failed after its retries).

    Returned in place of a value by `GroupScorer.score_group`; the sample is marked failed with `message`.
    """

    message: str


class GroupScorer(Protocol):
    """What a model reward's scorer class provides. Built in a reward worker as `cls(options, device=...)`.

    `score_group(completions, rows)` scores one prompt group (or any list of samples) in one call and
    returns one entry per completion: a float, a dict of floats (see `combine_rewards`), or `ScoreError`.
    """

    async def score_group(self, completions: list[str], rows: list[Row]) -> list[Any]: ...


@dataclass(frozen=True)
class ModelReward:
    """A reward that needs a model or a service: its scorer runs in reward workers, a group per call.

    Attributes:
        scorer: `"module:Class"` of a `GroupScorer`, imported in the worker (the driver never loads the model).
        options_type: a dataclass of the scorer's options; it checks their values when constructed.
        options: the bound options (an `options_type` instance), set by `resolve_reward`.
        source: for a reward given by file path, (its spec with the file's absolute path, its options), set by
            `resolve_reward`: pickling it (to a reward worker) sends these, and the worker resolves them again.
    """

    scorer: str
    options_type: type
    options: Any = None
    source: tuple[str, dict] | None = dataclasses.field(default=None, compare=False)

    def __reduce_ex__(self, protocol):
        """A reward loaded from a file (`source`: its absolute spec and options) is resolved again where it is
        unpickled (a reward worker): the module the driver loaded it as is not importable there."""
        if self.source is not None:
            return resolve_reward, self.source
        return super().__reduce_ex__(protocol)

    def bind(self, options: Mapping[str, Any] | None, spec: str) -> ModelReward:
        """This reward with `options` checked and bound; raises `RewardLoadError` (one line) when bad."""
        accepted = sorted(f.name for f in dataclasses.fields(self.options_type))
        unknown = sorted(set(options or {}) - set(accepted))
        if unknown:
            raise RewardLoadError(f"reward {spec!r} does not take option(s) {', '.join(unknown)}; "
                                  f"its options: {', '.join(accepted)}")
        try:
            bound = self.options_type(**(options or {}))
        except (TypeError, ValueError) as error:
            message = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise RewardLoadError(f"reward {spec!r}: {message}") from None
        return dataclasses.replace(self, options=bound)

    def build(self, device: str = "cpu") -> GroupScorer:
        """Construct the scorer (loads its model): what a reward worker does once, at start."""
        if self.options is None:
            raise RuntimeError("ModelReward.build needs bound options; get it from resolve_reward")
        return import_object(self.scorer)(self.options, device=device)


class RewardLoadError(RollflowError, ValueError):
    """A reward spec that names no registered reward and no importable function (one-line message)."""


class MissingColumnError(RollflowError, ValueError):
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


def needs_columns(*columns: str) -> Callable[[RewardFn], RewardFn]:
    """Declare the dataset columns a reward function reads (with `require_column`).

    The driver checks every row of the run's datasets for them before the first step
    (`rollflow.inputs.prompt_sets`), so a dataset without them is one error naming the row, not a failed
    sample per step. Put it under `@REWARD_FUNCTIONS.register(...)` (or on a user reward):

        @REWARD_FUNCTIONS.register("math_answer")
        @needs_columns("answer")
        def math_answer(completion, **row): ...

    Args:
        *columns: the column names.

    Returns:
        A decorator that records them on the function (`required_columns` reads them back).
    """

    def declare(fn: RewardFn) -> RewardFn:
        fn.required_columns = tuple(columns)  # type: ignore[attr-defined]
        return fn

    return declare


def required_columns(reward: Any) -> tuple[str, ...]:
    """The columns a resolved reward declared with `needs_columns`; () when it declared none.

    Args:
        reward: what `resolve_reward` returned (a function, a `functools.partial` of one, or a `ModelReward`).
    """
    while isinstance(reward, functools.partial):
        reward = reward.func
    return tuple(getattr(reward, "required_columns", ()))


def is_file_spec(spec: str) -> bool:
    """A reward spec that names a Python file (`rewards/score.py:score`, `/abs/score.py:score`), not a module."""
    return spec.rpartition(":")[0].endswith(".py") or spec.endswith(".py")


def reward_key(spec: str) -> str:
    """The name a reward's value is logged under (`rollout/reward/NAME`, the keys of `Sample.rewards`): the spec,
    except that a file path keeps only its file name (`rewards/score.py:score` -> `score.py:score`), as a
    metric name's parts are split at `/`."""
    if not is_file_spec(spec):
        return spec
    path, _, attribute = spec.rpartition(":")
    return f"{Path(path).name}:{attribute}"


def load_reward_file(path: str, spec: str) -> ModuleType:
    """The module of a Python file, loaded once per process (again it is the same module).

    A relative path is read from the working directory. The module is named after the file's absolute path
    (`FILE_MODULE_PREFIX` + stem + hash), so files of the same name in two directories stay two modules, and
    the file's directory is appended to `sys.path`, so it may import the modules beside it.

    Args:
        path: the file (`rewards/score.py`, `~/score.py`, `/abs/score.py`).
        spec: the reward spec, for messages.

    Raises:
        RewardLoadError: no such file, or it fails to run (a syntax error with its line, an exception at
            import, said in one line).
    """
    file = Path(path).expanduser()
    if not file.is_absolute():
        file = Path.cwd() / file
    file = file.resolve()
    if not file.is_file():
        where = "" if Path(path).expanduser().is_absolute() else f" (read from the working directory {os.getcwd()})"
        raise RewardLoadError(f"reward {spec!r}: no file {str(file)!r}{where}")
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:12]
    name = FILE_MODULE_PREFIX + re.sub(r"\W", "_", file.stem) + "_" + digest
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(module_spec)
    if str(file.parent) not in sys.path:
        sys.path.append(str(file.parent))
    sys.modules[name] = module  # before running it, as an import does (dataclasses look their module up)
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:  # anything raised while running the file is the user's file's problem
        del sys.modules[name]
        text = error.msg if isinstance(error, SyntaxError) and error.msg else str(error)
        reason = f"{type(error).__name__}: {text}".splitlines()[0] if text.strip() else type(error).__name__
        if isinstance(error, SyntaxError) and error.lineno is not None:
            reason += f" (line {error.lineno})"
        raise RewardLoadError(f"reward {spec!r}: cannot load {str(file)!r} ({reason})") from None
    return module


def _import_file(spec: str) -> Callable[..., Any]:
    """The function `path/to/file.py:function` names (see `load_reward_file`)."""
    path, _, attr_path = spec.rpartition(":")
    if not path or not attr_path:
        raise RewardLoadError(f"reward {spec!r} names a file but no function in it: write "
                              f"'{spec.rpartition(':')[0] or spec}:FUNCTION'")
    return _reward_attribute(load_reward_file(path, spec), attr_path, spec, f"{path} has no function")


def _absolute_file_spec(spec: str) -> str:
    """`rewards/score.py:score` with the file's absolute path: what a worker in another directory loads."""
    path, _, attribute = spec.rpartition(":")
    file = Path(path).expanduser()
    return f"{(file if file.is_absolute() else Path.cwd() / file).resolve()}:{attribute}"


def _import_path(spec: str) -> Callable[..., Any]:
    """Import `pkg.module:attr` or `pkg.module.attr`; raise `RewardLoadError` with a one-line reason."""
    if ":" in spec:
        module_name, _, attr_path = spec.partition(":")
    else:
        module_name, _, attr_path = spec.rpartition(".")
    if not module_name or not attr_path:
        raise RewardLoadError(f"reward spec {spec!r} is not a path of the form 'pkg.module:function'")
    try:
        obj: Any = import_module(module_name)  # the working directory too, as under `python -m`
    except Exception as error:  # any import-time failure is the user's module's problem; say which one
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
        if isinstance(error, ModuleNotFoundError) and error.name == module_name.split(".")[0]:
            reason += f"; looked on sys.path and in the working directory {os.getcwd()}"
        raise RewardLoadError(f"reward {spec!r}: cannot import module {module_name!r} ({reason})") from error
    return _reward_attribute(obj, attr_path, spec, f"module {module_name!r} has no attribute")


def _reward_attribute(obj: Any, attr_path: str, spec: str, missing: str) -> Callable[..., Any]:
    """`obj.attr.path`, which must be a callable or a `ModelReward`; `RewardLoadError` (`missing` + the path)
    when an attribute is not there."""
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise RewardLoadError(f"reward {spec!r}: {missing} {attr_path!r}")
        obj = getattr(obj, part)
    if not callable(obj) and not isinstance(obj, ModelReward):
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


def warm_up_rewards(specs: Iterable[str]) -> None:
    """Let the registered reward functions among `specs` start now what they would start on first use (their
    `warm_up()`: math_answer's math-verify helper processes), in the background. Names that are not
    registered, and functions without `warm_up`, are skipped."""
    for spec in set(specs):
        warm_up = getattr(REWARD_FUNCTIONS.get(spec), "warm_up", None) if spec in REWARD_FUNCTIONS else None
        if callable(warm_up):
            warm_up()


def resolve_reward(spec: str, options: Mapping[str, Any] | None = None) -> RewardFn | ModelReward:
    """Turn a reward spec from a config into a callable (or a `ModelReward` with its options bound).

    Args:
        spec: a registered name (`"math_answer"`), a dotted path to a function (`"my_pkg.rewards:score"` or
            `"my_pkg.rewards.score"`), or a file path and function (`"rewards/score.py:score"`, relative to
            the working directory, or absolute).
        options: keyword-only options to bind (e.g. `{"timeout_s": 2.0}`); each must be a keyword-only
            parameter of the function.

    Returns:
        The function, or a `functools.partial` with the options bound. For a model reward (`llm_judge`,
        `http_judge`, `reward_model`, or a user `ModelReward` by dotted path) a `ModelReward` whose options
        were checked here, on the driver; a reward worker runs it (`rollflow.workers.reward`).

    Raises:
        RewardLoadError: the spec is neither a registered name nor an importable callable (a missing module,
            file or function), or an option is not accepted. The message is one line.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise RewardLoadError(f"reward spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if spec in REWARD_FUNCTIONS:
        fn = REWARD_FUNCTIONS.get(spec)
    elif is_file_spec(spec):
        fn = _import_file(spec)
    elif "." in spec or ":" in spec:
        fn = _import_path(spec)
    else:
        message = REWARD_FUNCTIONS.unknown_message(spec)
        raise RewardLoadError(f"{message} (or give a dotted path 'pkg.module:function' or a file "
                              "'path/to/file.py:function')")
    if isinstance(fn, ModelReward):
        bound = fn.bind(options, spec)
        if is_file_spec(spec):  # a reward worker loads the file again, by its absolute path
            bound = dataclasses.replace(bound, source=(_absolute_file_spec(spec), dict(options or {})))
        return bound
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
