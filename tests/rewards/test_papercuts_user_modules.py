"""A reward by dotted path to a module in the working directory imports without PYTHONPATH, as `python -m`
users expect, under the `rollflow` command (whose `sys.path` starts at its own directory, not the working
directory). Ray workers get the driver's working directory from Ray itself: tests/e2e/test_papercuts_ray.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollflow.config import load_config
from rollflow.inputs.prompt_sets import load_prompt_sets
from rollflow.pipelines.rlvr import rlvr_roles
from rollflow.rewards.registry import RewardLoadError, resolve_reward

QUICKSTART = Path("examples/quickstart.yaml").resolve()
MY_REWARDS = "def score(completion, **row):\n    return float(completion.strip() == str(row['answer']))\n"
REWARD_OVERRIDE = 'reward.functions=[{name: "my_rewards:score", weight: 1}]'


@pytest.fixture
def in_a_project(tmp_path, monkeypatch):
    """A working directory holding `my_rewards.py`, and a `sys.path` without it (nor `''`), as under the
    `rollflow` command; `sys.path` and `sys.modules` are restored afterwards."""
    (tmp_path / "my_rewards.py").write_text(MY_REWARDS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p and os.path.abspath(p) != str(tmp_path)])
    yield tmp_path
    sys.modules.pop("my_rewards", None)


@pytest.mark.parametrize("spec", ["my_rewards:score", "my_rewards.score"])
def test_a_reward_in_the_working_directory_resolves(in_a_project, spec):
    assert resolve_reward(spec)("12", answer=12) == 1.0


def test_the_input_checks_import_it(in_a_project):
    config = load_config(QUICKSTART, [REWARD_OVERRIDE, "data.train.limit=8", "data.eval.limit=8"])
    load_prompt_sets(config, rlvr_roles(config))  # resolves every reward, as a run does before Ray starts


def test_a_missing_module_says_where_it_looked(in_a_project):
    with pytest.raises(RewardLoadError, match=rf"cannot import module 'no_such_rewards' .*; looked on sys.path "
                                              rf"and in the working directory {in_a_project}\)$"):
        resolve_reward("no_such_rewards:score")


@pytest.mark.slow  # the installed command's own process is the point: its `sys.path` (~5 s on 2 cores)
def test_the_rollflow_command_imports_it_without_pythonpath(tmp_path):
    """`rollflow train CONFIG reward.functions=[...] --print-plan` (it resolves the rewards to plan the roles)
    run by a launcher like the installed `rollflow` script: from another directory, without PYTHONPATH."""
    project, bin_dir = tmp_path / "project", tmp_path / "bin"
    project.mkdir()
    bin_dir.mkdir()
    (project / "my_rewards.py").write_text(MY_REWARDS)
    launcher = bin_dir / "rollflow"  # what pip writes for `[project.scripts] rollflow = "rollflow.cli:main"`
    launcher.write_text("import sys\nfrom rollflow.cli import main\nsys.exit(main())\n")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run([sys.executable, str(launcher), "train", str(QUICKSTART), REWARD_OVERRIDE,
                             "--print-plan"], cwd=project, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "actor_infer" in result.stdout
