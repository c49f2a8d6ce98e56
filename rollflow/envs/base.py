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

Env ids: a built-in name (`frozenlake`, `sokoban`, `countdown`, `guess_number`), `gem:<GEM id>` (any
environment of the `gem-llm` package), `gym:<gymnasium id>` (gymnasium envs with text observations), or a
dotted path `package.module:factory` to a callable returning an env.
"""

from __future__ import annotations

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
    if ":" in env_id and "." in env_id.split(":")[0]:
        return _from_dotted_path(env_id)(**env_kwargs)
    return ENVS.get(env_id)(**env_kwargs)


def check_env_id(env_id: str) -> None:
    """Fail at config load, not in a worker: an unknown built-in, or a dotted path that does not import."""
    _import_builtins()
    if env_id.startswith(_ADAPTER_PREFIXES):
        return  # the adapters check their package when the env is made
    if ":" in env_id and "." in env_id.split(":")[0]:
        _from_dotted_path(env_id)
    else:
        ENVS.get(env_id)


def _from_dotted_path(env_id: str) -> Callable[..., Env]:
    module_name, _, attribute = env_id.partition(":")
    try:
        factory = getattr(import_module(module_name), attribute)  # the working directory is searched too
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"env {env_id!r}: cannot import {attribute!r} from {module_name!r} ({err})") from None
    if not callable(factory):
        raise ConfigError(f"env {env_id!r}: {attribute!r} is not callable")
    return factory


def _import_builtins() -> None:
    import rollflow.envs.builtin  # noqa: F401  (registers the built-in envs)
