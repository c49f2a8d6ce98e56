"""One environment served over HTTP (`rollflow env serve ENV`), so envs run on machines or in containers of
their own and training reaches them with `env.id: http://host:port/ENV` (`rollflow.envs.remote`).

Routes, under the served env id's text as the path prefix (`frozenlake`, `gem:game:Sokoban-v0-easy`, ...):

    POST /ENV/reset  {"seed": int | null, "kwargs": {...}} -> {"session", "observation", "info", "live"}
    POST /ENV/step   {"session", "action"} -> {"observation", "reward", "terminated", "truncated", "info"}
    POST /ENV/close  {"session"} -> {"closed": bool, "live"}
    GET  /ENV/tools  -> {"tools": the env's `tools()`, or []}
    GET  /health     -> {"status": "ok", "env", "live", "max_sessions", "sessions_served", "errors", "timeouts"}

Every reset makes a new env (`make_env(ENV, **{**env_kwargs, **kwargs})`) in a new session. A session's env
calls run in order on a thread of its own (envs need not be thread-safe; a slow env holds up only its own
session) under `step_timeout_s`. An error is one line of JSON, `{"error": ..., "kind": ...}`, where `kind` says
whose fault it is, and so what a client may do about it:

    env      500  the env raised, or returned what the protocol forbids: the episode's own failure (not retried)
    timeout  504  a call ran past `step_timeout_s`; the session is dropped (its thread is left behind)
    full     503  `max_sessions` sessions are live
    session  404  no such session (closed, idle past `idle_timeout_s`, or the server restarted)
    name     404  the request names an env this server does not serve
    request  422  the body is not what the route takes
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from rollflow.envs.images import images_to_json
from rollflow.envs.make import make_env
from rollflow.envs.threads import EnvThread

SWEEP_EVERY_S = 5.0  # the longest wait between two sweeps for idle sessions


class ResetRequest(BaseModel):
    seed: int | None = None
    kwargs: dict[str, Any] = {}


class StepRequest(BaseModel):
    session: str
    action: str


class CloseRequest(BaseModel):
    session: str


class Refusal(Exception):
    """A request answered with an error: HTTP `status`, `{"error": message, "kind": kind}`."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


class _Session:
    def __init__(self, session_id: str):
        self.id = session_id
        self.thread = EnvThread(f"env-session-{session_id[:8]}")
        self.env: Any = None
        self.last_used = time.monotonic()
        self.busy = 0  # calls in flight: a session mid-call is never idle


class EnvServer:
    """The sessions of one served env and their counters; the FastAPI routes of `create_app` call it.

    Everything but the env calls runs on the server's event loop, so the session table needs no lock.
    """

    def __init__(self, env_id: str, env_kwargs: dict[str, Any], max_sessions: int, step_timeout_s: float,
                 idle_timeout_s: float):
        self.env_id, self.env_kwargs = env_id, dict(env_kwargs)
        self.max_sessions, self.step_timeout_s, self.idle_timeout_s = max_sessions, step_timeout_s, idle_timeout_s
        self.sessions: dict[str, _Session] = {}
        self.served = self.errors = self.timeouts = 0
        self.tools_cache: list[dict[str, Any]] | None = None
        self.tools_lock = asyncio.Lock()

    def check_name(self, name: str) -> None:
        if name != self.env_id:
            raise Refusal(404, "name", f"this server serves {self.env_id!r}, not {name!r}")

    async def reset(self, seed: int | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        self.expire_idle()
        if len(self.sessions) >= self.max_sessions:
            raise Refusal(503, "full", f"server full: {len(self.sessions)} live sessions "
                                       f"(--max-sessions {self.max_sessions})")
        session = _Session(uuid.uuid4().hex)
        self.sessions[session.id] = session  # held while it is made: the bound counts it
        merged = {**self.env_kwargs, **kwargs}

        def make_and_reset():
            session.env = make_env(self.env_id, **merged)
            return session.env.reset(seed=seed)

        value = await self.call(session, make_and_reset, "reset")
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            self.fail(session, f"env reset returned {_short(value)}, not (observation, info)")
        observation, info = value
        self.served += 1
        return {"session": session.id, "observation": self.text(session, observation, "reset"),
                "info": self.info(session, info), "live": len(self.sessions)}

    async def step(self, session_id: str, action: str) -> dict[str, Any]:
        session = self.session(session_id)
        value = await self.call(session, lambda: session.env.step(action), "step")
        if not isinstance(value, (tuple, list)) or len(value) != 5:
            self.fail(session, f"env step returned {_short(value)}, not (observation, reward, terminated, "
                               "truncated, info)")
        observation, reward, terminated, truncated, info = value
        try:
            number = float(reward) if not isinstance(reward, (str, bytes)) else math.nan
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number):
            self.fail(session, f"env step returned a reward of {_short(reward)}, expected a finite number")
        return {"observation": self.text(session, observation, "step"), "reward": number,
                "terminated": bool(terminated), "truncated": bool(truncated),
                "info": self.info(session, info)}

    def close(self, session_id: str) -> dict[str, Any]:
        closed = self.drop(session_id)
        return {"closed": closed, "live": len(self.sessions)}

    async def tools(self) -> list[dict[str, Any]]:
        """The env's `tools()` (one env made to ask, then closed; the answer is cached)."""
        async with self.tools_lock:
            if self.tools_cache is None:
                session = _Session("tools-" + uuid.uuid4().hex)

                def ask():
                    session.env = make_env(self.env_id, **self.env_kwargs)
                    tools = getattr(session.env, "tools", None)
                    return tools() if callable(tools) else []

                value = await self.call(session, ask, "tools")
                self.drop_session(session)
                try:
                    json.dumps(value, allow_nan=False)
                except (TypeError, ValueError) as err:
                    raise Refusal(500, "env", f"env tools() returned what JSON cannot carry ({err})") from None
                if not isinstance(value, list):
                    raise Refusal(500, "env", f"env tools() returned {_short(value)}, not a list of tool specs")
                self.tools_cache = value
            return self.tools_cache

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "env": self.env_id, "live": len(self.sessions), "max_sessions": self.max_sessions,
                "sessions_served": self.served, "errors": self.errors, "timeouts": self.timeouts}

    async def call(self, session: _Session, fn: Callable[[], Any], what: str) -> Any:
        """`fn` on the session's thread within `step_timeout_s`; a time-out or an exception drops the session
        and becomes a Refusal (504 or 500)."""
        session.busy += 1
        session.last_used = time.monotonic()
        try:
            future = session.thread.submit(fn)
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout=self.step_timeout_s)
        except asyncio.TimeoutError:
            self.timeouts += 1
            self.sessions.pop(session.id, None)
            session.thread.stop()  # the hung call keeps its thread; the session is gone
            raise Refusal(504, "timeout", f"env {what} ran past the server's step time limit of "
                                          f"{self.step_timeout_s:g} s") from None
        except Exception as err:  # noqa: BLE001  (the env's own error fails its episode, not the server)
            self.errors += 1
            self.drop_session(session)
            lines = str(err).strip().splitlines()
            raise Refusal(500, "env", f"env {what} raised {type(err).__name__}: "
                                      f"{lines[0] if lines else ''}".rstrip(": ")) from None
        finally:
            session.busy -= 1
            session.last_used = time.monotonic()

    def session(self, session_id: str) -> _Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise Refusal(404, "session", f"no session {session_id!r} on this server (closed, idle past "
                                          f"{self.idle_timeout_s:g} s, or the server restarted)")
        return session

    def info(self, session: _Session, info: Any) -> dict[str, Any]:
        """The reply's info: JSON-safe, an image observation's images as base64 PNG (`rollflow.envs.images`)."""
        try:
            return json_safe(images_to_json(info if isinstance(info, dict) else {}))
        except ValueError as err:
            self.fail(session, str(err))

    def text(self, session: _Session, observation: Any, what: str) -> str:
        if not isinstance(observation, str):
            self.fail(session, f"env {what} returned an observation of type {type(observation).__name__} "
                               f"({_short(observation)}), expected text (str)")
        return observation

    def fail(self, session: _Session, message: str) -> None:
        """Drop the session of an env that broke the protocol, and answer 500 (the env's fault)."""
        self.errors += 1
        self.drop_session(session)
        raise Refusal(500, "env", message)

    def drop(self, session_id: str) -> bool:
        session = self.sessions.get(session_id)
        if session is None:
            return False
        self.drop_session(session)
        return True

    def drop_session(self, session: _Session) -> None:
        """Forget the session; its env's `close()` runs on its thread, not awaited, then the thread ends."""
        self.sessions.pop(session.id, None)
        close = getattr(session.env, "close", None)
        if callable(close):
            session.thread.submit(close)
        session.thread.stop()

    def expire_idle(self) -> None:
        """Close the sessions unused for longer than `idle_timeout_s` (their client died or forgot them)."""
        now = time.monotonic()
        for session in list(self.sessions.values()):
            if not session.busy and now - session.last_used > self.idle_timeout_s:
                self.drop_session(session)

    async def sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(min(max(self.idle_timeout_s / 4, 0.05), SWEEP_EVERY_S))
            self.expire_idle()

    def close_all(self) -> None:
        for session in list(self.sessions.values()):
            self.drop_session(session)


def create_app(env_id: str, env_kwargs: dict[str, Any] | None = None, max_sessions: int = 256,
               step_timeout_s: float = 30.0, idle_timeout_s: float = 600.0) -> FastAPI:
    """The HTTP app serving `env_id` (see the module docstring for its routes).

    Args:
        env_id: any id `make_env` takes (a built-in, `gem:...`, `gym:...`, `pkg.module:factory`); also the path
            prefix of the routes.
        env_kwargs: keyword arguments of every env made; a reset's `kwargs` override them.
        max_sessions: the most live sessions; a reset past it answers 503.
        step_timeout_s: time limit of one env call (a reset includes making the env).
        idle_timeout_s: a session unused this long is closed.

    Returns:
        The FastAPI app (run it with uvicorn; `app.state.env_server` is its `EnvServer`).
    """
    server = EnvServer(env_id, env_kwargs or {}, max_sessions, step_timeout_s, idle_timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        sweeper = asyncio.create_task(server.sweep_forever())
        try:
            yield
        finally:
            sweeper.cancel()
            server.close_all()

    app = FastAPI(title=f"rollflow env {env_id}", lifespan=lifespan)

    @app.exception_handler(Refusal)
    async def refused(request: Request, err: Refusal) -> JSONResponse:
        return JSONResponse({"error": err.message, "kind": err.kind}, status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, err: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(part) for part in e['loc'])}: {e['msg']}" for e in err.errors())
        return JSONResponse({"error": f"bad request: {problems}", "kind": "request"}, status_code=422)

    @app.exception_handler(HTTPException)
    async def not_found(request: Request, err: HTTPException) -> JSONResponse:
        return JSONResponse({"error": f"{request.method} {request.url.path}: {err.detail}", "kind": "request"},
                            status_code=err.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse(server.health())

    @app.post("/{name:path}/reset")
    async def reset(name: str, body: ResetRequest) -> JSONResponse:
        server.check_name(name)
        return JSONResponse(await server.reset(body.seed, body.kwargs))

    @app.post("/{name:path}/step")
    async def step(name: str, body: StepRequest) -> JSONResponse:
        server.check_name(name)
        return JSONResponse(await server.step(body.session, body.action))

    @app.post("/{name:path}/close")
    async def close(name: str, body: CloseRequest) -> JSONResponse:
        server.check_name(name)
        return JSONResponse(server.close(body.session))

    @app.get("/{name:path}/tools")
    async def tools(name: str) -> JSONResponse:
        server.check_name(name)
        return JSONResponse({"tools": await server.tools()})

    app.state.env_server = server
    return app


def json_safe(value: Any, depth: int = 0) -> Any:
    """`value` as JSON can carry it: numpy / torch scalars as their Python value, non-finite floats as text,
    lists and dicts of such (three levels deep), anything else as a short repr."""
    if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)):
        value = value.item()  # str() of np.False_ would be truthy text
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    if depth < 3 and isinstance(value, (list, tuple)):
        return [json_safe(item, depth + 1) for item in value]
    if depth < 3 and isinstance(value, dict):
        return {str(key): json_safe(item, depth + 1) for key, item in value.items()}
    return _short(value)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
