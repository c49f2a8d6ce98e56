"""The environment protocol (GEM's convention) and the registry of environments by id.

An environment is text in, text out:

    observation, info = env.reset(seed)
    observation, reward, terminated, truncated, info = env.step(action_text)

`reset(seed)` with the same seed gives the same episode, so every env of a group (one seed, many
trajectories) starts from the same state and their returns are comparable. `step` takes whatever the model
wrote: an action it cannot parse is a turn with a penalty (`info["invalid_action"] = True`), never an
exception. Exceptions and hangs are the env worker's business (`rollflow.workers.env`): they fail the one
trajectory.

Conventional `info` keys (all optional):
    success: bool, the episode reached its goal (read on the last step; `eval/success`).
    invalid_action: bool, this step's action could not be parsed.
    anchor: str, a name of the state the action was taken in, for GiGPO's anchor-state groups; default: the
        observation text.
    tool_calls: int, tool calls made in this step (tool envs).
    outcome: str, on the step that ends the episode, why it ended, in a few words ("fell into a hole",
        "reached the goal", "out of turns: all 8 moves used"); `rollflow env play` prints it.

An env may also have `play_help() -> str`: for a person playing it (`rollflow env play`), a few lines with the
legend of its observation's symbols and the moves it accepts. Every built-in has one.

Env ids: a built-in name (`frozenlake`, `sokoban`, `countdown`, `guess_number`), `gem:<GEM id>` (any
environment of the `gem-llm` package), `gym:<gymnasium id>` (gymnasium envs with text observations), or a
path `package.module:factory` (or `module:factory` for a file `module.py` in the working directory) to a callable
returning an env.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from rollflow.errors import ConfigError
from rollflow.registry import Registry, import_module

StepResult = tuple[str, float, bool, bool, dict[str, Any]]


@runtime_checkable
class Env(Protocol):
    """What the env workers drive. GEM environments satisfy it unchanged."""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode; the same seed gives the same episode. Returns (observation, info)."""
        ...

    def step(self, action: str) -> StepResult:
        """Apply the model's text. Returns (observation, reward, terminated, truncated, info)."""
        ...


class ExpertEnv(Env, Protocol):
    """A built-in env that can also act by itself, so env code is tested without a model."""

    def expert_action(self) -> str:
        """A good action for the current state, as the model should write it (the scripted expert)."""
        ...

    def random_action(self, rng: random.Random) -> str:
        """A uniformly random valid action, as text."""
        ...


# Built-in envs: name -> factory(**env_kwargs) -> Env. Built-ins register themselves on import.
ENVS: Registry[Callable[..., Env]] = Registry("environment")

_ADAPTER_PREFIXES = ("gem:", "gym:")


def make_env(env_id: str, **env_kwargs: Any) -> Env:
    """A new env for `env_id` (see the module docstring for the forms of an id).

    Raises:
        UnknownNameError: an unknown built-in name (the message lists the valid ones).
        ConfigError: an adapter's package is missing, or a dotted path does not import.
    """
    _import_builtins()
    if env_id.startswith("gem:"):
        from rollflow.envs.adapters import make_gem_env

        return make_gem_env(env_id[len("gem:"):], **env_kwargs)
    if env_id.startswith("gym:"):
        from rollflow.envs.adapters import make_gym_env

        return make_gym_env(env_id[len("gym:"):], **env_kwargs)
    if ":" in env_id:  # a built-in name has no ':'
        return _from_dotted_path(env_id)(**env_kwargs)
    return ENVS.get(env_id)(**env_kwargs)


def check_env_id(env_id: str) -> None:
    """Fail at config load, not in a worker: an unknown built-in, or a dotted path that does not import."""
    _import_builtins()
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


def _import_builtins() -> None:
    import rollflow.envs.builtin  # noqa: F401  (registers the built-in envs)


def _one_line(err: BaseException) -> str:
    """`Type: first line of the message` (a SyntaxError's own message, without its file and line)."""
    text = err.msg if isinstance(err, SyntaxError) and err.msg else str(err)
    lines = text.strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
