"""The `killed` case of the env service's fault drill (bench/env_service_drill.py), through the real CLI: one
of a run's two env servers is SIGKILLed after the first step; its episodes are replayed on the other server,
and the run finishes every step."""

from __future__ import annotations

import importlib.util
import sys
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


def test_a_server_killed_mid_run_costs_retries_never_the_run():
    drill = _load_drill()
    case = next(case for case in drill.CASES if case.name == "killed")
    result = drill.run_case(case)
    assert result.get("note", "").startswith("killed http://127.0.0.1:"), result
    assert result["exit"] == 0, result
    assert result["steps_done"] == drill.STEPS, result  # a step row in metrics.jsonl for each of steps 1..4
    assert result["env_retries"] + result["failed"] > 0, result
    assert result["outcome"] == "retried", result
    assert result["servers"][0] is None and result["servers"][1][0] > 0, result  # killed; the other served
