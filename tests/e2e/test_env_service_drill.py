"""The `killed` case of the env service's fault drill (bench/env_service_drill.py), through the command line: one
of a run's two env servers (`rollflow env serve` processes) is SIGKILLed after the first step; its episodes are
replayed on the other server, and the run finishes every step. The run is the command line's `main` in this
process (the `cli` fixture), where the drill starts a `rollflow train` process: the servers are what fails."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

DRILL = Path(__file__).resolve().parents[2] / "bench" / "env_service_drill.py"


def _load_drill():
    """The bench script as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("env_service_drill", DRILL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class _RunInProgress:
    """What the drill's `during` hooks poll (a `subprocess.Popen`'s `poll`): None until the run has returned."""

    def __init__(self):
        self.returned = threading.Event()

    def poll(self) -> int | None:
        return 0 if self.returned.is_set() else None


def test_a_server_killed_mid_run_costs_retries_never_the_run(tmp_path, cli, monkeypatch):
    drill = _load_drill()
    case = next(case for case in drill.CASES if case.name == "killed")
    (tmp_path / "config.yaml").write_text(drill.CONFIG)
    monkeypatch.chdir(tmp_path)  # the config's `output.dir: runs`, as the drill runs it
    servers, run, during = [], _RunInProgress(), {}
    try:
        case.servers(tmp_path, servers)
        drill.wait_healthy(servers)
        killer = threading.Thread(target=lambda: during.update(note=case.during(run, tmp_path, servers)), daemon=True)
        killer.start()
        try:
            result = cli("train", "config.yaml", "env.id=[" + ", ".join(server.url for server in servers) + "]")
        finally:
            run.returned.set()
            killer.join(timeout=60)
        health = [drill.sessions_and_timeouts(server) for server in servers]
    finally:
        drill.stop_servers(servers)
    steps = [row for row in drill.metrics_rows(tmp_path) if "rollout/failed" in row]
    retries = sum(row.get("rollout/env_retries", 0.0) for row in steps)
    failed = sum(row.get("rollout/failed", 0.0) for row in steps)
    steps_done = len({row["step"] for row in steps})
    summary = {"note": during.get("note"), "exit": result.returncode, "stderr": result.stderr[-2000:],
               "steps_done": steps_done, "env_retries": retries, "failed": failed, "servers": health}
    assert during.get("note", "").startswith("killed http://127.0.0.1:"), summary
    assert result.returncode == 0, summary
    assert steps_done == drill.STEPS, summary  # a step row in metrics.jsonl for each of steps 1..4
    assert retries + failed > 0, summary
    assert drill.classify(result.returncode, result.stderr, steps_done, retries + failed) == "retried", summary
    assert health[0] is None and health[1][0] > 0, summary  # killed; the other served
