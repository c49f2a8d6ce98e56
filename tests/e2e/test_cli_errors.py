"""Bad input gives one clear line on stderr and exit status 2, never a traceback. The command line's `main` runs
in this process: an input the config loader refuses fails before Ray; one the driver's checks refuse fails once
the run has Ray (its workers starting meanwhile), which the session's is (the `cli` fixture)."""

import json
import subprocess
import sys

import pytest

from rollflow.cli import EXIT_USER_ERROR, main

QUICKSTART = "examples/quickstart.yaml"


def _error_of(capsys, argv) -> str:
    code = main(argv)
    captured = capsys.readouterr()
    assert code == EXIT_USER_ERROR, captured
    return _one_line(captured.err)


def _run_error_of(cli, argv) -> str:
    """The error line of a command the driver refuses after Ray is up (in the session's Ray)."""
    result = cli(*argv)
    assert result.returncode == EXIT_USER_ERROR, result
    return _one_line(result.stderr)


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_missing_config_file(capsys):
    assert "config file not found: nope.yaml" in _error_of(capsys, ["train", "nope.yaml"])


def test_unknown_key(capsys):
    line = _error_of(capsys, ["train", QUICKSTART, "rollout.max_new_token=4"])
    assert "unknown config key 'rollout.max_new_token'" in line and "rollout.max_new_tokens" in line


def test_wrong_type(capsys):
    assert "rollout.groups_per_step" in _error_of(capsys, ["train", QUICKSTART, "rollout.groups_per_step=many"])


def test_missing_model_path(cli, tmp_path):
    line = _run_error_of(cli, ["train", QUICKSTART, f"model.path={tmp_path}/no_model", f"output.dir={tmp_path}"])
    assert "does not exist" in line


def test_dataset_without_prompt_column(cli, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    line = _run_error_of(cli, ["train", QUICKSTART, f"data.train={{path: {data}}}", f"output.dir={tmp_path}"])
    assert "no 'prompt' column" in line


def test_reward_path_that_does_not_import(capsys, tmp_path):
    line = _error_of(capsys, ["train", QUICKSTART, "reward.functions=[{name: 'no_such_pkg.rewards:score'}]",
                              f"output.dir={tmp_path}"])
    assert "no_such_pkg" in line


@pytest.mark.parametrize("override, expected", [
    ("roles.actor_train.backend=fsdp", "unknown training backend 'fsdp'. Did you mean 'fsdp2'?"),
    ("roles.critic.backend=troch", "unknown training backend 'troch'. Did you mean 'torch'?"),
    ("roles.actor_infer.engine=vlm", "unknown inference engine 'vlm'. Did you mean 'vllm'?"),
    ("pipeline=rlvf", "unknown pipeline 'rlvf'. Did you mean 'rlvr'?"),
    ("roles.actor_train.backend_kwargs={mixed_precison: {}}", "did you mean 'mixed_precision'"),
])
def test_unknown_backend_engine_or_pipeline_name_is_one_line_at_load(capsys, override, expected):
    """Checked when the config loads, before any worker starts (no Ray traceback from a worker)."""
    overrides = [override, "roles.actor_train.backend=fsdp2"] if "backend_kwargs" in override else [override]
    assert expected in _error_of(capsys, ["train", QUICKSTART, *overrides])


def test_print_config_prints_resolved_yaml(capsys):
    assert main(["train", QUICKSTART, "--print-config", "train.steps=7"]) == 0
    out = capsys.readouterr().out
    assert "steps: 7" in out and "groups_per_step:" in out


@pytest.mark.parametrize("argv", [["train", "nope.yaml"]])
def test_real_entry_point_exits_2_without_traceback(argv):
    result = subprocess.run([sys.executable, "-m", "rollflow.cli", *argv], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == EXIT_USER_ERROR
    assert result.stderr.strip() == "rollflow: error: config file not found: nope.yaml"
