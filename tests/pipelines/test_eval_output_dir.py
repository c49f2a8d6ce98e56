"""`rollflow eval` writes each evaluation into a directory of its own, named after the model
(`output.dir/eval-<model>`), never appending to another eval's files: an earlier eval of the same name is moved
aside to `NAME.1`; it says where it wrote. With `eval.group_by` it reports accuracy per column value and keeps
the columns in `eval_samples.jsonl`."""

from __future__ import annotations

import json

import pytest

from rollflow.cli import MAX_NAME_LENGTH, _eval_overrides, build_parser, eval_directory_name, main
from rollflow.config import load_config
from rollflow.config.sections import MAX_NAME_LENGTH as CONFIG_NAME_LIMIT
from rollflow.pipelines.evaluate import run_eval


class RayWouldStart(Exception):
    """Raised in place of starting Ray: the command got past its checks (and prepared its directory)."""


@pytest.fixture
def no_ray(monkeypatch):
    def refuse(*args, **kwargs):
        raise RayWouldStart

    monkeypatch.setattr("rollflow.workers.roles.start_ray", refuse)


def _rows(tmp_path, count: int = 4, with_difficulty: bool = True):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{10 + a}+{a}=", "answer": str(10 + 2 * a),
                                        **({"difficulty": "hard" if a % 2 else "easy"} if with_difficulty else {})})
                            + "\n" for a in range(count)))
    return path


@pytest.mark.parametrize("model, name", [
    ("tiny", "eval-tiny"),
    ("runs/quick/checkpoints/step_20/model", "eval-quick-step_20"),
    ("runs/lora/checkpoints/step_100/model/merged", "eval-lora-step_100"),
    ("Qwen/Qwen2.5-0.5B", "eval-Qwen2.5-0.5B"),
    ("/models/my model (v2)/", "eval-my_model__v2_"),
])
def test_the_directory_is_named_after_the_model(model, name):
    assert eval_directory_name(model) == name
    assert len(eval_directory_name("x" * 300)) == MAX_NAME_LENGTH == CONFIG_NAME_LIMIT


def test_without_name_the_directory_is_the_models(tmp_path):
    def overrides(*argv: str) -> list[str]:
        return _eval_overrides(build_parser().parse_args(["eval", *argv]))

    assert "name=eval-tiny" in overrides("--model", "tiny")
    assert "name=eval-quick-step_20" in overrides("--model", "runs/quick/checkpoints/step_20/model")
    assert "name=mine" in overrides("--model", "tiny", "--name", "mine")


def test_nothing_is_written_or_moved_before_the_eval_has_samples(tmp_path, no_ray):
    """Up to the workers' start (where Ray would start here) an earlier eval stays where it is."""
    earlier = tmp_path / "runs" / "eval-tiny"
    earlier.mkdir(parents=True)
    (earlier / "eval_samples.jsonl").write_text("{}\n")
    with pytest.raises(RayWouldStart):
        main(["eval", "--model", "tiny", "--data", str(_rows(tmp_path)), f"output.dir={tmp_path}/runs"])
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["eval-tiny"]
    assert (earlier / "eval_samples.jsonl").read_text() == "{}\n"


def test_a_group_by_column_missing_from_the_rows_is_one_line_before_anything_starts(tmp_path, capsys, no_ray):
    data = _rows(tmp_path, with_difficulty=False)
    status = main(["eval", "--model", "tiny", "--data", str(data), f"output.dir={tmp_path}/runs",
                   "eval.group_by=[difficulty]"])
    assert status == 2  # a ConfigError, not RayWouldStart
    assert capsys.readouterr().err == ("rollflow: error: eval.group_by: row 1 of the eval set has no column "
                                       "'difficulty'; its columns: answer, prompt\n")
    assert not (tmp_path / "runs").exists()  # nothing prepared, nothing moved


def test_the_command_says_where_it_wrote(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("rollflow.pipelines.evaluate.run_eval", lambda config: {"eval/accuracy": 0.5})
    assert main(["eval", "--model", "tiny", f"output.dir={tmp_path}"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"eval directory: {tmp_path}/eval-tiny (eval_samples.jsonl: every decoded sample; metrics.jsonl; "
        "config.yaml)")


def test_an_eval_writes_its_samples_metrics_and_groups(tmp_path, ray_session, capsys):
    config = load_config(None, ["model.path=tiny", f"data.eval.path={_rows(tmp_path)}", "data.eval.limit=null",
                                "eval.group_by=[difficulty]", f"output.dir={tmp_path}/runs", "name=eval-tiny"])
    metrics = run_eval(config, manage_ray=False)
    assert metrics["eval/samples"] == 4.0
    assert metrics["eval/difficulty=easy/samples"] == metrics["eval/difficulty=hard/samples"] == 2.0
    assert 0.0 <= metrics["eval/difficulty=hard/accuracy"] <= 1.0
    run_dir = tmp_path / "runs" / "eval-tiny"
    records = [json.loads(line) for line in (run_dir / "eval_samples.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(r["step"] == 0 for r in records)
    assert [r["columns"] for r in records] == [{"difficulty": d} for d in ("easy", "hard", "easy", "hard")]
    assert [r["answer"] for r in records] == ["10", "12", "14", "16"]
    assert [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == \
        [{"step": 0, **metrics}]

    capsys.readouterr()
    run_eval(config, manage_ray=False)  # the same name again: a directory of its own, the first moved aside
    assert len((run_dir / "eval_samples.jsonl").read_text().splitlines()) == 4  # not appended to
    assert len((tmp_path / "runs" / "eval-tiny.1" / "eval_samples.jsonl").read_text().splitlines()) == 4
    assert f"{run_dir} held an earlier run: moved it to {run_dir}.1\n" in capsys.readouterr().out  # no resume advice


@pytest.mark.slow
def test_the_eval_command_end_to_end(tmp_path, cli):
    result = cli("eval", "--model", "tiny", "--data", _rows(tmp_path), "eval.group_by=[difficulty]",
                 f"output.dir={tmp_path}/runs")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert any(line.startswith("eval/difficulty=hard/accuracy: ") for line in lines)
    assert lines[-1].startswith(f"eval directory: {tmp_path}/runs/eval-tiny (")
    assert len((tmp_path / "runs" / "eval-tiny" / "eval_samples.jsonl").read_text().splitlines()) == 4
