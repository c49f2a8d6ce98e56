"""Simulated GPUs through the real RLVR pipeline (`cluster.device: sim`, docs/simulation.md), in the shared Ray
session: with no response tail and costs that grow with the work, asynchronous training has nothing to hide
(the simulation does not invent a speed-up), and the planner simulates a config's placements and recommends
the fastest.
"""

from __future__ import annotations

import pytest

from rollflow.cli import main
from rollflow.config import load_config
from rollflow.pipelines.plan import Candidate, candidates, format_plan, plan, simulated_overrides, throughput
from rollflow.pipelines.rlvr import run_rlvr

pytestmark = pytest.mark.slow

QUICKSTART = "examples/quickstart.yaml"
# Every cost proportional to the work: decoding to the tokens in the KV cache (no fixed per-step cost, which
# would make small batches wasteful), training to the tokens; no sync, offload or optimizer-step time.
LINEAR = ("{decode_step_s: 0.0, decode_s_per_kv_token: 1.0e-6, prefill_s_per_token: 0.0, "
          "train_gpu_s_per_token: 3.0e-4, forward_gpu_s_per_token: 0.0, optimizer_step_s: 0.0, model_bytes: 0, "
          "sync_fixed_s: 0.0, offload_s: 0.0, onload_s: 0.0}")


def _simulated(tmp_path, name: str, candidate: Candidate, *extra: str) -> dict[str, float]:
    overrides = simulated_overrides(candidate, "h800-7b", 5.0, 16, 1024, 6)
    config = load_config(QUICKSTART, [*overrides, "rollout.groups_per_step=4", f"cluster.sim.overrides={LINEAR}",
                                      *extra, f"name={name}", f"output.dir={tmp_path}"])
    run_rlvr(config, manage_ray=False)
    return throughput(tmp_path / name, 5.0)


def test_without_a_tail_asynchronous_training_has_nothing_to_hide(ray_session, tmp_path):
    # every response 512 simulated tokens: per step (4 groups of 8) 2 colocated GPUs decode in ~3 s and train in
    # ~3 s; split 1 + 1 each side takes ~6 s, overlapped: the same ~6 s a step. (The GPUs are few, each an engine
    # process to start; the load per GPU is what 4 GPUs have with 8 groups.)
    fixed = "roles.actor_infer.engine_kwargs={lengths: {kind: fixed, median: 512}}"
    sync = _simulated(tmp_path, "sync", Candidate(2, 2, True, 0), fixed)
    asynchronous = _simulated(tmp_path, "async", Candidate(1, 1, False, 1), fixed)
    assert sync["rollout_s"] > 2.0 and sync["train_s"] > 2.0  # both sides do work worth hiding
    assert asynchronous["staleness_max"] == 1.0  # it did generate ahead of the trainer
    assert 0.7 < asynchronous["samples_per_s"] / sync["samples_per_s"] < 1.2, (sync, asynchronous)


def test_the_planner_simulates_each_placement_and_recommends_the_fastest(ray_session, tmp_path):
    result = plan(QUICKSTART, ["rollout.groups_per_step=8"], "h800-7b", 2, tmp_path, steps=3, time_scale=50.0,
                  max_new_tokens=2048, manage_ray=False)
    found = result["candidates"]
    assert sorted(c["name"] for c in found) == sorted(c.name for c in candidates(2))  # sync, async k1 and k2
    assert [c["samples_per_s"] for c in found] == sorted((c["samples_per_s"] for c in found), reverse=True)
    synchronous = next(c for c in found if c["max_staleness"] == 0)
    assert result["best"] == found[0]["name"]
    assert result["speedup"] == pytest.approx(found[0]["samples_per_s"] / synchronous["samples_per_s"])
    for c in found:
        assert (tmp_path / c["name"] / "timeline.png").is_file() and c["step_s"] > 0
    text = format_plan(result, tmp_path)
    assert f"recommended: {found[0]['describe']}" in text and "timeline.png" in text


def test_plan_refuses_what_it_cannot_simulate_in_one_line(capsys):
    assert main(["plan", "examples/sft_tiny.yaml", "--gpus", "4"]) == 2
    assert "rollflow plan simulates RLVR configs" in capsys.readouterr().err
    assert main(["plan", QUICKSTART, "--gpus", "4", "--profile", "h900-7b"]) == 2
    assert "unknown simulation profile 'h900-7b'" in capsys.readouterr().err
    assert main(["plan", QUICKSTART, "--gpus", "1"]) == 2
    assert "at least 2 GPUs" in capsys.readouterr().err
