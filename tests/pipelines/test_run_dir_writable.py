"""An `output.dir` the run cannot write (a file, a path under a file, a read-only file system) is one line
before anything starts, from every pipeline: `resume_point`, which each pipeline calls first, checks it by
trying to create a file (root may write anywhere `os.access` asks about, but not to a read-only mount)."""

from __future__ import annotations

import time

import pytest

from rollflow.config import load_config
from rollflow.errors import ConfigError
from rollflow.pipelines.evaluate import run_eval
from rollflow.pipelines.run_directory import (
    RunFinished,
    check_run_dir_writable,
    resume_point,
    write_driver_state,
)
from tests.conftest import mounted_tmpfs


def _config(output_dir, *overrides):
    return load_config(None, [f"output.dir={output_dir}", "name=run", "train.steps=4", *overrides])


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only tmpfs mounted on a directory (root only, where mounts are allowed; else skipped)."""
    with mounted_tmpfs(tmp_path / "ro", "size=64k,ro") as mount_point:
        yield mount_point


def test_a_file_as_output_dir_is_one_line(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError) as error:
        resume_point(_config(tmp_path / "f"))
    assert str(error.value) == (f"output.dir: cannot create the run directory {tmp_path}/f/run: {tmp_path}/f is a "
                                "file, not a directory; set output.dir to a directory")


def test_a_path_under_a_file_names_the_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=f"{tmp_path}/f is a file, not a directory"):
        resume_point(_config(tmp_path / "f" / "deeper" / "runs"))


def test_a_read_only_file_system_is_one_line(read_only_dir):
    with pytest.raises(ConfigError) as error:
        resume_point(_config(read_only_dir / "runs"))
    assert str(error.value) == (f"output.dir: cannot write the run directory {read_only_dir}/runs/run: "
                                f"{read_only_dir} is not writable (Read-only file system); set output.dir to a "
                                "writable directory")


def test_a_writable_output_dir_passes_and_is_left_as_it_was(tmp_path):
    check_run_dir_writable(_config(tmp_path / "new" / "runs"))
    assert list(tmp_path.iterdir()) == []  # nothing created, the probe file removed
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")  # an earlier run, to be moved aside
    assert resume_point(_config(tmp_path)) == (None, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["metrics.jsonl"]


def test_a_finished_run_on_a_read_only_mount_still_has_nothing_to_do(tmp_path):
    """`resume: true` past `train.steps` writes nothing, so a read-only run directory is no error there."""
    checkpoint = tmp_path / "run" / "checkpoints" / "step_4"
    checkpoint.mkdir(parents=True)
    write_driver_state(checkpoint, {"step": 4})
    with pytest.raises(RunFinished):
        resume_point(_config(tmp_path, "resume=true"))


def test_the_command_line_says_it_in_one_line_before_any_worker_starts(tmp_path, cli):
    (tmp_path / "f").write_text("x")
    started = time.perf_counter()
    result = cli("train", "examples/quickstart.yaml", "train.steps=2", "eval.every_steps=0",
                 f"output.dir={tmp_path}/f")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        f"rollflow: error: output.dir: cannot create the run directory {tmp_path}/f/quickstart: {tmp_path}/f is a "
        "file, not a directory; set output.dir to a directory"]
    assert "starting workers" not in result.stdout  # refused before the workers (was: after them, ~17 s)
    assert time.perf_counter() - started < 60


def test_rollflow_eval_checks_its_directory_before_anything_starts(tmp_path):
    (tmp_path / "f").write_text("x")
    config = load_config(None, ["data.eval={task: add2, split: eval}", f"output.dir={tmp_path}/f", "name=eval"])
    with pytest.raises(ConfigError, match=r"^output.dir: cannot create the run directory .*/f/eval: .*/f is a "
                                          r"file, not a directory"):
        run_eval(config, manage_ray=False)
