"""Fault drills of the env service (docs/env_service.md): short agentic runs through the real command line,
each with its env behind two `rollflow env serve` servers (one `env.id` list), one of which fails, and how
each ended.

Cases:
    killed    one server is SIGKILLed as soon as the run's first step is logged
    slow      one server's env sleeps past the server's `--step-timeout-s` and the client's `timeout_s` on
              every 5th step it serves
    garbage   one of the two URLs is a stdlib HTTP server answering 200 with HTML
    all_dead  both URLs are ports where nothing listens

Each case's outcome is one of:
    retried    exit 0, every step done, and the servers' failures cost retries (`rollout/env_retries`) or
               failed episodes (`rollout/failed`), never the run
    avoided    exit 0, every step done, no retry in a step row: the faulty server failed only calls outside
               the steps' episodes (the env check before the first step, an eval), and after each failure it
               got no new session for the client's `FAILED_SERVER_REST_S` while the other served
    clean      exit status != 0, stderr ends in exactly one `rollflow: error: ...` line, no traceback
    traceback  a Python traceback (or more than one error line) on the console
    hang       still running at the case's time limit (killed)
    silent     exit 0 although a step is missing
The first three cases expect `retried` (or `avoided`), `all_dead` expects `clean` with the line naming a server.

Usage: python bench/env_service_drill.py [--only NAME ...] [--keep]
Prints one JSON line per case, then a summary line; servers and runs are stopped at the end, also on an error,
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from rollflow.envs.local_servers import free_port, start_env_server, stop_env_servers
from rollflow.envs.local_servers import wait_healthy as wait_server

STEPS = 4
RUN_LIMIT_S = 180.0  # a case's run takes 12-25 s on 2 cores; past this it is a hang
SERVER_START_S = 60.0
FIRST_STEP_S = 150.0
SERVER_STEP_TIMEOUT_S = 1.5  # the servers' --step-timeout-s: below the client's timeout_s (the docs' rule)
CLIENT = {"timeout_s": 3, "retries": 2}  # kept by the client (env.kwargs); (2 + 1) * 3 s + a replay < 15 s
FROZENLAKE = {"size": 3, "max_turns": 4}
SLOW = {"sleep_every": 5, "sleep_s": 4.0}  # 4 s: past the server's 1.5 s and the client's 3 s

CONFIG = f"""\
pipeline: agentic
name: drill
seed: 0
model: {{path: tiny}}
env:
  id: frozenlake                 # each case sets the list of its servers' URLs
  kwargs: {json.dumps({**FROZENLAKE, **CLIENT})}
  max_turns: 4
  step_timeout_s: 15             # above (retries + 1) * timeout_s plus a replay
rollout:
  groups_per_step: 4
  group_size: 4
  group_redundancy: 1
  max_new_tokens: 6
train:
  steps: {STEPS}
eval:
  every_steps: 0
  episodes: 8
roles:
  actor_train: {{num_cpus: 1}}
  actor_infer: {{num_cpus: 1}}
  env: {{num_cpus: 1}}
output:
  dir: runs
  trackers: [jsonl]
"""

# Served by dotted path (`drill_envs:make`, from the scratch directory): FrozenLake whose every
# `sleep_every`-th step served by this process (all sessions counted) first sleeps `sleep_s`.
DRILL_ENVS = '''
import itertools
import time

from rollflow.envs.frozenlake import FrozenLake

_steps = itertools.count(1)


class SlowFrozenLake:
    def __init__(self, sleep_every=0, sleep_s=0.0, **frozenlake_kwargs):
        self.env = FrozenLake(**frozenlake_kwargs)
        self.sleep_every, self.sleep_s = sleep_every, sleep_s

    def reset(self, seed=None):
        return self.env.reset(seed)

    def step(self, action):
        if self.sleep_every and next(_steps) % self.sleep_every == 0:
            time.sleep(self.sleep_s)
        return self.env.step(action)


def make(**kwargs):
    return SlowFrozenLake(**kwargs)
'''


@dataclass
class Server:
    url: str
    process: subprocess.Popen | None = None  # a `rollflow env serve`
    http: http.server.ThreadingHTTPServer | None = None  # the garbage server, on a thread of this process


@dataclass
class Case:
    name: str
    servers: Callable[[Path, list[Server]], None]  # appends each server it starts (cwd: the scratch dir)
    expected: str  # the outcome that passes
    during: Callable[[subprocess.Popen, Path, list[Server]], str] | None = None  # what it did, or why not


def serve(scratch: Path, env_id: str, env_kwargs: dict[str, Any]) -> Server:
    """One `rollflow env serve` subprocess on a free port (its cwd the scratch directory, so `drill_envs`
    imports); not yet answering: `wait_healthy`."""
    stderr = open(scratch / f"server_{len(list(scratch.glob('server_*.err')))}.err", "w")  # noqa: SIM115
    url, process = start_env_server(env_id, env_kwargs, ["--step-timeout-s", str(SERVER_STEP_TIMEOUT_S)],
                                    cwd=scratch, stderr=stderr, start_new_session=True)
    stderr.close()  # the child holds it
    return Server(url, process=process)


def wait_healthy(servers: list[Server], limit_s: float = SERVER_START_S) -> None:
    """Every `rollflow env serve` of `servers` answers /health within `limit_s`, else RuntimeError."""
    deadline = time.monotonic() + limit_s
    for server in servers:
        if server.process is not None:
            wait_server(server.url, server.process, max(deadline - time.monotonic(), 0.0))


class _Garbage(http.server.BaseHTTPRequestHandler):
    """200 and an HTML page, whatever is asked."""

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(b"<html>surely not JSON</html>")

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


def garbage_server() -> Server:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Garbage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return Server(f"http://127.0.0.1:{server.server_address[1]}/frozenlake", http=server)


def stop_servers(servers: list[Server]) -> None:
    """SIGTERM every server still running, kill any still running 10 s later; shut the garbage server down."""
    stop_env_servers(server.process for server in servers if server.process is not None)
    for server in servers:
        if server.http is not None:
            server.http.shutdown()
            server.http.server_close()


def sessions_and_timeouts(server: Server) -> list[int] | None:
    """[sessions served, calls past --step-timeout-s] from a live `rollflow env serve`'s /health, or None."""
    if server.process is None or server.process.poll() is not None:
        return None
    try:
        health = httpx.get(server.url.rsplit("/", 1)[0] + "/health", timeout=5).json()
        return [health["sessions_served"], health["timeouts"]]
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def metrics_rows(scratch: Path) -> list[dict]:
    path = scratch / "runs" / "drill" / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line being written
            rows.append(json.loads(line))
    return rows


def live_sessions(server: Server) -> int:
    """Sessions open on `server` now (its /health `live`), 0 if it does not answer."""
    try:
        return int(httpx.get(server.url.rsplit("/", 1)[0] + "/health", timeout=5).json()["live"])
    except (httpx.HTTPError, ValueError, KeyError):
        return 0


def kill_first_server(process: subprocess.Popen, scratch: Path, servers: list[Server]) -> str:
    """SIGKILL the first server once the run's first step row is in metrics.jsonl and the server holds an
    episode (FIRST_STEP_S at most): killed between two steps, with no session open, it would cost nothing, and
    the case would not show what a lost server costs (the run simply avoids it)."""
    deadline = time.monotonic() + FIRST_STEP_S
    while time.monotonic() < deadline and process.poll() is None:
        if any(row.get("step", 0) >= 1 for row in metrics_rows(scratch)) and live_sessions(servers[0]) > 0:
            servers[0].process.kill()
            servers[0].process.wait(10)
            return f"killed {servers[0].url} after step 1, with an episode open on it"
        time.sleep(0.05)
    return "the run logged no step: nothing killed"


# Each appends as it starts, so a server started before a failure (or Ctrl-C) is still stopped.
def two_frozenlakes(scratch: Path, servers: list[Server]) -> None:
    for _ in range(2):
        servers.append(serve(scratch, "frozenlake", FROZENLAKE))


def slow_and_fast(scratch: Path, servers: list[Server]) -> None:
    servers.append(serve(scratch, "drill_envs:make", {**FROZENLAKE, **SLOW}))
    servers.append(serve(scratch, "drill_envs:make", FROZENLAKE))


def garbage_and_frozenlake(scratch: Path, servers: list[Server]) -> None:
    servers.append(garbage_server())
    servers.append(serve(scratch, "frozenlake", FROZENLAKE))


def nothing_listening(scratch: Path, servers: list[Server]) -> None:
    servers.extend(Server(f"http://127.0.0.1:{free_port()}/frozenlake") for _ in range(2))


CASES = [
    Case("killed", two_frozenlakes, "retried", during=kill_first_server),
    Case("slow", slow_and_fast, "retried"),
    Case("garbage", garbage_and_frozenlake, "retried"),
    Case("all_dead", nothing_listening, "clean"),
]


def classify(code: int | None, stderr: str, steps_done: int, failures: float) -> str:
    """The outcome (see the module docstring) of a run that exited with `code` (None: killed at the limit)."""
    if code is None:
        return "hang"
    lines = [line for line in stderr.strip().splitlines() if not line.startswith("rollflow: warning:")]
    if "Traceback" in stderr or sum(line.startswith("rollflow: error:") for line in lines) > 1:
        return "traceback"
    if code == 0:
        if steps_done != STEPS:
            return "silent"
        return "retried" if failures > 0 else "avoided"
    return "clean" if len(lines) == 1 and lines[0].startswith("rollflow: error:") else "traceback"


def run_case(case: Case, keep: bool = False) -> dict[str, Any]:
    """Start the case's servers, run `rollflow train` against them (RUN_LIMIT_S at most), stop everything.

    Returns:
        {case, exit, steps_done, env_retries, failed, eval_env_retries, seconds, outcome, expected, servers,
        last_line, note}: exit None after a hang; env_retries and failed summed over the step rows of
        metrics.jsonl (eval_env_retries over the evals before the first and after the last step); servers
        [sessions served, timeouts] of each `rollflow env serve` still up at the end (null: killed, garbage,
        none).
    """
    scratch = Path(tempfile.mkdtemp(prefix=f"env-drill-{case.name}-"))
    try:
        (scratch / "config.yaml").write_text(CONFIG)
        (scratch / "drill_envs.py").write_text(DRILL_ENVS)
        servers: list[Server] = []
        code, seconds, health, note = play(case, scratch, servers)
        error_text = (scratch / "stderr").read_text()
        rows = metrics_rows(scratch)
    finally:
        if not keep:
            shutil.rmtree(scratch, ignore_errors=True)
    steps = [row for row in rows if "rollout/failed" in row]
    retries = sum(row.get("rollout/env_retries", 0.0) for row in steps)
    failed = sum(row.get("rollout/failed", 0.0) for row in steps)
    steps_done = len({row["step"] for row in steps})
    outcome = classify(code, error_text, steps_done, retries + failed)
    last_line = (error_text.strip().splitlines() or [""])[-1]
    if case.expected == "clean" and outcome == "clean" and not any(s.url in last_line for s in servers):
        note = f"{note}; the error names no server".lstrip("; ")
    return {"case": case.name, "exit": code, "steps_done": steps_done, "env_retries": retries,
            "failed": failed, "eval_env_retries": sum(row.get("eval/env_retries", 0.0) for row in rows),
            "seconds": round(seconds, 1), "outcome": outcome, "expected": case.expected, "servers": health,
            "last_line": last_line[:600], **({"note": note} if note else {}),
            **({"scratch": str(scratch)} if keep else {})}


def play(case: Case, scratch: Path, servers: list[Server]) -> tuple[int | None, float, list, str]:
    """The case's run, its servers appended to `servers`; the run and the servers are stopped on the way out,
    whatever happens (an error, Ctrl-C).

    Returns:
        (exit status, None after a hang; the run's seconds; each server's [sessions served, timeouts] or None;
        what the case's `during` did).
    """
    process = None
    try:
        case.servers(scratch, servers)
        wait_healthy(servers)
        env_id = "[" + ", ".join(server.url for server in servers) + "]"
        started = time.monotonic()
        with open(scratch / "stdout", "w") as stdout, open(scratch / "stderr", "w") as stderr:
            process = subprocess.Popen([sys.executable, "-m", "rollflow.cli", "train", "config.yaml",
                                        f"env.id={env_id}"], cwd=scratch, stdout=stdout, stderr=stderr,
                                       text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                       start_new_session=True)
        note = case.during(process, scratch, servers) if case.during else ""
        try:
            code = process.wait(max(RUN_LIMIT_S - (time.monotonic() - started), 1))
        except subprocess.TimeoutExpired:
            code = None
        return code, time.monotonic() - started, [sessions_and_timeouts(server) for server in servers], note
    finally:
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # the run and the Ray processes it started
            process.wait(30)
        stop_servers(servers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="run only these cases (killed, slow, garbage, all_dead)")
    parser.add_argument("--keep", action="store_true", help="keep each case's scratch directory")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as Ctrl-C: the `finally`s stop every server
    cases = [case for case in CASES if not args.only or case.name in args.only]
    results = []
    for case in cases:
        result = run_case(case, args.keep)
        results.append(result)
        print(json.dumps(result), flush=True)
    passes = {"retried": ("retried", "avoided"), "clean": ("clean",)}
    passed = [r["case"] for r in results if r["outcome"] in passes[r["expected"]] and "names no server" not in
              r.get("note", "")]
    print(json.dumps({"cases": len(results), "as_expected": len(passed),
                      "not_as_expected": [r["case"] for r in results if r["case"] not in passed]}))


if __name__ == "__main__":
    main()
