"""Joining a Ray cluster by address (`cluster.address`): a failure is one line, and comes within seconds.

`ray.init(address=...)` against an address where no cluster answers retries for minutes (twenty attempts of
~41 s), printing a warning every few seconds; `join_ray` probes the address first and gives Ray one attempt,
with Ray's console output held back unless it joins.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator

JOIN_PROBE_TIMEOUT_S = 10.0  # how long `join_ray` waits for a cluster's address to accept a TCP connection


def join_ray(address: str, runtime_env: dict | None = None) -> None:
    """`ray.init(address=...)`, failing in one line, and soon, when no Ray cluster answers there.

    A `HOST:PORT` (or `ray://HOST:PORT`) address is first tried with a plain TCP connection
    (`check_reachable`): a refused connection fails at once and silence after `JOIN_PROBE_TIMEOUT_S`, where
    `ray.init` would retry for minutes, printing a warning every few seconds. What passes (a port open, the
    `auto` address) goes to `ray.init` with one connection attempt instead of Ray's twenty (its
    `RAY_gcs_server_port_wait_time_s`, unless set already); its console output is held back meanwhile and
    printed only if it joins.

    Raises:
        ConfigError: `cannot reach the Ray cluster at ADDRESS (why); ...`.
    """
    import ray

    check_reachable(address)
    attempts = {} if "RAY_gcs_server_port_wait_time_s" in os.environ else {"RAY_gcs_server_port_wait_time_s": "1"}
    with _stderr_held() as held, _environment(attempts):
        try:
            ray.init(address=address, runtime_env=runtime_env, logging_level=logging.WARNING, log_to_driver=True)
        except (ConnectionError, RuntimeError, ValueError, TimeoutError) as err:
            held.discard()
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise _unreachable(address, f"Ray: {reason}") from None


def check_reachable(address: str, timeout_s: float | None = None) -> None:
    """That a TCP connection to the `HOST:PORT` of a Ray address (`ray://` or not) opens within `timeout_s`
    (default `JOIN_PROBE_TIMEOUT_S`), name lookup included; other addresses (`auto`) are left to Ray.

    Raises:
        ConfigError: the connection is refused, the host unknown or silent.
    """
    import socket
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(address if "://" in address else f"//{address}")
        host, port = parts.hostname, parts.port
    except ValueError:  # a port that is not a number in 0..65535
        raise _unreachable(address, "not HOST:PORT") from None
    if not host or port is None:
        return
    timeout_s = JOIN_PROBE_TIMEOUT_S if timeout_s is None else timeout_s
    outcome: list[OSError | None] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            outcome.append(None)
        except OSError as err:
            outcome.append(err)

    thread = threading.Thread(target=probe, name="rollflow-ray-probe", daemon=True)  # a lookup can hang
    thread.start()
    thread.join(timeout_s + 1)
    if outcome and outcome[0] is None:
        return
    err = outcome[0] if outcome else None
    if err is None or isinstance(err, TimeoutError):
        reason = f"no answer within {timeout_s:.0f} s"
    elif isinstance(err, socket.gaierror):
        reason = f"unknown host {host!r}"
    elif isinstance(err, ConnectionRefusedError):
        reason = "connection refused"
    else:
        reason = err.strerror or str(err)
    raise _unreachable(address, reason)


def _unreachable(address: str, reason: str) -> Exception:
    from rollflow.errors import ConfigError

    return ConfigError(f"cannot reach the Ray cluster at {address} ({reason}); start it with `ray start --head` "
                       "or fix cluster.address")


@contextlib.contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    """`variables` set in this process's environment for the block, then put back as they were."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _HeldOutput:
    def __init__(self, file) -> None:
        self.file, self.discarded = file, False

    def discard(self) -> None:
        self.discarded = True


@contextlib.contextmanager
def _stderr_held() -> Iterator[_HeldOutput]:
    """What this process writes to file descriptor 2 during the block (Python's and Ray's C++ logging alike)
    goes to a temporary file, and is written out after it unless `discard()`ed: a failed join's warnings are
    then not printed, while a successful one's are, in full."""
    import tempfile

    sys.stderr.flush()
    with tempfile.TemporaryFile() as file:
        saved = os.dup(2)
        os.dup2(file.fileno(), 2)
        held = _HeldOutput(file)
        try:
            yield held
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            file.seek(0)
            data = b"" if held.discarded else file.read()
            while data:
                data = data[os.write(2, data):]
