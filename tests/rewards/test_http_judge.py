"""`http_judge` against a stub OpenAI-compatible server on 127.0.0.1, in a thread of the test process.

The stub checks the request shape (path, headers, JSON body) and answers by the completion being judged:
a canned score, a slow reply, one that waits for company (concurrency), one that hangs until the test ends
(timeouts), HTTP 500 a few times then a score (retries), 500 forever, 400.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rollflow.rewards import RewardLoadError, ScoreError, resolve_reward
from rollflow.rewards.judge import HTTPJudge


class StubServer:
    """`POST /v1/chat/completions` like an OpenAI server; `behaviour[marker]` picks the reply for a judge
    prompt containing `marker`: ("score", text) | ("slow", seconds) | ("paired", seconds): once another
    request is in flight too, after `seconds` | ("hang",): once `release` is set | ("fail_then", n, text) |
    ("status", code)."""

    def __init__(self):
        self.requests: list[dict] = []  # every request received: path, headers, body
        self.behaviour: dict[str, tuple] = {}
        self.failures: dict[str, int] = {}
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        self.release = threading.Event()  # set when the test ends: a hanging reply goes on
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                    stub.in_flight += 1
                    stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
                self.counted = True
                try:
                    stub.reply(self, body)
                finally:
                    stub.answered(self)  # if no reply went out

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def reply(self, handler, body: dict) -> None:
        prompt = body["messages"][-1]["content"]
        marker = next((m for m in self.behaviour if m in prompt), None)
        action = self.behaviour.get(marker, ("score", "5"))
        if action[0] == "paired":
            deadline = time.monotonic() + 10  # a hang guard: the other request comes at once
            while self.in_flight < 2 and time.monotonic() < deadline:
                time.sleep(0.005)
            action = ("slow", action[1])
        if action[0] == "slow":
            time.sleep(action[1])
            action = ("score", "9")
        if action[0] == "hang":
            self.release.wait(60)
            action = ("score", "9")
        if action[0] == "fail_then":
            with self.lock:
                self.failures[marker] = self.failures.get(marker, 0) + 1
                failing = self.failures[marker] <= action[1]
            action = ("status", 500) if failing else ("score", action[2])
        if action[0] == "status":
            self.send(handler, action[1], {"error": {"message": f"stub error {action[1]}"}})
            return
        self.send(handler, 200, {"id": "x", "object": "chat.completion", "model": body["model"],
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": action[1]}}]})

    def answered(self, handler) -> None:
        """`handler`'s request no longer counts as in flight: from just before its reply goes out (the client
        may send its next request as soon as it reads the reply, before this thread runs again)."""
        with self.lock:
            if handler.counted:
                handler.counted = False
                self.in_flight -= 1

    def send(self, handler, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.answered(handler)
        try:
            handler.send_response(status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
            pass


@pytest.fixture
def stub():
    server = StubServer()
    yield server
    server.release.set()
    server.server.shutdown()
    server.server.server_close()


def _judge(stub: StubServer, **options) -> HTTPJudge:
    defaults = {"base_url": stub.url, "model": "judge-model", "template": "Q={prompt} A={completion}",
                "backoff_s": 0.01}
    return HTTPJudge(resolve_reward("http_judge", {**defaults, **options}).options)


def _score(judge: HTTPJudge, completions: list[str], prompt: str = "2+2") -> list:
    return asyncio.run(judge.score_group(completions, [{"prompt": prompt, "answer": "4"}] * len(completions)))


def test_happy_path_request_shape_and_scores(stub, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    stub.behaviour = {"A=four": ("score", "Score: 8"), "A=five": ("score", "10/10"),
                      "A=huh": ("score", "cannot say")}
    judge = _judge(stub, api_key_env="JUDGE_KEY", system_prompt="You grade.", max_tokens=7, temperature=0.5,
                   extra_body={"top_p": 0.9})
    scores = _score(judge, ["four", "five", "huh"])
    assert scores == [
        {"reward": pytest.approx(0.8), "parse_failed": 0.0, "call_failed": 0.0},
        {"reward": 1.0, "parse_failed": 0.0, "call_failed": 0.0},
        {"reward": 0.0, "parse_failed": 1.0, "call_failed": 0.0},
    ]
    assert len(stub.requests) == 3
    first = next(r for r in stub.requests if "A=four" in r["body"]["messages"][-1]["content"])
    assert first["path"] == "/v1/chat/completions"
    assert first["headers"]["Authorization"] == "Bearer sk-test"
    assert first["headers"]["Content-Type"] == "application/json"
    assert first["body"] == {
        "model": "judge-model", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
        "messages": [{"role": "system", "content": "You grade."}, {"role": "user", "content": "Q=2+2 A=four"}],
    }


def test_base_url_with_v1_and_no_key(stub):
    judge = _judge(stub, base_url=stub.url + "/v1/")
    assert judge.url == stub.url + "/v1/chat/completions"
    assert _score(judge, ["x"])[0]["reward"] == pytest.approx(0.5)
    assert "Authorization" not in stub.requests[0]["headers"]


def test_timeout_fails_the_sample_fast(stub):
    stub.behaviour = {"A=slow": ("hang",)}  # answers only once the test is over
    judge = _judge(stub, timeout_s=1.0, max_retries=1)  # a quick reply takes milliseconds
    started = time.perf_counter()
    scores = _score(judge, ["slow", "quick"])
    elapsed = time.perf_counter() - started
    assert isinstance(scores[0], ScoreError)
    assert "failed 2 time(s)" in scores[0].message and "timed out" in scores[0].message
    assert scores[1]["reward"] == pytest.approx(0.5)  # the other sample is unaffected
    assert elapsed < 30  # 2 attempts x 1 s + backoff, not the hang's 60 s (a hang guard)
    assert sum("A=slow" in r["body"]["messages"][-1]["content"] for r in stub.requests) == 2


def test_retries_then_succeeds(stub):
    stub.behaviour = {"A=flaky": ("fail_then", 2, "7")}
    scores = _score(_judge(stub, max_retries=3), ["flaky"])
    assert scores == [{"reward": pytest.approx(0.7), "parse_failed": 0.0, "call_failed": 0.0}]
    assert stub.failures["A=flaky"] == 3  # two 500s, then the answer


def test_500_forever_fails_or_scores_zero(stub):
    stub.behaviour = {"A=down": ("status", 500)}
    scores = _score(_judge(stub, max_retries=2), ["down"])
    assert scores == [ScoreError(f"{stub.url}/v1/chat/completions failed 3 time(s); last: HTTP 500: "
                                 '{"error": {"message": "stub error 500"}}')]
    assert len(stub.requests) == 3
    assert _score(_judge(stub, max_retries=0, on_error="zero"), ["down"]) == [
        {"reward": 0.0, "parse_failed": 0.0, "call_failed": 1.0}]


def test_client_errors_are_not_retried(stub):
    stub.behaviour = {"A=bad": ("status", 400)}
    scores = _score(_judge(stub, max_retries=3), ["bad"])
    assert isinstance(scores[0], ScoreError) and "answered HTTP 400" in scores[0].message
    assert len(stub.requests) == 1


def test_concurrency_is_bounded(stub):
    stub.behaviour = {"A=s": ("paired", 0.2)}  # two at once for sure; 0.2 s for a third to show up if sent
    scores = _score(_judge(stub, max_concurrency=2), [f"s{i}" for i in range(6)])
    assert all(s["reward"] == pytest.approx(0.9) for s in scores)
    assert stub.max_in_flight == 2


def test_unreachable_server_is_a_failed_call():
    judge = HTTPJudge(resolve_reward("http_judge", {"base_url": "http://127.0.0.1:9", "model": "m",
                                                     "max_retries": 1, "backoff_s": 0.0}).options)
    scores = _score(judge, ["x"])
    assert isinstance(scores[0], ScoreError) and "Connection refused" in scores[0].message


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"model": "m"}, "base_url must be an http:// or https:// URL, got None"),
        ({"base_url": "localhost:8000", "model": "m"}, "base_url must be an http"),
        ({"base_url": "http://h"}, "needs model"),
        ({"base_url": "http://h", "model": "m", "api_key_env": "ROLLFLOW_NO_SUCH_KEY"}, "is not set"),
        ({"base_url": "http://h", "model": "m", "on_error": "retry"}, "on_error must be 'fail' or 'zero'"),
        ({"base_url": "http://h", "model": "m", "timeout_s": 0}, "timeout_s must be > 0"),
        ({"base_url": "http://h", "model": "m", "url": "x"}, "does not take option.*url"),
    ],
)
def test_bad_config_fails_in_one_line(options, pattern):
    with pytest.raises(RewardLoadError, match=pattern) as info:
        resolve_reward("http_judge", options)
    assert "\n" not in str(info.value)
