"""`rollflow env serve ENV`: one env served over HTTP (`rollflow.envs.service`), for `env.id: http://host:port/ENV`.

This module only builds the command line; fastapi and uvicorn are imported when a server starts.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
import threading
from typing import Any

from rollflow.envs.make import check_env_id, env_urls, make_env
from rollflow.errors import ConfigError, RollflowError

EXIT_USER_ERROR = 2
MAKE_TIMEOUT_S = 120.0  # the least time limit of making the first env (its package's import may come first)
SHUTDOWN_GRACE_S = 5.0  # requests still running at Ctrl-C / SIGTERM get this long to finish
MAX_PORT = 65535
BACKLOG = 2048  # uvicorn's default listen backlog


def add_serve_parser(commands: Any) -> argparse.ArgumentParser:
    """Add `serve` to the `env` command's subparsers.

    Args:
        commands: the `env` parser's `add_subparsers(...)` result.

    Returns:
        The `serve` parser.
    """
    serve = commands.add_parser("serve", help="serve an env over HTTP, for env.id: http://host:port/ENV")
    serve.add_argument("env_id", help="frozenlake, sokoban, guess_number, countdown, gem:<id>, gym:<id>, pkg.mod:fn")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1; there is no auth: use a private network)")
    serve.add_argument("--port", type=int, default=8000,
                       help="port to listen on, 0 to 65535 (default 8000; 0: a free port, printed once bound)")
    serve.add_argument("--env-kwargs", default="{}", help='env keyword arguments as JSON, e.g. \'{"size": 5}\'')
    serve.add_argument("--max-sessions", type=int, default=256,
                       help="most live sessions (episodes); a reset past it answers 503 (default 256)")
    serve.add_argument("--step-timeout-s", type=float, default=30.0,
                       help="time limit of one env reset or step; past it the session is dropped (default 30); "
                            "the first env made at start-up gets at least 120 s to be made (its imports), "
                            "then this limit for its reset")
    serve.add_argument("--idle-timeout-s", type=float, default=600.0,
                       help="a session unused this long is closed (its client died; default 600)")
    serve.set_defaults(handler=serve_main)
    return serve


def serve_main(args: argparse.Namespace) -> int:
    """Run `rollflow env serve`: check the env (make and reset one), then serve it until Ctrl-C or SIGTERM.

    Returns:
        The exit status: 0 after a stop signal (Ctrl-C, SIGTERM), 2 for a user error (printed as one line).
    """
    try:
        env_kwargs = _checked(args)
        listener = _listen(args.host, args.port)
    except RollflowError as err:
        print(f"rollflow: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    import uvicorn

    from rollflow.envs.service import create_app

    port = listener.getsockname()[1]  # the port bound: the one asked for, or the free one `--port 0` got
    app = create_app(args.env_id, env_kwargs, args.max_sessions, args.step_timeout_s, args.idle_timeout_s)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
    print(f"serving {args.env_id} at http://{_url_host(args.host)}:{port}/{args.env_id} "
          f"(max {args.max_sessions} sessions)", flush=True)
    # uvicorn catches SIGINT and SIGTERM, stops accepting, lets running requests finish, then raises the signal
    # again under the handlers it found: KeyboardInterrupt for SIGINT, `_Stopped` for SIGTERM
    previous = signal.signal(signal.SIGTERM, _stopped)
    try:
        server.run(sockets=[listener])  # serves on the socket bound above: no second bind, no race for the port
    except (KeyboardInterrupt, _Stopped):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        listener.close()
    return 0


class _Stopped(Exception):
    """SIGTERM reached the server."""


def _stopped(signum: int, frame: Any) -> None:
    raise _Stopped


def _checked(args: argparse.Namespace) -> dict[str, Any]:
    """The env kwargs, after checking the arguments, the env id, and one env made and reset.

    Raises:
        ConfigError: any of them is wrong (one line).
    """
    if not 0 <= args.port <= MAX_PORT:
        raise ConfigError(f"--port must be 0 to {MAX_PORT} (0: any free port), got {args.port}")
    try:
        env_kwargs = json.loads(args.env_kwargs)
    except json.JSONDecodeError as err:
        raise ConfigError(f"--env-kwargs is not valid JSON ({err})") from None
    if not isinstance(env_kwargs, dict):
        raise ConfigError(f"--env-kwargs must be a JSON object, got {args.env_kwargs!r}")
    if args.max_sessions < 1 or args.step_timeout_s <= 0 or args.idle_timeout_s <= 0:
        raise ConfigError("--max-sessions must be at least 1, --step-timeout-s and --idle-timeout-s above 0")
    if env_urls(args.env_id) is not None:
        raise ConfigError(f"{args.env_id!r} is an env server's URL; serve an env id (frozenlake, pkg.mod:fn, ...)")
    check_env_id(args.env_id)
    _make_and_reset(args.env_id, env_kwargs, max(args.step_timeout_s, MAKE_TIMEOUT_S), args.step_timeout_s)
    return env_kwargs


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) and listening, which the server then serves on (uvicorn's
    `Server.run(sockets=...)`); port 0 binds a free port (`getsockname()` says which).

    Raises:
        ConfigError: the address cannot be bound (in use, not this machine's, no permission).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=BACKLOG)
    except (OSError, OverflowError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else err
        raise ConfigError(f"cannot listen on {host}:{port}: {reason}") from None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _make_and_reset(env_id: str, env_kwargs: dict[str, Any], make_limit_s: float, reset_limit_s: float) -> None:
    """Make one env (awaited `make_limit_s` at most: the first one may import its package), reset it with seed 0
    (awaited `reset_limit_s`, the limit every reset of the server has) and close it, on a daemon thread.

    Raises:
        ConfigError: it raised (a constructor refusing its kwargs, an env failing its reset) or ran past a limit.
    """
    outcome: dict[str, BaseException] = {}
    made = threading.Event()

    def run() -> None:
        try:
            try:
                env = make_env(env_id, **env_kwargs)
            finally:
                made.set()  # made, or failed to be: either way the reset's limit applies from here
            env.reset(seed=0)
            close = getattr(env, "close", None)
            if callable(close):
                close()
        except BaseException as err:  # noqa: BLE001  (reported below, as one line)
            outcome["error"] = err

    thread = threading.Thread(target=run, name="env-check", daemon=True)
    thread.start()
    where = f"env {env_id!r} with --env-kwargs {env_kwargs}"
    if not made.wait(make_limit_s):
        raise ConfigError(f"{where}: making one env ran past {make_limit_s:g} s")
    thread.join(reset_limit_s)
    if thread.is_alive():
        raise ConfigError(f"{where}: resetting one env (seed 0) ran past --step-timeout-s {reset_limit_s:g} s")
    err = outcome.get("error")
    if isinstance(err, RollflowError):
        raise err
    if err is not None:
        lines = str(err).strip().splitlines()
        raise ConfigError(f"{where} could not be made and reset: {type(err).__name__}: "
                          f"{lines[0] if lines else ''}".rstrip(": "))
