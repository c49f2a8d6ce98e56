"""The greedy eval phase (`rollflow.pipelines.phases.evaluate`): `eval.group_by` breaks the accuracy down per
column value (`eval/C=V/accuracy`), a column missing from an eval row is one ConfigError before anything
generates, the final summary prints each group's start -> end, and every eval's decoded samples are appended to
`eval_samples.jsonl` with the step and the group columns."""

from __future__ import annotations

import json

import pytest

from rollflow.config import load_config
from rollflow.data.prompts import EncodedPrompt
from rollflow.data.sample import Sample, SampleStatus
from rollflow.engines.base import SamplingParams
from rollflow.errors import ConfigError
from rollflow.pipelines.phases import eval_group_metrics, eval_summary_lines, evaluate, group_value
from rollflow.trackers.metric_names import documented_metric

# (difficulty, source, right?) of four eval rows: hard 1 of 2 right, easy 2 of 2; source a/b has a `/`
ROWS = [("hard", "a/b", True), ("hard", "gsm", False), ("easy", "gsm", True), ("easy", None, True)]


class ScriptedCore:
    """A rollout core whose eval answers each prompt with "right" or "wrong", scored 1 or 0, as the real core's
    `evaluate` hands samples back; it records each eval's seed key and the program's greedy sampling."""

    def __init__(self):
        self.calls = []
        self.program = self

    def for_eval(self, params):
        self.params = params
        return self

    def evaluate(self, prompts, program, seed_key=()):
        assert program is self and self.params.temperature == 0.0
        self.calls.append(seed_key)
        samples = []
        for index, prompt in enumerate(prompts):
            right = prompt.row["right"]
            samples.append(Sample([1], [2], group_id=index, reward=float(right), rewards={"math_answer": float(right)},
                                  prompt_text=prompt.text, response_text="right" if right else "wrong", row=prompt.row))
        return samples


class Phases:
    def __init__(self):
        self.entered = []

    def enter(self, phase):
        self.entered.append(phase)


def _prompts(rows=ROWS) -> list[EncodedPrompt]:
    return [EncodedPrompt({"prompt": f"{i}+1=", "answer": str(i + 1), "difficulty": difficulty, "source": source,
                           "right": right}, f"{i}+1=", [1])
            for i, (difficulty, source, right) in enumerate(rows)]


def _evaluate(tmp_path, step, group_by=("difficulty", "source"), prompts=None, core=None):
    return evaluate(core or ScriptedCore(), Phases(), _prompts() if prompts is None else prompts,
                    SamplingParams(4, temperature=0.0), step, group_by=group_by,
                    samples_path=tmp_path / "eval_samples.jsonl")


def test_accuracy_per_value_of_each_column(tmp_path):
    metrics = _evaluate(tmp_path, 0)
    assert metrics["eval/accuracy"] == 0.75  # 3 of 4
    # hard: 1 of 2 right; easy: 2 of 2; source: a/b 1 of 1, gsm 1 of 2, null 1 of 1
    assert {key: value for key, value in metrics.items() if "=" in key} == {
        "eval/difficulty=easy/samples": 2.0, "eval/difficulty=easy/accuracy": 1.0,
        "eval/difficulty=hard/samples": 2.0, "eval/difficulty=hard/accuracy": 0.5,
        "eval/source=a_b/samples": 1.0, "eval/source=a_b/accuracy": 1.0,
        "eval/source=gsm/samples": 2.0, "eval/source=gsm/accuracy": 0.5,
        "eval/source=null/samples": 1.0, "eval/source=null/accuracy": 1.0,
    }
    assert all(documented_metric(key) is not None for key in metrics)  # docs/metrics.md names each one


def test_without_group_by_only_the_usual_metrics(tmp_path):
    metrics = _evaluate(tmp_path, 0, group_by=())
    assert not any("=" in key for key in metrics) and metrics["eval/accuracy"] == 0.75


def test_a_failed_sample_counts_as_wrong_in_its_group():
    samples = [Sample([1], [2], rewards={"math_answer": 1.0}, row={"level": 1}),
               Sample([1], [], status=SampleStatus.FAILED, row={"level": 1})]
    assert eval_group_metrics(samples, ["level"]) == {"eval/level=1/samples": 2.0, "eval/level=1/accuracy": 0.5}
    assert (group_value(""), group_value(None), group_value(3), group_value("x/y/z")) == ('""', "null", "3", "x_y_z")


def test_a_missing_column_is_one_config_error_before_anything_generates(tmp_path):
    prompts = _prompts()
    del prompts[2].row["difficulty"]
    core = ScriptedCore()
    with pytest.raises(ConfigError) as info:
        _evaluate(tmp_path, 0, prompts=prompts, core=core)
    assert str(info.value) == ("eval.group_by: row 3 of the eval set has no column 'difficulty'; its columns: "
                               "answer, prompt, right, source")
    assert core.calls == [] and not (tmp_path / "eval_samples.jsonl").exists()


def test_every_eval_appends_its_samples_with_the_step_and_columns(tmp_path):
    _evaluate(tmp_path, 0)
    _evaluate(tmp_path, 5)
    records = [json.loads(line) for line in (tmp_path / "eval_samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0] * 4 + [5] * 4  # one record per eval row per eval
    first = records[0]
    assert {key: first[key] for key in ("prompt", "response", "answer", "reward", "status")} == {
        "prompt": "0+1=", "response": "right", "answer": "1", "reward": 1.0, "status": "finished"}
    assert first["rewards"] == {"math_answer": 1.0}
    assert first["columns"] == {"difficulty": "hard", "source": "a/b"}  # the row's own values


def test_no_samples_path_writes_nothing(tmp_path):
    evaluate(ScriptedCore(), Phases(), _prompts(), SamplingParams(4, temperature=0.0), 0,
             group_by=["difficulty"])
    assert list(tmp_path.iterdir()) == []


def test_the_summary_lines_give_each_group_start_and_end():
    final = {"initial_eval/accuracy": 0.25, "eval/accuracy": 0.75,
             "initial_eval/difficulty=hard/accuracy": 0.0, "eval/difficulty=hard/accuracy": 0.5,
             "initial_eval/difficulty=easy/accuracy": 0.5, "eval/difficulty=easy/accuracy": 1.0,
             "initial_eval/add2/accuracy": 0.1, "eval/add2/accuracy": 0.2,  # a domain's: not a group's line
             "eval/difficulty=new/accuracy": 1.0}  # no initial value: no line
    assert eval_summary_lines(final, 12) == [
        "eval accuracy: 0.250 at start -> 0.750 after 12 steps",
        "eval accuracy difficulty=easy: 0.500 at start -> 1.000 after 12 steps",
        "eval accuracy difficulty=hard: 0.000 at start -> 0.500 after 12 steps",
    ]
    assert eval_summary_lines({"eval/accuracy": 0.5}, 3) == []


@pytest.mark.parametrize("columns, message", [
    ("[a/b]", "column 'a/b' must be a non-empty name without '/' or '='"),
    ("[a=b]", "column 'a=b' must be a non-empty name without '/' or '='"),
    ("[difficulty, difficulty]", "each column may appear once; repeated: difficulty"),
])
def test_group_by_columns_are_checked_at_load(columns, message):
    with pytest.raises(ConfigError, match=f"eval.group_by: {message}"):
        load_config(None, [f"eval.group_by={columns}"])
    assert load_config(None, ["eval.group_by=[difficulty]"]).eval.group_by == ["difficulty"]
