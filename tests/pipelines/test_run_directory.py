import json

import pytest

from rollflow.config import load_config
from rollflow.errors import ConfigError
from rollflow.pipelines.run_directory import (
    DRIVER_STATE,
    RunFinished,
    latest_checkpoint,
    prepare_run_dir,
    read_driver_state,
    write_driver_state,
)


def _config(tmp_path, *overrides):
    return load_config(None, [f"output.dir={tmp_path}", "name=run", "train.steps=4", *overrides])


def _checkpoint(run_dir, step):
    path = run_dir / "checkpoints" / f"step_{step}"
    path.mkdir(parents=True)
    write_driver_state(path, {"step": step})
    return path


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_fresh_run_gets_an_empty_directory_with_its_config(tmp_path):
    prepared = prepare_run_dir(_config(tmp_path))
    assert prepared == (None, None, None)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.yaml"]
    assert "train:" in (tmp_path / "run" / "config.yaml").read_text()


def test_a_fresh_run_moves_an_earlier_run_aside(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "run.1").mkdir()  # taken: the earlier run goes to the first free sibling

    prepared = prepare_run_dir(_config(tmp_path))
    assert prepared.resume_from is None
    assert prepared.note == f"{run_dir} held an earlier run: moved it to {tmp_path / 'run.2'} " \
                            "(resume=true continues a run instead)"
    assert (tmp_path / "run.2" / "metrics.jsonl").read_text() == '{"step": 0}\n'  # kept whole
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]  # nothing of it mixes in


def test_an_empty_directory_is_used_as_it_is(tmp_path):
    (tmp_path / "run").mkdir()
    assert prepare_run_dir(_config(tmp_path)).note is None
    assert not (tmp_path / "run.1").exists()


def test_resume_without_a_complete_checkpoint_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^resume=true but .*run has no complete checkpoint") as error:
        prepare_run_dir(_config(tmp_path, "resume=true"))  # no directory at all
    assert "\n" not in str(error.value)
    (tmp_path / "run" / "checkpoints" / "step_2").mkdir(parents=True)  # a save that never finished
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        prepare_run_dir(_config(tmp_path, "resume=true"))


def test_resume_past_the_last_step_says_to_raise_train_steps(tmp_path):
    _checkpoint(tmp_path / "run", 4)
    with pytest.raises(RunFinished, match=r"already finished at step 4 \(train.steps=4\); raise train.steps "
                                          r"to continue") as raised:
        prepare_run_dir(_config(tmp_path, "resume=true"))
    assert raised.value.exit_code == 0  # nothing to do is not a failure


def test_resume_cuts_the_logs_back_to_the_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    checkpoint = _checkpoint(run_dir, 2)
    _checkpoint(run_dir, 3).joinpath(DRIVER_STATE).unlink()  # step 3's save was cut short
    (run_dir / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(4)) + '{"step": 4, "l')
    (run_dir / "samples.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 2}\n{"step": 3}\n')

    prepared = prepare_run_dir(_config(tmp_path, "resume=true", "train.steps=5"))
    assert prepared == (checkpoint, 2, None)
    assert _steps(run_dir / "metrics.jsonl") == [0, 1, 2]  # steps 3 and 4 run again; the torn line is gone
    assert _steps(run_dir / "samples.jsonl") == [1, 2, 2]
    assert "steps: 5" in (run_dir / "config.yaml").read_text()  # the resumed run's own config
    assert not (tmp_path / "run.1").exists()


def test_latest_checkpoint_skips_unfinished_and_foreign_directories(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    assert latest_checkpoint(checkpoints) is None
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 10)  # numeric order, not name order
    (checkpoints / "step_11").mkdir()  # no driver state
    (checkpoints / "step_12").mkdir()
    (checkpoints / "step_12" / DRIVER_STATE).write_text('{"step": 1')  # torn
    (checkpoints / "step_latest").mkdir()
    assert latest_checkpoint(checkpoints) == checkpoints / "step_10"
    assert read_driver_state(checkpoints / "step_10") == {"step": 10}
