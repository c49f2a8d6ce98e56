"""A broken reward fails its samples, never the step; a reward that fails on every row stops the run with one
line that says why; a reward that hangs on some rows costs those samples `reward.timeout_s`, never the run
(in the shared Ray session)."""

from __future__ import annotations

import json
import textwrap
import time

import pytest

from rollflow.config import load_config
from rollflow.errors import StepFailedError
from rollflow.pipelines.rlvr import run_rlvr

pytestmark = pytest.mark.slow

SMALL = ["train.steps=2", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
         "train.train_micro_batch_size=16", "data.eval.limit=8", "eval.every_steps=0", "output.trackers=[jsonl]",
         "roles.actor_train.num_cpus=1", "checks.logprob_parity_samples=0"]

REWARDS = textwrap.dedent("""
    import time

    def always_fails(completion, **row):
        raise RuntimeError("this reward is broken")

    def hangs_on_odd_sums(completion, **row):
        if int(row["answer"]) % 2:
            time.sleep(3600)
        return float(completion.strip() == str(row["answer"]))
""")


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    (tmp_path / "user_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_reward_that_fails_on_every_row_stops_the_run_with_its_reason(ray_session, tmp_path, rewards_module):
    config = load_config(None, [*SMALL, "reward.functions=[{name: 'user_rewards:always_fails'}]", "data.eval=null",
                                "name=broken", f"output.dir={tmp_path}"])
    with pytest.raises(StepFailedError) as info:
        run_rlvr(config, manage_ray=False)
    assert str(info.value) == ("step 1: all 16 samples failed; the first failed with: "
                               "RuntimeError: this reward is broken")
    assert not (config.run_dir / "checkpoints").exists()  # nothing trained, nothing saved


def test_a_reward_that_hangs_on_some_rows_fails_only_those_samples(ray_session, tmp_path, rewards_module):
    config = load_config(None, [*SMALL, "reward.functions=[{name: 'user_rewards:hangs_on_odd_sums'}]",
                                "reward.timeout_s=1", "output.samples_logged_per_step=16", "name=hangs", f"output.dir={tmp_path}"])
    started = time.monotonic()
    run_rlvr(config, manage_ray=False)
    assert time.monotonic() - started < 120  # each hung call costs 1 s on one of 4 threads, not forever
    rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    samples = [json.loads(line) for line in (config.run_dir / "samples.jsonl").read_text().splitlines()]
    failed = [s for s in samples if s["status"] == "failed"]
    assert failed and all("timed out after 1 s" in s["error"] for s in failed)
