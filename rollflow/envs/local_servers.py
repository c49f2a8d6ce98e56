"""`rollflow env serve` subprocesses on this machine: for benches, drills and tests that play envs through the
service (`bench/agentic_async.py --service N`, `bench/env_service_drill.py`), and for a script that wants a
few local servers behind one `env.id` list.

    servers = start_env_servers("frozenlake", 2, {"size": 4})   # [(url, process)], each answering /health
    try:
        ...  # env.id: [url for url, _ in servers]
    finally:
        stop_env_servers(process for _, process in servers)
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx

START_LIMIT_S = 30.0  # a server imports fastapi, uvicorn and the env's package before it listens
STOP_GRACE_S = 10.0


def free_port() -> int:
    """A TCP port nothing listens on at 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_env_server(env_id: str, env_kwargs: dict[str, Any] | None = None, args: Iterable[str] = (),
                     cwd: str | Path | None = None, **popen: Any) -> tuple[str, subprocess.Popen]:
    """One `rollflow env serve ENV` on a free local port; not yet answering (`wait_healthy`).

    Args:
        env_id: the env to serve.
        env_kwargs: its `--env-kwargs`.
        args: more `rollflow env serve` flags (`--max-sessions`, `--step-timeout-s`, ...).
        cwd: the server's working directory (where a `module:factory` env's module sits).
        **popen: passed to `subprocess.Popen` (stdout defaults to DEVNULL).

    Returns:
        (its URL `http://127.0.0.1:PORT/ENV`, the process).
    """
    port = free_port()
    command = [sys.executable, "-m", "rollflow.cli", "env", "serve", env_id, "--port", str(port),
               "--env-kwargs", json.dumps(env_kwargs or {}), *args]
    process = subprocess.Popen(command, cwd=cwd, **{"stdout": subprocess.DEVNULL, **popen})
    return f"http://127.0.0.1:{port}/{env_id}", process


def wait_healthy(url: str, process: subprocess.Popen, limit_s: float = START_LIMIT_S) -> None:
    """Wait until the server at `url` answers `/health`.

    Raises:
        RuntimeError: the process exited first, or `limit_s` passed.
    """
    health = url.rsplit("/", 1)[0] + "/health"
    deadline = time.monotonic() + limit_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"env server {url} exited with status {process.returncode}")
        try:
            if httpx.get(health, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"env server {url} did not answer /health within {limit_s:g} s")
        time.sleep(0.1)


def start_env_servers(env_id: str, count: int, env_kwargs: dict[str, Any] | None = None, args: Iterable[str] = (),
                      cwd: str | Path | None = None, limit_s: float = START_LIMIT_S,
                      **popen: Any) -> list[tuple[str, subprocess.Popen]]:
    """`count` servers of `env_id` (`start_env_server`), each answering /health; all are stopped if one fails.

    Returns:
        [(url, process)].

    Raises:
        RuntimeError: a server exited or did not answer within `limit_s`.
    """
    servers: list[tuple[str, subprocess.Popen]] = []
    try:
        for _ in range(count):
            servers.append(start_env_server(env_id, env_kwargs, tuple(args), cwd, **popen))
        for url, process in servers:
            wait_healthy(url, process, limit_s)
    except BaseException:
        stop_env_servers(process for _, process in servers)
        raise
    return servers


def stop_env_servers(processes: Iterable[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM each server still running (it stops gracefully), then kill any still running `grace_s` later."""
    processes = list(processes)
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(grace_s)
