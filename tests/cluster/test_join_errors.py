"""`cluster.address` where no Ray cluster answers is one line, within seconds (`join_ray`): a refused or silent
TCP connection is named before `ray.init` would retry for minutes, printing Ray's warnings meanwhile."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from rollflow.cluster.joining import check_reachable
from rollflow.errors import ConfigError


def _closed_port() -> int:
    """A local port nothing listens on (bound, then let go)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_refused_connection_is_one_line_at_once():
    port = _closed_port()
    started = time.perf_counter()
    with pytest.raises(ConfigError) as error:
        check_reachable(f"127.0.0.1:{port}")
    assert str(error.value) == (f"cannot reach the Ray cluster at 127.0.0.1:{port} (connection refused); start it "
                                "with `ray start --head` or fix cluster.address")
    assert time.perf_counter() - started < 2


@pytest.mark.parametrize("address, reason", [
    ("ray://127.0.0.1:{port}", "connection refused"),  # a Ray client address: the same probe
    ("no-such-host.invalid:6379", "unknown host 'no-such-host.invalid'"),
    ("127.0.0.1:99999", "not HOST:PORT"),
])
def test_other_unreachable_addresses(address, reason):
    address = address.format(port=_closed_port())
    with pytest.raises(ConfigError, match=f"at {address} \\({reason}\\)"):
        check_reachable(address)


def test_a_listening_port_and_auto_pass_the_probe():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_reachable(f"127.0.0.1:{server.getsockname()[1]}")
    check_reachable("auto")  # no host and port: left to ray.init


@pytest.mark.slow  # the command line's own process: its imports are what "within seconds" times
def test_the_command_line_says_it_in_one_line_within_seconds(tmp_path):
    port = _closed_port()
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "rollflow.cli", "train", "examples/quickstart.yaml", f"cluster.address=127.0.0.1:{port}",
         f"output.dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [  # was: Ray's warnings every few seconds, then a ConnectionError traceback
        f"rollflow: error: cannot reach the Ray cluster at 127.0.0.1:{port} (connection refused); start it with "
        "`ray start --head` or fix cluster.address"]
    assert time.perf_counter() - started < 60  # imports only (~7 s on 2 cores)


def test_ray_init_failing_after_the_probe_is_one_line_without_rays_output(monkeypatch, capfd):
    """A port that accepts connections but is no Ray cluster: `ray.init` gets one attempt (not Ray's twenty),
    and what it printed meanwhile (its C++ warnings go straight to file descriptor 2) is dropped."""
    import os

    import ray

    from rollflow.cluster import joining

    attempts = []

    def failing_init(**kwargs):
        attempts.append(os.environ.get("RAY_gcs_server_port_wait_time_s"))
        os.write(2, b"[W rpc_client.h:153] Failed to connect to GCS within 5 seconds.\n")
        raise ConnectionError("Failed to connect to Ray cluster at 192.0.2.2:8265")

    monkeypatch.delenv("RAY_gcs_server_port_wait_time_s", raising=False)
    monkeypatch.setattr(ray, "init", failing_init)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        with pytest.raises(ConfigError) as error:
            joining.join_ray(address)
    assert str(error.value) == (f"cannot reach the Ray cluster at {address} (Ray: Failed to connect to Ray cluster "
                                "at 192.0.2.2:8265); start it with `ray start --head` or fix cluster.address")
    assert attempts == ["1"] and "RAY_gcs_server_port_wait_time_s" not in os.environ  # put back
    assert capfd.readouterr().err == ""


def test_a_join_that_succeeds_prints_what_ray_printed(monkeypatch, capfd):
    import os

    import ray

    from rollflow.cluster import joining

    monkeypatch.setattr(ray, "init", lambda **kwargs: os.write(2, b"a warning of Ray's\n"))
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        joining.join_ray(f"127.0.0.1:{server.getsockname()[1]}")
    assert capfd.readouterr().err == "a warning of Ray's\n"
