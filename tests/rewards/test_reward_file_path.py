"""A reward given by file path (`rewards/score.py:score`, relative to the working directory, or absolute) loads
from that file whatever `sys.path` holds; a missing file, a missing function or a broken file is one line; its
value is logged under the file's name; and a model reward from a file reaches a reward worker (a Ray actor
whose working directory is not the driver's) and scores there."""

from __future__ import annotations

import json
import pickle
import sys
import textwrap
from pathlib import Path

import pytest

from rollflow.rewards import combine_rewards
from rollflow.rewards.registry import ModelReward, RewardLoadError, resolve_reward, reward_key
from rollflow.trackers.metric_names import documented_metric

QUICKSTART = Path("examples/quickstart.yaml").resolve()
SCORE = "def score(completion, **row):\n    return float(completion.strip() == str(row['answer']))\n"
# A model reward in a file: the scorer named by the file's own module name, as the docs say to write it.
JUDGE = textwrap.dedent("""\
    import dataclasses

    from rollflow.rewards.registry import ModelReward


    @dataclasses.dataclass(frozen=True)
    class LengthOptions:
        bonus: float = 0.0


    class LengthScorer:
        def __init__(self, options, device="cpu"):
            self.options = options

        async def score_group(self, completions, rows):
            return [len(c) + self.options.bonus for c in completions]


    length = ModelReward(f"{__name__}:LengthScorer", LengthOptions)
""")


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A working directory holding `rewards/score.py` (a plain reward) and `rewards/judge.py` (a model reward),
    neither importable as a module (no `rewards` package on `sys.path`)."""
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "score.py").write_text(SCORE)
    (tmp_path / "rewards" / "judge.py").write_text(JUDGE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the file's directory is appended; restored after
    return tmp_path


def test_a_relative_file_path_is_read_from_the_working_directory(project):
    score = resolve_reward("rewards/score.py:score")
    assert score("12", answer=12) == 1.0 and score("13", answer=12) == 0.0
    assert resolve_reward("rewards/score.py:score") is score  # the file runs once per process
    assert resolve_reward(f"{project}/rewards/score.py:score") is score  # the same file, absolute


def test_files_of_the_same_name_in_two_directories_stay_apart(project):
    (project / "other").mkdir()
    (project / "other" / "score.py").write_text("def score(completion, **row):\n    return 0.5\n")
    assert resolve_reward("rewards/score.py:score")("1", answer=1) == 1.0
    assert resolve_reward("other/score.py:score")("1", answer=1) == 0.5


def test_a_file_may_import_the_modules_beside_it(project):
    (project / "rewards" / "helpers_beside.py").write_text("def same(a, b):\n    return float(a == b)\n")
    (project / "rewards" / "uses.py").write_text(
        "from helpers_beside import same\n\ndef score(completion, **row):\n    return same(completion, row['answer'])\n")
    try:
        assert resolve_reward("rewards/uses.py:score")("7", answer="7") == 1.0
    finally:
        sys.modules.pop("helpers_beside", None)


@pytest.mark.parametrize("spec, message", [
    ("rewards/nope.py:score", "reward 'rewards/nope.py:score': no file '{project}/rewards/nope.py' (read from the "
                              "working directory {project})"),
    ("rewards/score.py:scor", "reward 'rewards/score.py:scor': rewards/score.py has no function 'scor'"),
    ("rewards/score.py", "reward 'rewards/score.py' names a file but no function in it: write "
                         "'rewards/score.py:FUNCTION'"),
    ("rewards/broken.py:score", "reward 'rewards/broken.py:score': cannot load '{project}/rewards/broken.py' "
                                "(SyntaxError: invalid syntax (line 2))"),
    ("rewards/raises.py:score", "reward 'rewards/raises.py:score': cannot load '{project}/rewards/raises.py' "
                                "(KeyError: 'API_KEY')"),
    ("/no/such/dir/score.py:score", "reward '/no/such/dir/score.py:score': no file '/no/such/dir/score.py'"),
])
def test_a_bad_file_reward_is_one_line(project, spec, message):
    (project / "rewards" / "broken.py").write_text("import math\ndef score(:\n")
    (project / "rewards" / "raises.py").write_text("import os\nKEY = os.environ['API_KEY']\n")
    with pytest.raises(RewardLoadError) as info:
        resolve_reward(spec)
    assert str(info.value) == message.format(project=project)


def test_the_command_line_says_it_in_one_line(project, cli):
    """`rollflow train ... --print-plan` resolves the rewards (to plan the roles), before Ray starts."""
    result = cli("train", QUICKSTART, 'reward.functions=[{name: "rewards/score.py:nope"}]', "--print-plan")
    assert result.returncode == 2
    assert result.stderr == "rollflow: error: reward 'rewards/score.py:nope': rewards/score.py has no function 'nope'\n"


def test_its_value_is_logged_under_the_file_name(project):
    """A metric name's parts are split at `/`: `rewards/score.py:score` is logged as `score.py:score`."""
    assert reward_key("rewards/score.py:score") == "score.py:score"
    assert reward_key("/abs/dir/score.py:score") == "score.py:score"
    assert reward_key("my_pkg.rewards:score") == "my_pkg.rewards:score" and reward_key("math_answer") == "math_answer"
    combined = combine_rewards([("rewards/score.py:score", resolve_reward("rewards/score.py:score"), 1.0)])
    assert combined("5", answer=5) == (1.0, {"score.py:score": 1.0})
    assert documented_metric("rollout/reward/score.py:score") is not None
    with pytest.raises(RewardLoadError, match=r"named by its file name and function\); repeated: score.py:score"):
        combine_rewards([("a/score.py:score", len, 1.0), ("b/score.py:score", len, 1.0)])


def test_a_model_reward_from_a_file_pickles_as_its_absolute_path(project, tmp_path_factory, monkeypatch):
    reward = resolve_reward("rewards/judge.py:length", {"bonus": 0.5})
    assert isinstance(reward, ModelReward)
    assert reward.source == (f"{project}/rewards/judge.py:length", {"bonus": 0.5})
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))  # where a worker may run: the relative path is gone
    copy = pickle.loads(pickle.dumps(reward))
    assert copy == reward and copy.options.bonus == 0.5


def test_a_model_reward_from_a_file_scores_in_a_reward_worker(project, ray_session):
    """The worker (started in the test session's directory, not `project`) loads the file by its absolute
    path and builds the scorer its module names."""
    from rollflow.cluster.groups import spawn_group
    from rollflow.cluster.placement import WorkerPlacement
    from rollflow.config import load_config
    from rollflow.rewards import model_rewards
    from rollflow.workers.reward import RemoteReward, RewardWorker
    from rollflow.workers.specs import RewardSpec

    config = load_config(None, ['reward.functions=[{name: "rewards/judge.py:length", kwargs: {bonus: 0.5}}, '
                                '{name: "rewards/score.py:score"}]'])
    rewards = model_rewards(config.reward)
    assert list(rewards) == ["rewards/judge.py:length"]  # the plain one stays on the driver
    placement = WorkerPlacement("reward", 0, (), None, (), threads=1)
    group = spawn_group("reward", RewardWorker, [placement], None, RewardSpec(rewards))
    try:
        group.wait_ready()
        remote = RemoteReward("rewards/judge.py:length", group)
        assert remote.wait(remote.submit(["ab", "abcd"], [{}, {}])) == [2.5, 4.5]
    finally:
        group.close()


@pytest.mark.slow
def test_a_short_run_with_a_file_reward(project, cli):
    """The command line's run, in a project directory: the file reward scores every sample and is logged as
    `rollout/reward/score.py:score`. (The `rollflow` command from a directory without PYTHONPATH:
    tests/rewards/test_papercuts_user_modules.py.)"""
    result = cli("train", QUICKSTART, "train.steps=1", "name=file_reward", f"output.dir={project / 'runs'}",
                 "rollout.groups_per_step=4", "rollout.group_size=2", "train.train_micro_batch_size=8",
                 "data.eval.limit=4", "output.trackers=[jsonl]", 'reward.functions=[{name: "rewards/score.py:score"}]')
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = [json.loads(line) for line in (project / "runs" / "file_reward" / "metrics.jsonl").read_text().splitlines()]
    assert "rollout/reward/score.py:score" in rows[1] and rows[1]["rollout/failed_ratio"] == 0.0
    assert "eval/reward/score.py:score" in rows[0]
