"""Asynchronous training end to end: examples/async.yaml (disaggregated, max_staleness 1) in the shared Ray
session, ended and resumed with prompts in flight."""

from __future__ import annotations

import json

import pytest

from rollflow.config import load_config
from rollflow.pipelines.rlvr import run_rlvr

pytestmark = pytest.mark.slow

FAST = ["rollout.groups_per_step=4", "rollout.group_size=4", "train.train_micro_batch_size=16",
        "data.eval.limit=16", "eval.every_steps=0", "output.trackers=[console,jsonl]"]


def test_an_asynchronous_run_stays_within_its_staleness_and_resumes_with_prompts_in_flight(ray_session, tmp_path,
                                                                                          capsys):
    common = [*FAST, "name=run", f"output.dir={tmp_path}"]
    run_rlvr(load_config("examples/async.yaml", ["train.steps=4", *common]), manage_ray=False)
    capsys.readouterr()
    config = load_config("examples/async.yaml", ["train.steps=6", "resume=true", *common])
    run_rlvr(config, manage_ray=False)
    assert "generated again" in capsys.readouterr().out  # the producer ran ahead: the next step's prompts
    rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(7))  # no step lost, none twice
    steps = rows[1:]
    assert all(r["staleness/max"] <= 1 for r in steps)
    assert any(r["staleness/max"] == 1 for r in steps)  # it did generate ahead of the trainer
    assert all(r["rollout/groups/consumed"] == 4 for r in steps)
    assert all("actor/train_infer_ratio_mean" in r for r in steps)  # TIS on by default when asynchronous
