"""Envs served over HTTP (`rollflow.envs.service`, `rollflow env serve`) and their client
(`rollflow.envs.remote.RemoteEnv`, `env.id: http://host:port/ENV`).

Servers run on uvicorn in a thread of the test process, or as `rollflow env serve` subprocesses where one is
killed mid-episode.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from rollflow.config.agentic import EnvConfig
from rollflow.envs import remote
from rollflow.envs.local_servers import free_port, start_env_servers, stop_env_servers, wait_healthy
from rollflow.envs.make import check_env_id, env_urls, make_env
from rollflow.envs.remote import BACKOFF_CAP_S, RemoteEnv, RemoteEnvError, held_sessions
from rollflow.envs.serve_cli import _make_and_reset
from rollflow.envs.service import create_app, json_safe
from rollflow.errors import ConfigError
from tests.envs import slow_env
from tests.envs.slow_env import TOOLS

SLOW = "tests.envs.slow_env:make"
ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def serving(env_id: str, env_kwargs: dict[str, Any] | None = None, keep_server: bool = False, **limits: Any):
    """`create_app(env_id, ...)` on uvicorn in a thread; yields the env's URL (`keep_server`: the URL and
    (server, thread), for a test that stops it itself)."""
    app = create_app(env_id, env_kwargs or {}, **limits)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.01)
    url = f"http://127.0.0.1:{server.config.port}/{env_id}"
    try:
        yield (url, (server, thread)) if keep_server else url
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def serving_subprocess(env_id: str, count: int):
    """`count` `rollflow env serve` subprocesses; yields [(url, process)]."""
    # a server's start is its imports (~4 s); the limit is a hang guard a loaded machine must not reach
    servers = start_env_servers(env_id, count, cwd=ROOT, limit_s=300, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        yield servers
    finally:
        stop_env_servers(process for _, process in servers)


def post(url: str, route: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/{route}", json=body, timeout=10)


def health(url: str) -> dict[str, Any]:
    return httpx.get(url.rsplit("/", 1)[0] + "/health", timeout=10).json()


def play_in_process(env_id: str, seed: int, env_kwargs: dict[str, Any] | None = None, invalid_at: int = 1):
    """The expert's episode, with one unparsable action at `invalid_at`: (actions, [reset obs, step results])."""
    env = make_env(env_id, **(env_kwargs or {}))
    observation, _ = env.reset(seed)
    actions, results = [], [observation]
    for turn in range(20):
        action = "junk" if turn == invalid_at else env.expert_action()
        result = env.step(action)
        actions.append(action)
        results.append(result[:4] + (json_safe(result[4]),))
        if result[2] or result[3]:
            return actions, results
    raise AssertionError("the expert's episode did not end")


def step_results(env, actions: list[str]) -> list[tuple]:
    results = []
    for action in actions:
        observation, reward, terminated, truncated, info = env.step(action)
        results.append((observation, reward, terminated, truncated, info))
    return results


def without_retries(result: tuple) -> tuple:
    info = {key: value for key, value in result[4].items() if key != "env_retries"}
    return result[:4] + (info,)


# --- the server -----------------------------------------------------------------------------------------------


def test_two_sessions_of_one_seed_play_independently_like_in_process():
    actions, expected = play_in_process("frozenlake", seed=5)
    with serving("frozenlake") as url:
        first, second = post(url, "reset", seed=5).json(), post(url, "reset", seed=5).json()
        assert first["session"] != second["session"] and second["live"] == 2
        assert first["observation"] == second["observation"] == expected[0]
        # the first session plays its whole episode before the second moves: the second starts where it was
        for session in (first["session"], second["session"]):
            played = [post(url, "step", session=session, action=action).json() for action in actions]
            assert [(r["observation"], r["reward"], r["terminated"], r["truncated"], r["info"]) for r in played] \
                == expected[1:]
        assert post(url, "close", session=first["session"]).json() == {"closed": True, "live": 1}
        unknown = post(url, "step", session="no-such-session", action="Left")
        assert unknown.status_code == 404 and unknown.json()["kind"] == "session"
        assert "no session 'no-such-session'" in unknown.json()["error"]
        other = post(url.replace("frozenlake", "sokoban"), "reset", seed=0)
        assert other.status_code == 404
        assert other.json()["error"] == "this server serves 'frozenlake', not 'sokoban'"


def test_a_step_past_the_time_limit_answers_504_and_drops_the_session():
    slow_env.STEP_RELEASE.clear()
    with serving(SLOW, {"hang_step": True}, step_timeout_s=0.2) as url:
        session = post(url, "reset", seed=0).json()["session"]
        try:
            reply = post(url, "step", session=session, action="Right")  # answered while the step still hangs
        finally:
            slow_env.STEP_RELEASE.set()
        assert reply.status_code == 504
        assert reply.json() == {"error": "env step ran past the server's step time limit of 0.2 s", "kind": "timeout"}
        assert post(url, "step", session=session, action="Right").status_code == 404
        assert health(url)["live"] == 0 and health(url)["timeouts"] == 1


def test_sessions_are_bounded_and_freed_on_close():
    with serving("frozenlake", max_sessions=2) as url:
        sessions = [post(url, "reset", seed=seed).json()["session"] for seed in (0, 1)]
        full = post(url, "reset", seed=2)
        assert full.status_code == 503
        assert full.json()["error"] == "server full: 2 live sessions (--max-sessions 2)"
        post(url, "close", session=sessions[0])
        assert post(url, "reset", seed=2).status_code == 200


def test_idle_sessions_expire():
    with serving("frozenlake", idle_timeout_s=0.3) as url:
        session = post(url, "reset", seed=0).json()["session"]
        deadline = time.monotonic() + 30  # ~0.3 s
        while health(url)["live"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert health(url)["live"] == 0
        assert post(url, "step", session=session, action="Left").status_code == 404


def test_health_counts_sessions_errors_and_timeouts():
    with serving(SLOW, {"raise_on_step": True}, max_sessions=7) as url:
        assert health(url) == {"status": "ok", "env": SLOW, "live": 0, "max_sessions": 7, "sessions_served": 0,
                               "errors": 0, "timeouts": 0}
        session = post(url, "reset", seed=0).json()["session"]
        reply = post(url, "step", session=session, action="Left")
        assert reply.status_code == 500
        assert reply.json() == {"error": "env step raised ValueError: the env broke on purpose", "kind": "env"}
        assert health(url) == {"status": "ok", "env": SLOW, "live": 0, "max_sessions": 7, "sessions_served": 1,
                               "errors": 1, "timeouts": 0}


def test_tools_endpoint_forwards_the_envs_tools():
    with serving(SLOW, {"with_tools": True}) as url, serving("frozenlake") as plain:
        assert httpx.get(f"{url}/tools", timeout=10).json() == {"tools": TOOLS}
        assert httpx.get(f"{plain}/tools", timeout=10).json() == {"tools": []}
        assert RemoteEnv([url]).tools() == TOOLS


def test_info_is_made_json_safe_and_observations_must_be_text():
    numpy = pytest.importorskip("numpy")
    assert json_safe({"a": numpy.float32(0.5), "b": numpy.bool_(False), "c": float("nan"), "d": object,
                      "e": [1, (2, numpy.int64(3))]}) == {"a": 0.5, "b": False, "c": "nan", "d": "<class 'object'>",
                                                          "e": [1, [2, 3]]}
    with serving("tests.envs.test_service:dict_observation_env") as url:
        reply = post(url, "reset", seed=0)
        assert reply.status_code == 500 and reply.json()["kind"] == "env"
        assert "observation of type dict" in reply.json()["error"]


class _DictObservation:
    def reset(self, seed=None):
        return {"board": 1}, {}

    def step(self, action):
        raise AssertionError("never reached")


def dict_observation_env(**kwargs):
    return _DictObservation()


# --- the client -------------------------------------------------------------------------------------------------


def test_the_client_plays_like_in_process_and_picks_the_least_loaded_server():
    actions, expected = play_in_process("frozenlake", seed=3)
    with serving("frozenlake") as first, serving("frozenlake") as second:
        envs = [RemoteEnv([first, second]) for _ in range(4)]
        for env in envs:
            observation, info = env.reset(3)
            assert observation == expected[0] and info["env_retries"] == 0
        assert held_sessions()[first] == held_sessions()[second] == 2
        assert health(first)["live"] == health(second)["live"] == 2
        results = step_results(envs[0], actions)
        assert [without_retries(result) for result in results] == expected[1:]
        assert all(result[4]["env_retries"] == 0 for result in results)
        freed = envs[0].url
        envs[0].close()
        envs[0].reset(4)  # the server one session lighter gets it
        assert envs[0].url == freed
        for env in envs:
            env.close()
        assert held_sessions()[first] == held_sessions()[second] == 0


@contextlib.contextmanager
def two_killable_servers(how: str):
    """Two frozenlake servers, `rollflow env serve` subprocesses ("process") or uvicorn in threads of this
    process ("thread"); yields {url: a function that ends that server at once}."""
    if how == "process":
        with serving_subprocess("frozenlake", 2) as servers:
            def kill(process: subprocess.Popen) -> None:
                process.kill()
                process.wait(10)

            yield {url: functools.partial(kill, process) for url, process in servers}
        return
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(serving("frozenlake", keep_server=True)) for _ in range(2)]

        def stop(server: uvicorn.Server, thread: threading.Thread) -> None:
            server.should_exit = server.force_exit = True  # no graceful wait: its sockets close at once
            thread.join(10)

        yield {url: functools.partial(stop, *held) for url, held in servers}


# killed `rollflow env serve` processes cost two servers' start (~4 s of imports each on 2 cores): the slow
# tier's; the same client path against servers in threads stays in the fast one
@pytest.mark.parametrize("how", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_a_killed_server_is_replayed_on_the_other_and_the_episode_ends_as_in_process(how):
    actions, expected = play_in_process("frozenlake", seed=11)
    with two_killable_servers(how) as kills:
        env = RemoteEnv(list(kills), timeout_s=5)
        assert env.reset(11)[0] == expected[0]
        results = step_results(env, actions[:2])
        killed = env.url
        kills[killed]()
        results += step_results(env, actions[2:])
        assert env.url != killed
        assert [without_retries(result) for result in results] == expected[1:]
        assert [result[4]["env_retries"] for result in results] == [0, 0, 1] + [0] * (len(actions) - 3)
        env.close()
        # the dead server holds no sessions, yet new episodes do not try it first: it rests after failing
        others = [RemoteEnv(list(kills), timeout_s=5) for _ in range(3)]
        assert [other.reset(11)[1]["env_retries"] for other in others] == [0, 0, 0]
        assert all(other.url != killed for other in others)
        for other in others:
            other.close()


def test_a_slow_server_is_retried_on_the_other():
    actions, expected = play_in_process(SLOW, seed=2)
    slow_env.STEP_RELEASE.clear()
    with serving(SLOW, {"hang_step": True}) as slow, serving(SLOW) as fast:
        holder = RemoteEnv([fast])
        holder.reset(0)  # the fast server holds one session, so the next episode starts on the slow one
        env = RemoteEnv([slow, fast], timeout_s=2.0)  # the slow server's steps hang; the fast one's take ms
        env.reset(2)
        assert env.url == slow
        try:
            results = step_results(env, actions)
        finally:
            slow_env.STEP_RELEASE.set()
        assert env.url == fast
        assert [without_retries(result) for result in results] == expected[1:]
        assert results[0][4]["env_retries"] == 1 and all(r[4]["env_retries"] == 0 for r in results[1:])
        env.close()
        holder.close()


class _Garbage(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        _Garbage.hits.append(f"{self.command} {self.path}")
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(b"<html>surely not JSON</html>")

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


def test_a_server_answering_garbage_fails_after_the_retries_in_one_line(monkeypatch):
    waits = []
    monkeypatch.setattr(remote, "_pause", waits.append)  # recorded, not slept (~3 s): the waits are below
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Garbage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/frozenlake"
    try:
        with pytest.raises(RemoteEnvError) as raised:
            RemoteEnv([url], timeout_s=2, retries=2).reset(0)
    finally:
        server.shutdown()
        server.server_close()
    message = str(raised.value)
    assert "\n" not in message
    assert message == (f"env server {url}: reset failed after 2 retries: the reply is not a JSON object "
                       "(HTTP 200: <html>surely not JSON</html>)")
    assert _Garbage.hits == ["POST /frozenlake/reset"] * 3
    assert len(waits) == 2  # one before each retry (one server: nowhere else to go at once)


def test_the_envs_own_exception_is_not_retried():
    with serving(SLOW, {"raise_on_step": True}) as url, serving(SLOW) as other:
        env = RemoteEnv([url])
        env.reset(0)
        with pytest.raises(RemoteEnvError) as raised:
            env.step("Left")
        assert str(raised.value) == f"env server {url}: env step raised ValueError: the env broke on purpose"
        assert health(url)["sessions_served"] == 1 and health(other)["sessions_served"] == 0
        env.close()


def test_the_client_bounds_every_call(monkeypatch):
    monkeypatch.setattr(remote, "_pause", lambda seconds: None)  # its 1 s wait before the retry
    port = free_port()  # nothing listens there
    env = RemoteEnv([f"http://127.0.0.1:{port}/frozenlake"], timeout_s=1, retries=1)
    with pytest.raises(RemoteEnvError, match=r"reset failed after 1 retry: connection refused$"):
        env.reset(0)
    with pytest.raises(RemoteEnvError, match="reset it first"):
        env.step("Left")


class _DownFirst:
    """A fake transport (`httpx.MockTransport`) whose server refuses the first `down` connections, then answers
    a reset; it records, in order, each request (`"request"`) and each wait of the client (its seconds)."""

    def __init__(self, down: int):
        self.down, self.events = down, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.events.append("request")
        if self.events.count("request") <= self.down:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        return httpx.Response(200, json={"session": "s1", "observation": "board", "info": {}, "live": 1})


@pytest.fixture
def down_first(monkeypatch):
    """Install a `_DownFirst(down)` as the client's transport, its waits recorded instead of slept."""
    def install(down: int) -> _DownFirst:
        transport = _DownFirst(down)
        monkeypatch.setattr(remote, "_client", httpx.Client(transport=httpx.MockTransport(transport)))
        monkeypatch.setattr(remote, "_client_pid", os.getpid())
        monkeypatch.setattr(remote, "_pause", transport.events.append)
        return transport
    return install


def test_retries_back_off_doubling_up_to_the_request_limit(down_first):
    transport = down_first(down=4)
    env = RemoteEnv(["http://down-first.test:1/frozenlake"], timeout_s=3.0, retries=5, backoff_s=1.0)
    observation, info = env.reset(0)
    assert (observation, info["env_retries"]) == ("board", 4)
    # a wait before every retry (the one server failed), doubling from backoff_s: 1, 2, 4 -> capped at timeout_s 3
    assert transport.events == ["request", 1.0, "request", 2.0, "request", 3.0, "request", 3.0, "request"]
    assert [env.backoff_wait(n) for n in range(6)] == [1.0, 2.0, 3.0, 3.0, 3.0, 3.0]
    slow = RemoteEnv(["http://down-first.test:1/frozenlake"], timeout_s=60.0, backoff_s=1.0)
    assert [slow.backoff_wait(n) for n in range(6)] == [1.0, 2.0, 4.0, BACKOFF_CAP_S, BACKOFF_CAP_S, BACKOFF_CAP_S]
    env.close()


def test_a_server_down_for_good_costs_the_retries_and_their_bounded_waits(down_first):
    transport = down_first(down=100)
    env = RemoteEnv(["http://down-for-good.test:1/frozenlake"], timeout_s=1.5, retries=3, backoff_s=0.5)
    with pytest.raises(RemoteEnvError, match=r"reset failed after 3 retries: connection refused$"):
        env.reset(0)
    waits = [event for event in transport.events if event != "request"]
    assert transport.events.count("request") == 4 and waits == [0.5, 1.0, 1.5]
    assert sum(waits) <= env.retries * env.timeout_s


def test_a_retry_goes_at_once_to_a_server_that_has_not_failed(down_first):
    transport = down_first(down=1)  # the first server tried refuses; the other answers
    env = RemoteEnv(["http://first.test:1/frozenlake", "http://second.test:1/frozenlake"], backoff_s=1.0)
    assert env.reset(0)[1]["env_retries"] == 1
    assert transport.events == ["request", "request"]  # no wait: another server was left to try
    env.close()


def test_a_server_restarted_while_the_client_waits_is_reached_again(monkeypatch):
    port = free_port()
    url = f"http://127.0.0.1:{port}/frozenlake"
    started: list[tuple[uvicorn.Server, threading.Thread]] = []

    def restart(seconds: float) -> None:  # the client's first wait: the server comes (back) up meanwhile
        server = uvicorn.Server(uvicorn.Config(create_app("frozenlake"), host="127.0.0.1", port=port,
                                               log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        started.append((server, thread))
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "the test server did not start"
            time.sleep(0.01)

    monkeypatch.setattr(remote, "_pause", restart)
    env = RemoteEnv([url], timeout_s=5, retries=2)
    try:
        observation, info = env.reset(3)
        assert observation == make_env("frozenlake").reset(3)[0] and info["env_retries"] == 1
        assert len(started) == 1
        env.close()
    finally:
        for server, thread in started:
            server.should_exit = True
            thread.join(10)


# --- env ids and config -----------------------------------------------------------------------------------------


def test_env_urls_and_their_checks():
    assert env_urls("frozenlake") is None and env_urls("pkg.mod:make") is None and env_urls("gem:x") is None
    assert env_urls("http://10.0.0.5:8000/frozenlake/") == ["http://10.0.0.5:8000/frozenlake"]
    both = ["http://a:1/gem:game:Sokoban-v0-easy", "https://b:2/gem:game:Sokoban-v0-easy"]
    assert env_urls(both) == both
    check_env_id(both)
    for bad, words in [("http://:8000/frozenlake", "has no host"), ("http://a:99999/frozenlake", "bad port"),
                       ("http://a:1/", "names no env"), ("http://a:1/x?y=1", "query"),
                       (["http://a:1/x", "http://b:1/y"], "different envs"), (["frozenlake"], "only env server"),
                       ([], "empty list")]:
        with pytest.raises(ConfigError, match=words):
            check_env_id(bad)
    assert isinstance(make_env(both), RemoteEnv)  # no network until reset


def test_env_config_takes_a_list_of_urls():
    urls = ["http://a:8000/frozenlake", "http://b:8000/frozenlake/"]
    assert EnvConfig(id=urls).id == ["http://a:8000/frozenlake", "http://b:8000/frozenlake"]
    assert EnvConfig(id="http://a:8000/frozenlake").id == "http://a:8000/frozenlake"
    with pytest.raises(ValueError, match="only env server URLs"):
        EnvConfig(id=["frozenlake", "sokoban"])


# --- the command line -------------------------------------------------------------------------------------------


def test_serve_refuses_an_unknown_env_in_one_line(cli):
    done = cli("env", "serve", "nosuchenv")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("rollflow: error: unknown environment 'nosuchenv'")
    assert done.stdout == ""


@pytest.mark.slow  # the server's own process (~4 s of imports on 2 cores) and its signal handling
def test_serve_on_port_0_prints_the_port_it_got_and_stops_on_sigterm():
    process = subprocess.Popen([sys.executable, "-m", "rollflow.cli", "env", "serve", "frozenlake", "--port", "0",
                                "--max-sessions", "3"], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert select.select([process.stdout], [], [], 60)[0], "the server printed nothing within 60 s"
        first = process.stdout.readline()
        assert first.startswith("serving frozenlake at http://127.0.0.1:"), first
        url = first.split()[3]
        port = int(url.split(":")[2].split("/")[0])
        assert port != 0 and url == f"http://127.0.0.1:{port}/frozenlake"
        wait_healthy(url, process)
        assert post(url, "reset", seed=0).status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=20)
    assert process.returncode == 0, stderr
    assert first + stdout == f"serving frozenlake at {url} (max 3 sessions)\n"


@pytest.mark.parametrize("port", ["-1", "70000"])
def test_serve_refuses_a_port_out_of_range_in_one_line(cli, port):
    done = cli("env", "serve", "frozenlake", "--port", port)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"rollflow: error: --port must be 0 to 65535 (0: any free port), got {port}\n"


def test_serve_checks_the_first_reset_within_the_step_time_limit():
    """Making the first env may take its imports' time; its reset gets `--step-timeout-s`, like every reset."""
    slow_env.RESET_RELEASE.clear()
    try:
        with pytest.raises(ConfigError) as raised:
            _make_and_reset(SLOW, {"hang_reset": True}, 120.0, 0.2)
    finally:
        slow_env.RESET_RELEASE.set()
    assert str(raised.value) == (f"env {SLOW!r} with --env-kwargs {{'hang_reset': True}}: resetting one env "
                                 "(seed 0) ran past --step-timeout-s 0.2 s")


def test_an_image_observation_crosses_http_as_the_env_drew_it():
    from rollflow.envs.frozenlake import FrozenLake
    from rollflow.envs.images import image_bytes

    kwargs = {"size": 4, "max_turns": 6, "observation": "image"}
    local = FrozenLake(**kwargs)
    _, local_info = local.reset(seed=5)
    with serving("frozenlake", kwargs) as url:
        env = RemoteEnv([url])
        observation, info = env.reset(5)
        assert observation == "<image>" and info["images"] == image_bytes(local_info["images"])
        step = env.step("Down")
        assert step[4]["images"] == image_bytes(local.step("Down")[4]["images"])
        env.close()
