"""Asynchronous training end to end, in the shared Ray session: examples/async.yaml (disaggregated,
max_staleness 1, partial rollout `continue`) and an asynchronous FrozenLake run, each driver killed with
`kill -9` while the next step's prompts (env seeds) are in flight, then resumed: it trains every prompt (plays
every seed) exactly once, in the steps the uninterrupted run does."""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

import pytest

from rollflow.config import load_config
from rollflow.pipelines.agentic import run_agentic
from rollflow.pipelines.rlvr import run_rlvr
from tests.e2e.test_interrupted_runs import kill_9_after_checkpoint

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ASYNC = str(REPO / "examples" / "async.yaml")
FAST = ["rollout.groups_per_step=4", "rollout.group_size=4", "train.train_micro_batch_size=16",
        "data.eval.limit=16", "eval.every_steps=0", "output.trackers=[console,jsonl]", "output.save_every_steps=1",
        "train.steps=5", "output.samples_logged_per_step=16"]


def _trained_prompts(run_dir: Path) -> dict[int, collections.Counter]:
    """Step -> the prompts its trained samples came from (`samples.jsonl` holds every sample of a step)."""
    steps: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["status"] in ("finished", "truncated"):
            steps[record["step"]][record["prompt"]] += 1
    return dict(steps)


def _kill_9_then_resume(config_path: str, overrides: list[str], run, tmp_path: Path, capsys):
    """The uninterrupted run (`whole`, in this process), then the command line's run (`killed`) killed with
    `kill -9` once its step-2 checkpoint is written (the producer runs a step ahead of it: prompts are in
    flight) and resumed in this process. Returns the resumed run's config."""
    run(load_config(config_path, [*overrides, "name=whole", f"output.dir={tmp_path}"]), manage_ray=False)
    killed = [*overrides, "name=killed", f"output.dir={tmp_path}"]
    kill_9_after_checkpoint(config_path, killed, tmp_path / "killed")
    capsys.readouterr()
    config = load_config(config_path, [*killed, "resume=true"])
    run(config, manage_ray=False)
    assert re.search("(generated|played) again", capsys.readouterr().out)  # what was in flight at the checkpoint
    return config


def test_an_asynchronous_run_killed_with_prompts_in_flight_resumes_to_train_each_prompt_once(ray_session, tmp_path,
                                                                                           capsys):
    # exact old logprobs: the trainer keeps the last 2 versions' weights, a resumed one only the loaded version's
    # (what was in flight is generated again by it)
    config = _kill_9_then_resume(ASYNC, [*FAST, "algorithm.old_logprobs=exact"], run_rlvr, tmp_path, capsys)

    # staleness bounded at admission: each step trains the prompts drawn for it, whatever finished first, so the
    # killed and resumed run trains the uninterrupted run's prompts, step by step (none skipped, none twice)
    whole, resumed = _trained_prompts(tmp_path / "whole"), _trained_prompts(config.run_dir)
    assert sorted(whole) == sorted(resumed) == [1, 2, 3, 4, 5]
    assert all(sum(prompts.values()) == 16 for prompts in whole.values())
    assert resumed == whole
    rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6))  # no step lost, none twice
    steps = rows[1:]
    assert all(r["staleness/max"] <= 1 and r["rollout/stale_dropped"] == 0 for r in steps)
    assert any(r["staleness/max"] == 1 for r in steps)  # it did generate ahead of the trainer
    assert all(r["rollout/groups/consumed"] == 4 for r in steps)
    assert all("actor/train_infer_ratio_mean" in r for r in steps)  # TIS on by default when asynchronous
    # tokens of the version before the trainer's were trained against their own version's logprobs: the TIS
    # ratio is the engine-trainer discrepancy alone (the hf engine runs the trainer's model: float noise)
    assert any(r["actor/stale_token_frac"] > 0 for r in steps)
    assert all(r["actor/train_infer_log_ratio_abs_mean"] < 1e-4 for r in steps)
    assert all(r["time/old_logprobs"] > 0 for r in steps)  # the forward passes' wait, for `rollflow diagnose`


AGENTIC = ["pipeline=agentic", "env.id=frozenlake", "env.kwargs={size: 3, max_turns: 4}", "env.max_turns=4",
           "rollout.samples=trajectory", "rollout.groups_per_step=2", "rollout.group_size=2",
           "rollout.max_new_tokens=6", "rollout.max_staleness=1", "roles.actor_train.device_mapping=[0]",
           "roles.actor_infer.device_mapping=[1]", "eval.every_steps=0", "eval.episodes=0",
           "output.trackers=[console,jsonl]", "output.save_every_steps=1", "train.steps=5",
           "output.samples_logged_per_step=16", "algorithm.old_logprobs=exact"]


def test_an_asynchronous_agentic_run_killed_with_episodes_in_flight_plays_each_seed_once(ray_session, tmp_path,
                                                                                       capsys):
    path = tmp_path / "agentic.yaml"
    path.write_text("pipeline: agentic\n")
    config = _kill_9_then_resume(str(path), AGENTIC, run_agentic, tmp_path, capsys)
    # an episode's first prompt is its env seed's map: each step trains the seeds drawn for it
    whole, resumed = _trained_prompts(tmp_path / "whole"), _trained_prompts(config.run_dir)
    assert sorted(whole) == sorted(resumed) == [1, 2, 3, 4, 5]
    assert resumed == whole
    rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["staleness/max"] <= 1 and r["rollout/stale_dropped"] == 0 for r in rows[1:])
    # multi-turn episodes with exact old logprobs: env tokens between turns carry no version and are not trained
    assert any(r["actor/stale_token_frac"] > 0 for r in rows[1:])
    assert all(r["actor/train_infer_log_ratio_abs_mean"] < 1e-4 for r in rows[1:])
