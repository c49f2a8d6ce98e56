"""A short RLVR run whose reward is a weighted mix of `math_answer` and an `llm_judge` served by a reward
worker, the bundled tiny model being both the policy and the judge (examples/llm_judge.yaml, shrunk)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rollflow.config import load_config
from rollflow.pipelines.rlvr import run_rlvr

pytestmark = pytest.mark.slow

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "llm_judge.yaml"
SMALL = ["train.steps=2", "rollout.groups_per_step=4", "rollout.group_size=4",
         "train.train_micro_batch_size=16", "data.eval.limit=8", "eval.every_steps=0", "output.trackers=[jsonl]",
         "roles.actor_train.num_cpus=1", "output.samples_logged_per_step=16"]


def test_rlvr_with_math_answer_and_llm_judge(ray_session, tmp_path):
    config = load_config(RECIPE, [*SMALL, "name=judge", f"output.dir={tmp_path}"])
    weights = {f.name: f.weight for f in config.reward.functions}
    assert weights == {"math_answer": 1.0, "llm_judge": 0.2}
    run_rlvr(config, manage_ray=False)

    rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert all(math.isfinite(v) for row in rows for v in row.values())
    for row in rows[1:]:  # each reward is its own metric, the judge's parse failures too
        assert {"rollout/reward/math_answer", "rollout/reward/llm_judge", "rollout/reward/llm_judge/parse_failed",
                "time/reward_wait"} <= set(row)
        assert row["rollout/failed_ratio"] == 0.0
        assert 0.0 <= row["rollout/reward/llm_judge"] <= 1.0
    assert {"eval/reward/math_answer", "eval/reward/llm_judge"} <= set(rows[0]) | set(rows[-1])

    samples = [json.loads(line) for line in (config.run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 16
    for sample in samples:  # the weights are applied: total = 1.0 * math_answer + 0.2 * llm_judge
        parts = sample["rewards"]
        assert sample["reward"] == pytest.approx(parts["math_answer"] + 0.2 * parts["llm_judge"])
        # The stand-in judge echoes a numeric answer: a number >= 1 scores 1, anything else 0.
        assert parts["llm_judge"] in (0.0, 1.0) and parts["llm_judge/parse_failed"] in (0.0, 1.0)
    judged = [s["rewards"]["llm_judge"] for s in samples]
    assert 0 < sum(judged)  # the judge really answered (mostly numbers, from an addition model)
