"""Making an env from its id, and checking an id at config load.

Env ids: a built-in name (`frozenlake`, `sokoban`, `countdown`, `guess_number`, `prompts`, `tool_use`), `gem:<GEM id>` (any
environment of the `gem-llm` package), `gym:<gymnasium id>` (gymnasium envs with text observations), or a
path `package.module:factory` (or `module:factory` for a file `module.py` in the working directory) to a callable
returning an env. An id `http://host:port/ENV` (or `https://`) is an env served by `rollflow env serve` on
another machine (`rollflow.envs.remote.RemoteEnv`); a list of such URLs, all naming the same ENV, spreads the
episodes over several servers.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from rollflow.envs import builtin  # noqa: F401  (registers the built-in envs)
from rollflow.envs.adapters import make_gem_env, make_gym_env
from rollflow.envs.base import ENVS, Env
from rollflow.envs.tool_use import ToolUseEnv
from rollflow.errors import ConfigError
from rollflow.registry import import_factory
from rollflow.tools.base import check_tools
from rollflow.tools.parsers import TOOL_PARSERS

_ADAPTER_PREFIXES = ("gem:", "gym:")
_URL_SCHEMES = ("http://", "https://")


def make_env(env_id: str | list[str], **env_kwargs: Any) -> Env:
    """A new env for `env_id` (see the module docstring for the forms of an id).

    Raises:
        UnknownNameError: an unknown built-in name (the message lists the valid ones).
        ConfigError: an adapter's package is missing, a dotted path does not import, or a URL (list) is malformed.
    """
    urls = env_urls(env_id)
    if urls is not None:
        from rollflow.envs.remote import RemoteEnv  # httpx only when an env is remote

        return RemoteEnv(urls, **env_kwargs)
    if env_id.startswith("gem:"):
        return make_gem_env(env_id[len("gem:") :], **env_kwargs)
    if env_id.startswith("gym:"):
        return make_gym_env(env_id[len("gym:") :], **env_kwargs)
    if ":" in env_id:  # a built-in name has no ':'
        return _from_dotted_path(env_id)(**env_kwargs)
    return ENVS.get(env_id)(**env_kwargs)


@ENVS.register("tool_use")
def make_tool_use_env(tools: list[str | dict[str, Any]] | None = None, env: str | list[str] = "prompts",
                      env_kwargs: dict[str, Any] | None = None, **options: Any) -> ToolUseEnv:
    """The tool-use env (`rollflow.envs.tool_use`) around the env `env` (any id `make_env` takes; default
    `prompts`: a prompt dataset's rows, scored by a reward function).

    Args:
        tools: the tool specs.
        env: the inner env's id.
        env_kwargs: the inner env's keyword arguments (`prompts`: `path` or `task`, `reward`, ...).
        **options: `ToolUseEnv`'s (`parser`, `max_calls`, `max_output_chars`, `invalid_penalty`, `tool_reward`).
    """
    if not tools:
        raise ConfigError("env 'tool_use' needs at least one tool (tools: [calculator], ...)")
    return ToolUseEnv(make_env(env, **(env_kwargs or {})), tools, **options)


def check_env_id(env_id: str | list[str]) -> None:
    """Fail at config load, not in a worker: an unknown built-in, a dotted path that does not import, a malformed
    URL (no network: a server that is down fails the run's first env check instead)."""
    if env_urls(env_id) is not None:
        return
    if env_id.startswith(_ADAPTER_PREFIXES):
        return  # the adapters check their package when the env is made
    if ":" in env_id:
        _from_dotted_path(env_id)
    else:
        ENVS.get(env_id)


def check_env_settings(env_id: str | list[str], kwargs: dict[str, Any]) -> None:
    """Fail at config load, not in a worker, on what can be checked of an env's kwargs without making the env:
    a `tool_use` env's option names, tools (`rollflow.tools.check_tools`: names, dotted paths, options, an MCP
    server's command; nothing is started, connected or indexed), tool-call parser and inner env (its id, and
    its own kwargs when it is a `tool_use` env too). Other envs check their kwargs when they are made.

    Raises:
        ConfigError, UnknownNameError: one line saying what is wrong.
    """
    if env_id != "tool_use" or not isinstance(kwargs, dict):
        return
    valid = ["tools", "env", "env_kwargs",
             *[name for name in inspect.signature(ToolUseEnv).parameters if name not in ("inner", "tools")]]
    for option in kwargs:
        if option not in valid:
            near = difflib.get_close_matches(option, valid, n=1)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"env 'tool_use': unknown option {option!r}.{hint} Valid: {', '.join(valid)}")
    if not kwargs.get("tools"):
        raise ConfigError("env 'tool_use' needs at least one tool (tools: [calculator], ...)")
    check_tools(kwargs["tools"])
    TOOL_PARSERS.get(kwargs.get("parser", "qwen"))
    inner = kwargs.get("env", "prompts")
    check_env_id(inner)
    check_env_settings(inner, kwargs.get("env_kwargs") or {})


def env_urls(env_id: str | list[str]) -> list[str] | None:
    """The server URLs of a remote env id (`http://host:port/ENV`, or a list of them), trailing `/` removed;
    None for a local id (a built-in name, `gem:`, `gym:`, a dotted path).

    Raises:
        ConfigError: a URL without a host, with a bad port, a query or no env path; a list that is empty, holds
            anything but URLs, or names different envs (paths).
    """
    if isinstance(env_id, str):
        if not env_id.startswith(_URL_SCHEMES):
            return None
        urls = [env_id]
    elif isinstance(env_id, (list, tuple)):
        if not env_id:
            raise ConfigError("env id is an empty list; a list holds the URLs of env servers, "
                              "e.g. [http://10.0.0.5:8000/frozenlake, http://10.0.0.6:8000/frozenlake]")
        urls = list(env_id)
    else:
        raise ConfigError(f"env id must be text or a list of URLs, got {type(env_id).__name__}")
    checked = [_checked_url(url) for url in urls]
    paths = {urlsplit(url).path for url in checked}
    if len(paths) > 1:
        raise ConfigError(f"env id lists URLs of different envs ({', '.join(sorted(paths))}); every server of "
                          "one env id must serve the same env")
    return checked


def _checked_url(url: Any) -> str:
    if not isinstance(url, str) or not url.startswith(_URL_SCHEMES):
        raise ConfigError(f"env id list holds {url!r}; a list holds only env server URLs (http://host:port/ENV)")
    parts = urlsplit(url.rstrip("/"))
    try:
        parts.port  # noqa: B018  (raises on a port that is not a number in range)
    except ValueError:
        raise ConfigError(f"env URL {url!r} has a bad port") from None
    if not parts.hostname:
        raise ConfigError(f"env URL {url!r} has no host (http://host:port/ENV)")
    if parts.query or parts.fragment:
        raise ConfigError(f"env URL {url!r} has a query or fragment; it is http://host:port/ENV")
    if not parts.path.strip("/"):
        raise ConfigError(f"env URL {url!r} names no env: add the served env's id as the path, "
                          "e.g. http://host:8000/frozenlake (`rollflow env serve` prints the URL)")
    return url.rstrip("/")


def _from_dotted_path(env_id: str) -> Callable[..., Env]:
    """The factory `module:attribute` names (`rollflow.registry.import_factory`: one line for a malformed path, a
    module that fails to import, an attribute that is missing or not callable)."""
    return import_factory(env_id, "env")
