"""A client of envs served by `rollflow env serve` (`rollflow.envs.service`): `env.id: http://host:port/ENV`,
or a list of such URLs.

`RemoteEnv` is an env like any other to the env workers. Each episode is one session on one server, the least
loaded one this process knows of. A call that fails for a reason that is not the env's (the server died,
answered too slowly, answered 5xx or something that is not the expected JSON, or forgot the session) is
retried on a fresh session: preferably on another server (a server that failed gets no new session for
`FAILED_SERVER_REST_S` while another can serve), it is reset with the episode's seed and kwargs, the
episode's actions so far are replayed (envs are deterministic per seed; a replay that sees another observation
gives up), then the failed call runs again. At most `retries` times a call, then `RemoteEnvError`. A retry goes
at once to a server that has not failed this call; once every server has, the client first waits (`backoff_s`,
doubling each time, each wait at most `BACKOFF_CAP_S` and `timeout_s`), so a server restarted within seconds is
reached again. The env's own exception (or an env breaking the protocol) is not retried: it fails the episode,
as it would in process.
Every reset's and step's info carries `env_retries`, the retries that call needed.

Connections are pooled in one `httpx.Client` per process (it is thread-safe: an env worker steps many envs on
threads of their own); every request has a time limit.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from typing import Any

import httpx

from rollflow.envs.images import IMAGES_KEY, images_from_json
from rollflow.errors import RollflowError

CLOSE_TIMEOUT_S = 2.0  # a close is a courtesy: the server expires forgotten sessions by itself
FAILED_SERVER_REST_S = 10.0  # a server that just failed gets no new session for this long, while others serve
BACKOFF_CAP_S = 8.0  # the longest wait before a retry (the waits double from `backoff_s`)

_lock = threading.Lock()
_client: httpx.Client | None = None
_client_pid: int | None = None
_held: dict[str, int] = {}  # url -> live sessions this process holds there
_reported: dict[str, int] = {}  # url -> live sessions the server said it had (all its clients) at the last reset
_turn = itertools.count()
_resting: dict[str, float] = {}  # url -> monotonic time until which it gets no new session (it just failed)
_tools: dict[str, list[dict[str, Any]]] = {}


class RemoteEnvError(RollflowError):
    """An env server failed a call for good (after its retries), or the env it serves raised; one line."""


class _Retryable(Exception):
    """A failure that is not the env's own: worth a fresh session (the message says what happened)."""


def http_client() -> httpx.Client:
    """The process's pooled client (a new one in a forked child: connections do not survive a fork)."""
    global _client, _client_pid
    with _lock:
        if _client is None or _client_pid != os.getpid():
            _client = httpx.Client(limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
            _client_pid = os.getpid()
        return _client


def choose_url(urls: list[str], avoid: str | None = None) -> str:
    """The least loaded of `urls`: fewest sessions this process holds there, then fewest the server last
    reported; ties rotate. `avoid` (a server that just failed) is skipped when there is another, and so are
    servers that failed in the last `FAILED_SERVER_REST_S` (a dead server holds no sessions: it would look
    least loaded to every new episode)."""
    now = time.monotonic()
    candidates = [url for url in urls if url != avoid] or list(urls)
    with _lock:
        candidates = [url for url in candidates if _resting.get(url, 0.0) <= now] or candidates
        loads = {url: (_held.get(url, 0), _reported.get(url, 0)) for url in candidates}
        least = min(loads.values())
        ties = [url for url in candidates if loads[url] == least]
        return ties[next(_turn) % len(ties)]


def held_sessions() -> dict[str, int]:
    """URL -> live sessions this process holds there (a copy)."""
    with _lock:
        return dict(_held)


def _count(url: str, change: int, reported: Any = None) -> None:
    with _lock:
        _held[url] = max(_held.get(url, 0) + change, 0)
        if isinstance(reported, int):
            _reported[url] = reported


class RemoteEnv:
    """An env played on env servers (`rollflow env serve`), one session per episode.

    Args:
        urls: the servers' URLs, `http://host:port/ENV` each, all serving the same ENV.
        timeout_s: time limit of one HTTP request (keep it above the server's `--step-timeout-s`, so a slow env
            answers 504 before the client gives up).
        retries: fresh sessions a failed call may use before `RemoteEnvError`.
        backoff_s: the wait before the first retry that finds every server failed in this call; each later wait
            doubles, at most `BACKOFF_CAP_S` and `timeout_s` (0: no waits). A call's waits add up to at most
            `retries * min(BACKOFF_CAP_S, timeout_s)`.
        **env_kwargs: sent with every reset; the server passes them to the env's constructor (over its own
            `--env-kwargs`).
    """

    def __init__(self, urls: list[str], timeout_s: float = 30.0, retries: int = 2, backoff_s: float = 1.0,
                 **env_kwargs: Any):
        if not urls:
            raise RemoteEnvError("RemoteEnv needs at least one server URL")
        if not timeout_s > 0 or retries < 0 or not backoff_s >= 0:
            raise RemoteEnvError(f"RemoteEnv needs timeout_s > 0, retries >= 0 and backoff_s >= 0, got {timeout_s}, "
                                 f"{retries} and {backoff_s}")
        self.urls = [url.rstrip("/") for url in urls]
        self.timeout_s, self.retries, self.env_kwargs = float(timeout_s), int(retries), env_kwargs
        self.backoff_s = float(backoff_s)
        self.url: str | None = None  # the server of the current session (or of the last attempt at one)
        self.session: str | None = None
        self.seed: int | None = None
        self.actions: list[str] = []  # the episode's actions so far, for a replay
        self.observations: list[tuple] = []  # the reset's observation (text, images), then each step's
        self._opened: dict[str, Any] = {}

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """A new session (on the least loaded server) reset with `seed`. Returns (observation, info)."""
        self.close()
        self.seed, self.actions, self.observations = seed, [], []
        reply, retries = self._retrying("reset", lambda: self._opened, open_first=True)
        self.observations.append(_seen(reply))
        return reply["observation"], {**reply["info"], "env_retries": retries}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """One step on the session. Returns (observation, reward, terminated, truncated, info)."""
        if self.session is None:
            raise RemoteEnvError("RemoteEnv.step without a session: reset it first (a failed call ends the session)")
        reply, retries = self._retrying("step", lambda: self._step(action))
        self.actions.append(action)
        self.observations.append(_seen(reply))
        return (reply["observation"], reply["reward"], reply["terminated"], reply["truncated"],
                {**reply["info"], "env_retries": retries})

    def tools(self) -> list[dict[str, Any]]:
        """The served env's tool specs (`[]` when it has none), asked once per server and process."""
        failures = []
        for url in sorted(self.urls, key=lambda url: url not in _tools):
            if url in _tools:
                return _tools[url]
            try:
                reply = self._request(url, "GET", "tools", None, self.timeout_s)
            except _Retryable as err:
                failures.append(f"{url}: {err}")
                continue
            if not isinstance(reply.get("tools"), list):
                failures.append(f"{url}: the reply holds no list of tools")
                continue
            _tools[url] = reply["tools"]
            return reply["tools"]
        raise RemoteEnvError(f"env servers gave no tools: {'; '.join(failures)}")

    def close(self) -> None:
        """End the session (errors ignored: the server closes forgotten sessions when they idle out)."""
        if self.session is None:
            return
        url, session = self.url, self.session
        self.session = None
        _count(url, -1)
        try:
            http_client().post(f"{url}/close", json={"session": session}, timeout=CLOSE_TIMEOUT_S)
        except httpx.HTTPError:
            pass

    def _retrying(self, what: str, call, open_first: bool = False) -> tuple[dict[str, Any], int]:
        """`call()`, after opening a session when `open_first`; each retryable failure opens a fresh session
        (replaying the episode) and calls again, `retries` times at most, after a wait once every server has
        failed this call (`backoff_wait`). Returns (reply, retries used)."""
        avoid, failure, failed, waits = None, "", set(), 0
        for attempt in range(self.retries + 1):
            if attempt and failed.issuperset(self.urls):  # no server left untried: give them time to come back
                _pause(self.backoff_wait(waits))
                waits += 1
            try:
                if open_first or attempt:
                    self.close()
                    self._open(avoid)
                return call(), attempt
            except _Retryable as err:
                avoid, failure = self.url, str(err)
                failed.add(avoid)
                with _lock:
                    _resting[avoid] = time.monotonic() + FAILED_SERVER_REST_S
        self.close()
        tries = "retry" if self.retries == 1 else "retries"
        raise RemoteEnvError(f"env server {avoid}: {what} failed after {self.retries} {tries}: {failure}")

    def backoff_wait(self, waits: int) -> float:
        """Seconds to wait before a retry, after `waits` earlier waits in the call: `backoff_s` doubled `waits`
        times, at most `BACKOFF_CAP_S` and `timeout_s`."""
        return min(self.backoff_s * 2.0 ** waits, BACKOFF_CAP_S, self.timeout_s)

    def _open(self, avoid: str | None) -> None:
        """A new session on the least loaded server (not `avoid`, when there is another), reset with the
        episode's seed, its recorded actions replayed."""
        self.url = url = choose_url(self.urls, avoid)
        reply = self._request(url, "POST", "reset", {"seed": self.seed, "kwargs": self.env_kwargs}, self.timeout_s)
        if not isinstance(reply.get("session"), str) or not isinstance(reply.get("observation"), str) \
                or not isinstance(reply.get("info"), dict):
            raise _Retryable(f"the reply is not a reset result ({_short(reply)})")
        reply = _with_images(reply)
        self.session = reply["session"]
        _count(url, +1, reply.get("live"))
        self._opened = reply
        if not self.observations:
            return
        self._check_replay(0, _seen(reply))
        for index, action in enumerate(self.actions, start=1):
            self._check_replay(index, _seen(self._step(action)))

    def _check_replay(self, index: int, observation: tuple) -> None:
        if observation != self.observations[index]:
            self.close()
            raise RemoteEnvError(f"env server {self.url}: replaying the episode (seed {self.seed}) on a fresh "
                                 f"session gave another observation after {index} of its {len(self.actions)} "
                                 "actions; a remote env must play the same episode for the same seed")

    def _step(self, action: str) -> dict[str, Any]:
        reply = self._request(self.url, "POST", "step", {"session": self.session, "action": action},
                              self.timeout_s)
        if not isinstance(reply.get("observation"), str) or not isinstance(reply.get("info"), dict) \
                or not isinstance(reply.get("reward"), (int, float)) or isinstance(reply.get("reward"), bool):
            raise _Retryable(f"the reply is not a step result ({_short(reply)})")
        return {**_with_images(reply), "reward": float(reply["reward"]), "terminated": bool(reply.get("terminated")),
                "truncated": bool(reply.get("truncated"))}

    @staticmethod
    def _request(url: str, method: str, route: str, body: dict[str, Any] | None, timeout_s: float) -> dict:
        """One request; its JSON reply on 200. Raises _Retryable (no reply in time, no connection, a 5xx that
        is not the env's error, a session the server lost, a reply that is not a JSON object) or
        RemoteEnvError (the env's own error; a request the server refuses)."""
        try:
            response = http_client().request(method, f"{url}/{route}", json=body, timeout=timeout_s)
        except httpx.TimeoutException:
            raise _Retryable(f"no reply within {timeout_s:g} s (timeout_s)") from None
        except httpx.ConnectError as err:
            raise _Retryable("connection refused" if "refused" in str(err).lower()
                             else f"cannot connect ({_first_line(err)})") from None
        except httpx.TransportError as err:  # reset, closed mid-reply, a reply that is not HTTP
            raise _Retryable(f"connection failed ({type(err).__name__}: {_first_line(err)})") from None
        try:
            reply = response.json()
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise _Retryable(f"the reply is not a JSON object (HTTP {response.status_code}: "
                             f"{_short(response.text)})")
        if response.status_code == 200:
            return reply
        error, kind = str(reply.get("error", _short(reply))), reply.get("kind")
        if kind == "env":
            raise RemoteEnvError(f"env server {url}: {error}")
        if response.status_code >= 500 or kind == "session":
            raise _Retryable(f"HTTP {response.status_code}: {error}")
        raise RemoteEnvError(f"env server {url}: HTTP {response.status_code}: {error}")


def _pause(seconds: float) -> None:
    """Wait between two tries of a call (tests replace it to count the waits instead of sleeping)."""
    time.sleep(seconds)


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def _short(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else repr(value)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _with_images(reply: dict[str, Any]) -> dict[str, Any]:
    """The reply with its info's images (an image observation's, base64 over HTTP) back as PNG bytes."""
    try:
        return {**reply, "info": images_from_json(reply["info"])}
    except ValueError as err:
        raise _Retryable(str(err)) from None


def _seen(reply: dict[str, Any]) -> tuple:
    """What a replay must give again: the observation text and its images."""
    images = reply["info"].get(IMAGES_KEY)
    return reply["observation"], tuple(images) if isinstance(images, list) else None
