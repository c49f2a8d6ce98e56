"""`rollflow eval` says what it evaluates and evaluates what the quickstart does; `--data FILE` replaces a
config's eval task; `resume=true` over a finished run exits 0 before Ray starts, for every pipeline.

The commands run through the real command line (`rollflow.cli.main`) up to the point where Ray would start,
which raises `RayWouldStart` here: what the driver does before any worker is what these tests are about.
"""

from __future__ import annotations

import json

import pytest

from rollflow.cli import main
from rollflow.config import load_config
from rollflow.pipelines.run_directory import prepare_run_dir, write_driver_state


class RayWouldStart(Exception):
    """Raised in place of starting Ray: the command got past its checks to its workers."""


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    def refuse(*args, **kwargs):
        raise RayWouldStart

    monkeypatch.setattr("rollflow.workers.roles.start_ray", refuse)


def _eval_line(capsys, *argv: str) -> str:
    """The `evaluating ...` line `rollflow eval ARGV` prints before its workers start."""
    with pytest.raises(RayWouldStart):
        main(["eval", *argv])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("evaluating")]
    assert len(lines) == 1, lines
    return lines[0]


def test_eval_data_file_replaces_the_configs_eval_task(tmp_path, capsys):
    data = tmp_path / "my.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(3)))
    # no config: the default eval set is a task; with the quickstart's config too
    assert _eval_line(capsys, "--model", "tiny", "--data", str(data)) == f"evaluating 3 rows of {data}"
    assert _eval_line(capsys, "--model", "tiny", "--config", "examples/quickstart.yaml", "--data", str(data)) \
        == f"evaluating 3 rows of {data}"


def test_eval_without_a_config_evaluates_all_rows_as_the_quickstart_does(capsys):
    assert _eval_line(capsys, "--model", "tiny") == "evaluating 500 rows of add2 (eval split)"
    assert _eval_line(capsys, "--model", "tiny", "--config", "examples/quickstart.yaml") \
        == "evaluating 500 rows of add2 (eval split)"
    assert _eval_line(capsys, "--model", "tiny", "data.eval.limit=100") \
        == "evaluating 100 rows of add2 (eval split; data.eval.limit=100)"


def test_eval_names_each_domains_rows(capsys):
    line = _eval_line(capsys, "--model", "tiny", "--config", "examples/multi_domain.yaml",
                      "data.domains.add2.eval.limit=20")
    assert line == ("evaluating 220 rows: 20 of add2 (eval split; data.domains.add2.eval.limit=20) "
                    "[domain add2], 200 of sum3 (eval split) [domain sum3]")


FINISHED = [
    ("train", "examples/quickstart.yaml", []),
    ("train", "examples/agentic_frozenlake.yaml", ["model.path=tiny"]),
    ("sft", "examples/sft_tiny.yaml", ["model.path=tiny", "data.train.limit=256"]),
]


@pytest.mark.parametrize("command, config, overrides", FINISHED, ids=["rlvr", "agentic", "sft"])
def test_resuming_a_finished_run_says_so_and_exits_0_without_ray(tmp_path, capsys, command, config, overrides):
    run_dir = tmp_path / "done"
    checkpoint = run_dir / "checkpoints" / "step_3"
    checkpoint.mkdir(parents=True)
    write_driver_state(checkpoint, {"step": 3})

    status = main([command, config, *overrides, "resume=true", "train.steps=3", "name=done",
                   f"output.dir={tmp_path}"])
    assert status == 0  # and no RayWouldStart
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == (f"{run_dir} already finished at step 3 (train.steps=3); raise train.steps "
                                    "to continue")


def test_a_resumed_run_with_more_steps_says_its_schedule_is_stretched(tmp_path):
    def resume(*overrides: str):
        return prepare_run_dir(load_config(None, [f"output.dir={tmp_path}", "name=run", "resume=true",
                                                  *overrides]))

    prepare_run_dir(load_config(None, [f"output.dir={tmp_path}", "name=run", "train.steps=4",
                                       "train.lr_schedule=cosine"]))  # the first run's config.yaml
    write_driver_state(_mkdir(tmp_path / "run" / "checkpoints" / "step_2"), {"step": 2})
    assert resume("train.steps=8", "train.lr_schedule=cosine").note == (
        "train.steps 4 -> 8: the cosine learning-rate schedule is stretched to the new total (each step's "
        "learning rate is what a run with train.steps=8 has there)")
    assert resume("train.steps=8", "train.lr_schedule=cosine").note is None  # config.yaml says 8 now
    assert resume("train.steps=12").note is None  # constant: nothing to stretch


def _mkdir(path):
    path.mkdir(parents=True)
    return path
