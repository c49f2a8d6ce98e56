"""A broken reward fails its samples, never the step: a step whose samples all failed is logged, trains
nothing and the run goes on to the end (in the shared Ray session)."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from rollflow.config import load_config
from rollflow.models import resolve_model_path
from rollflow.pipelines.rlvr import run_rlvr

pytestmark = pytest.mark.slow

SMALL = ["train.steps=3", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
         "train.train_micro_batch_size=16", "data.eval.limit=8", "eval.every_steps=0", "output.trackers=[jsonl]",
         "roles.actor_train.num_cpus=1", "checks.logprob_parity_samples=0"]


def test_a_step_whose_samples_all_fail_is_skipped_and_the_run_finishes(ray_session, tmp_path, monkeypatch):
    module = tmp_path / "broken_rewards.py"
    module.write_text(textwrap.dedent("""
        def always_fails(completion, **row):
            raise RuntimeError("this reward is broken")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(None, [*SMALL, "reward.functions=[{name: 'broken_rewards:always_fails'}]",
                                "name=broken", f"output.dir={tmp_path}"])
    final = run_rlvr(config, manage_ray=False)

    rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2, 3]  # every step logged, the run reached its end
    for row in rows[1:]:
        assert row["rollout/failed_ratio"] == 1.0 and row["train/usable_samples"] == 0.0
        assert not any(key.startswith(("actor/", "sync/")) for key in row)  # no update, no weight sync
    assert final["train/usable_samples"] == 0.0
    samples = [json.loads(line) for line in (config.run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["status"] == "failed" for s in samples)
    # the final checkpoint holds the untrained model
    saved = load_file(config.run_dir / "checkpoints" / "step_3" / "model" / "model.safetensors")
    initial = load_file(f"{resolve_model_path('tiny')}/model.safetensors")
    assert all(torch.equal(saved[name], initial[name]) for name in saved)
