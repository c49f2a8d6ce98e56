"""The agentic pipeline end to end through Ray: StarPO on FrozenLake, GiGPO on Sokoban (and GiGPO on FrozenLake
in examples/agentic_frozenlake.yaml), a GEM game through
the adapter, the python-tool env with the sandbox (on a hybrid engine), RLVR prompts with a calculator
(`tool_use`), env faults (raising and hanging steps), asynchronous
groups, and the CLI.

The runs share one Ray session (`ray_session`) and run in-process (`manage_ray=False`); each costs a few
seconds of worker start-up, so each run checks several things.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from rollflow.cli import EXIT_USER_ERROR, main
from rollflow.config import load_config
from rollflow.errors import ConfigError
from rollflow.fresh_model import save_fresh_model
from rollflow.pipelines.agentic import run_agentic

pytestmark = pytest.mark.slow


def _run(out: Path, name: str, *overrides: str) -> tuple[dict[str, float], list[dict]]:
    config = load_config(None, ["pipeline=agentic", f"output.dir={out}", f"name={name}",
                                "output.trackers=[jsonl]", "train.steps=2", "eval.episodes=4",
                                "eval.every_steps=0", *overrides])
    final = run_agentic(config, manage_ray=False)
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    return final, rows


def _finite(rows: list[dict]) -> None:
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"step {row['step']}: {bad}"


def test_starpo_on_frozenlake_survives_raising_and_hanging_env_steps(ray_session, tmp_path, capfd):
    final, rows = _run(
        tmp_path, "faults", "env.id=frozenlake", "env.kwargs={size: 3, max_turns: 4}", "env.max_turns=4",
        "rollout.samples=step", "rollout.groups_per_step=4", "rollout.group_size=2",
        "rollout.group_redundancy=4", "rollout.max_refill_groups=32", "algorithm.advantage=starpo",
        "train.steps=3", "env.step_timeout_s=1",
        "env.fault_injection={raise_fraction: 0.2, hang_fraction: 0.05, hang_s: 600}")
    _finite(rows)
    assert [row["step"] for row in rows] == [0, 1, 2, 3]  # every step ran
    assert sum(row["rollout/failed"] for row in rows[1:]) > 0  # faults failed episodes, counted
    assert all(row["time/step"] < 60 for row in rows[1:])  # a hang costs its 1 s limit, never 600 s
    assert all(row["rollout/groups"] == 4 for row in rows[1:])  # spares and refills replaced failed episodes
    assert "advantage/zero_std_group_frac" in rows[1]
    assert "eval/success" in rows[0] and "eval/success" in rows[-1] and "initial_eval/success" in final
    assert rows[-1]["eval/episodes_failed"] == 0  # eval envs have no faults
    # the failures are seen: a warning per new error on stderr, and the failed episodes in samples.jsonl
    warnings = [line for line in capfd.readouterr().err.splitlines() if re.match(r"rollflow: warning: step \d+: ", line)]
    assert warnings and all("of its episodes failed with: env step " in line for line in warnings), warnings
    logged = [json.loads(line) for line in (tmp_path / "faults" / "samples.jsonl").read_text().splitlines()]
    errors = {record["error"] for record in logged if record["status"] == "failed"}
    assert errors <= {"env step raised InjectedFault: injected fault: the env raised",
                      "env step ran past env.step_timeout_s = 1 s"} and errors, logged


def test_an_env_whose_constructor_refuses_its_kwargs_stops_before_the_first_episode(ray_session, tmp_path):
    with pytest.raises(ConfigError) as caught:
        _run(tmp_path, "kwargs", "env.id=frozenlake", "env.kwargs={max_turns: 4}")
    assert str(caught.value) == (
        "env 'frozenlake' with env.kwargs {'max_turns': 4}: one env could not be made and reset before the first "
        "step: env constructor raised ConfigError: frozenlake: a 4x4 map needs max_turns >= 6, got 4")
    assert "Traceback" in caught.value.details
    assert (tmp_path / "kwargs" / "metrics.jsonl").read_text() == ""  # not one step, not one eval


def test_gigpo_with_turn_ratios_on_sokoban_trajectories_asynchronously(ray_session, tmp_path):
    _, rows = _run(
        tmp_path, "sokoban", "env.id=sokoban", "env.kwargs={dim: [5, 5], max_turns: 4}", "env.max_turns=4",
        "rollout.samples=trajectory", "rollout.groups_per_step=2", "rollout.group_size=4",
        "algorithm.advantage=gigpo", "algorithm.policy_loss=ipa_chunk", "train.steps=3",
        "rollout.max_staleness=1", "roles.actor_train.device_mapping=[0]", "roles.actor_infer.device_mapping=[1]")
    _finite(rows)
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert "actor/turn_ratio_mean" in rows[1] and rows[1]["train/samples"] == 8
    assert "advantage/anchor_group_nontrivial_frac" in rows[1]
    assert all(row["rollout/groups"] == 2 for row in rows[1:])


def test_countdown_with_the_python_tool_runs_in_the_sandbox_on_a_hybrid_engine(ray_session, tmp_path):
    _, rows = _run(
        tmp_path, "countdown", "env.id=countdown", "env.kwargs={max_turns: 3, tool_reward: 0.1}",
        "env.max_turns=3", "rollout.groups_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=24",
        "train.steps=2", "roles.actor_infer.hybrid=true")
    _finite(rows)
    assert rows[1]["train/samples"] == 4 and rows[1]["rollout/turns"] >= 1
    # the engine inside actor_train's worker got each step's weights, in memory
    assert [row["sync/version"] for row in rows[1:]] == [1, 2] and rows[1]["sync/fetch_seconds_max"] == 0
    placement = json.loads((tmp_path / "countdown" / "placement.json").read_text())
    assert [worker.get("in") for worker in placement["actor_infer"]] == ["actor_train"], placement


def test_rlvr_prompts_with_a_calculator_show_the_tools_in_the_first_prompt(ray_session, tmp_path):
    _, rows = _run(
        tmp_path, "tools", "env.id=tool_use",
        "env.kwargs={tools: [calculator], env: prompts, env_kwargs: {task: add2, reward: exact_match}}",
        "env.max_turns=2", "rollout.groups_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
        "train.steps=1")
    _finite(rows)
    assert rows[1]["train/samples"] == 4 and "rollout/tool_calls_per_episode" in rows[1]
    assert "eval/tool_error_frac" in rows[0]
    # the driver asked the env for its tools and the chat template rendered them into every first prompt
    logged = [json.loads(line) for line in (tmp_path / "tools" / "samples.jsonl").read_text().splitlines()]
    assert logged and all(r["prompt"].startswith("<|system|>tools: calculator(expression)\n<|user|>") for r in logged)


def test_a_gem_game_runs_through_the_adapter(ray_session, tmp_path):
    pytest.importorskip("gem")
    model = tmp_path / "long_context_model"  # GEM's instructions are ~550 characters: more than 256 positions
    save_fresh_model(model, seed=0, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                     intermediate_size=64, max_positions=1024)
    _, rows = _run(
        tmp_path, "gem", f"model.path={model}", "env.id=gem:game:GuessTheNumber-v0-easy", "env.max_turns=2",
        "rollout.groups_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "train.steps=1")
    _finite(rows)
    assert rows[1]["train/samples"] == 4 and rows[1]["rollout/turns"] >= 1


def test_the_tiny_vlm_plays_frozenlake_from_images(ray_session, tmp_path):
    """examples/agentic_frozenlake_vl.yaml, short: the boards as images, trajectory samples, the VLM trained
    (its vision tower too) and synced; its checkpoint keeps the image processor."""
    config = load_config("examples/agentic_frozenlake_vl.yaml", [
        f"output.dir={tmp_path}", "name=vl", "output.trackers=[jsonl]", "train.steps=2", "eval.episodes=4",
        "eval.every_steps=0", "rollout.groups_per_step=2", "rollout.group_size=2"])
    final = run_agentic(config, manage_ray=False)
    rows = [json.loads(line) for line in (tmp_path / "vl" / "metrics.jsonl").read_text().splitlines()]
    _finite(rows)
    assert [row["step"] for row in rows] == [0, 1, 2] and "initial_eval/success" in final
    assert all(row["train/samples"] == 4 and row["rollout/failed"] == 0 for row in rows[1:])
    assert rows[1]["rollout/turns"] >= 1
    checkpoint = tmp_path / "vl" / "checkpoints" / "step_2" / "model"
    assert (checkpoint / "preprocessor_config.json").is_file()


@pytest.mark.parametrize("example", sorted(Path("examples").glob("agentic_*.yaml")), ids=lambda p: p.stem)
def test_agentic_examples_load(example):
    config = load_config(example)
    assert config.pipeline == "agentic" and config.eval.episodes >= 100


def test_cli_rejects_an_unknown_env_in_one_line(tmp_path, capsys):
    """Refused as the config loads, before Ray (the command line's `main`, in this process)."""
    config = tmp_path / "bad.yaml"
    config.write_text("pipeline: agentic\nenv: {id: frozenlak}\n")
    assert main(["train", str(config)]) == EXIT_USER_ERROR
    stderr = capsys.readouterr().err
    assert "unknown environment 'frozenlak'" in stderr and "Did you mean 'frozenlake'" in stderr
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr
