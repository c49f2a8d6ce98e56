"""A training run's greedy evals: every eval's decoded samples go to `runs/<name>/eval_samples.jsonl` (one
record per eval row per eval, with its step and the `eval.group_by` columns), the accuracy per column value is
logged as `eval/C=V/accuracy`, and the run's last lines give each value's start -> end. A column missing from
the eval rows stops the run before the first step with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
SMALL = ["rollout.groups_per_step=4", "rollout.group_size=2", "train.train_micro_batch_size=8",
         "output.trackers=[jsonl]", "data.eval.limit=null"]


def _eval_rows(tmp_path, with_difficulty: bool = True) -> Path:
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{10 + a}+{a}=", "answer": str(10 + 2 * a),
                                        **({"difficulty": "hard" if a % 2 else "easy"} if with_difficulty else {})})
                            + "\n" for a in range(6)))
    return path


def _train(cli, tmp_path, *overrides: str):
    return cli("train", QUICKSTART, *SMALL, *overrides, f"output.dir={tmp_path}")


def test_a_run_keeps_every_evals_samples_and_breaks_accuracy_down(tmp_path, cli):
    result = _train(cli, tmp_path, "train.steps=2", "eval.every_steps=1", "name=grouped",
                    f"data.eval.path={_eval_rows(tmp_path)}", "eval.group_by=[difficulty]")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / "grouped"
    records = [json.loads(line) for line in (run_dir / "eval_samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0] * 6 + [1] * 6 + [2] * 6
    assert [r["columns"]["difficulty"] for r in records[:6]] == ["easy", "hard"] * 3
    assert {"prompt", "response", "answer", "reward", "rewards", "status"} <= set(records[0])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {"eval/difficulty=easy/accuracy", "eval/difficulty=hard/accuracy",
            "eval/difficulty=hard/samples"} <= set(rows[0]) & set(rows[-1])
    lines = result.stdout.splitlines()
    for value in ("easy", "hard"):
        assert any(line.startswith(f"eval accuracy difficulty={value}: ") and line.endswith(" after 2 steps")
                   for line in lines), lines[-5:]


def test_a_missing_group_by_column_stops_the_run_before_the_first_step(tmp_path, cli):
    result = _train(cli, tmp_path, "train.steps=2", "name=missing", f"data.eval.path={_eval_rows(tmp_path, False)}",
                    "eval.group_by=[difficulty]")
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == ("rollflow: error: eval.group_by: row 1 of the eval set has no column "
                                              "'difficulty'; its columns: answer, prompt")
    assert not (tmp_path / "missing" / "metrics.jsonl").exists() or \
        (tmp_path / "missing" / "metrics.jsonl").read_text() == ""  # no step ran
