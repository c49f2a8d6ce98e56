import errno
import json
import os

import pytest

from rollflow.errors import DiskFullError, RunDirUnwritableError
from rollflow.trackers import MetricsTracker
from rollflow.trackers.durable_files import (
    append_records,
    read_records,
    truncate_records,
    write_atomically,
    write_failure_as_error,
    write_failure_error,
)
from rollflow.trackers.samples import write_samples
from tests.conftest import step_samples


def test_append_writes_all_records_of_a_call_in_one_write(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    writes = []
    real_write = os.write

    def counting_write(fd, data):
        writes.append(data)
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", counting_write)
    append_records(path, [{"step": 1, "a": 1.0}, {"step": 1, "a": 2.0}])
    append_records(path, [{"step": 2}])
    assert len(writes) == 2  # one write(2) per call, whole lines only
    assert read_records(path) == [{"step": 1, "a": 1.0}, {"step": 1, "a": 2.0}, {"step": 2}]


def test_append_with_no_records_only_creates_the_file(tmp_path):
    append_records(tmp_path / "metrics.jsonl", [])
    assert (tmp_path / "metrics.jsonl").read_bytes() == b""


def test_reader_leaves_out_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "lo')  # killed mid-write
    assert read_records(path) == [{"step": 0}, {"step": 1}]
    assert read_records(tmp_path / "absent.jsonl") == []


def test_truncate_keeps_steps_up_to_the_checkpoint_and_drops_torn_lines(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, "x": 1}\n{"step": 1, "x": 2}\nnot json\n{"step": 2}\n{"step": 3}\n'
                    '{"step": 3, "y"')
    # dropped: "not json", step 2, step 3 and the torn tail = 4 lines
    assert truncate_records(path, last_step=1) == 4
    assert path.read_text() == '{"step": 0}\n{"step": 1, "x": 1}\n{"step": 1, "x": 2}\n'
    assert truncate_records(path, last_step=1) == 0  # already clean: left as it is
    assert truncate_records(tmp_path / "absent.jsonl", 1) == 0
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left behind


def test_write_atomically_replaces_the_whole_file(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("old: 1\n")
    write_atomically(path, "new: 2\n")
    assert path.read_text() == "new: 2\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_a_full_disk_is_one_line_naming_the_file():
    with pytest.raises(DiskFullError, match="^no space left on device writing /dev/full$"):
        append_records("/dev/full", [{"step": 1}])  # every write to /dev/full fails with ENOSPC


def test_a_full_disk_keeps_the_old_file_when_replacing(tmp_path, monkeypatch):
    path = tmp_path / "driver_state.json"
    path.write_text('{"step": 1}')

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(DiskFullError, match=f"writing {path}$"):
        write_atomically(path, '{"step": 2}')
    assert path.read_text() == '{"step": 1}'  # untouched, and no temporary file left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["driver_state.json"]


def test_a_short_write_is_cut_off_again(tmp_path, monkeypatch):
    """A disk that fills up mid-record leaves no half record behind."""
    path = tmp_path / "metrics.jsonl"
    append_records(path, [{"step": 1}])
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, data[: len(data) // 2]))
    with pytest.raises(DiskFullError):
        append_records(path, [{"step": 2, "loss": 0.5}])
    assert path.read_text() == '{"step": 1}\n'


@pytest.mark.parametrize("err", [
    OSError(errno.ENOSPC, "No space left on device"),
    OSError(errno.EDQUOT, "Disk quota exceeded"),
    RuntimeError("[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing file data/3: "
                 "file write failed"),  # torch.save
    Exception("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space left on "
              "device\" })"),  # safetensors' save_file
])
def test_write_failure_error_recognizes_full_disks(err):
    assert str(write_failure_error(err, "runs/x/checkpoints/step_2")) == \
        "no space left on device writing runs/x/checkpoints/step_2"


def test_write_failure_error_looks_through_the_chain_and_ignores_other_errors():
    try:
        try:
            raise OSError(errno.ENOSPC, "full")
        except OSError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as outer:
        assert isinstance(write_failure_error(outer, "p"), DiskFullError)
    assert write_failure_error(ValueError("bad"), "p") is None


@pytest.mark.parametrize(("err", "reason"), [
    (PermissionError(errno.EACCES, "Permission denied", "runs/x/metrics.jsonl"), "Permission denied"),
    (OSError(errno.EROFS, "Read-only file system"), "Read-only file system"),
    (RuntimeError("PermissionError: [Errno 13] Permission denied: 'runs/x/checkpoints/step_2/model'"),
     "permission denied"),  # a worker's save, as text in Ray's error
])
def test_a_directory_that_stopped_being_writable_is_one_line(err, reason):
    found = write_failure_error(err, "runs/x/checkpoints/step_2")
    assert isinstance(found, RunDirUnwritableError)
    assert str(found) == (f"cannot write runs/x/checkpoints/step_2: {reason} (the directory stopped being writable "
                          "while the run ran: its permissions or its mount changed)")


def test_a_checkpoint_directory_made_unwritable_mid_run_is_one_line(tmp_path):
    """What `save_checkpoint`'s mkdir met in the drill (a PermissionError traceback from run_directory.py)."""
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(RunDirUnwritableError, match="step_2: Permission denied"):
        with write_failure_as_error(tmp_path / "checkpoints" / "step_2"):
            raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "checkpoints" / "step_2"))


def test_write_failure_as_error_maps_a_worker_failure_and_passes_others(tmp_path):
    class RayTaskError(Exception):  # how a worker's exception arrives: its traceback as text, the cause attached
        def __init__(self, cause):
            super().__init__(f"ray::Worker.save() (pid=1)\n  ...\n{cause!r}")
            self.cause = cause

    with pytest.raises(DiskFullError, match="step_3$"):
        with write_failure_as_error(tmp_path / "step_3"):
            raise RayTaskError(RuntimeError("PytorchStreamWriter failed writing file data/0"))
    with pytest.raises(KeyError):
        with write_failure_as_error(tmp_path):
            raise KeyError("other")


def test_tracker_and_samples_write_whole_records(tmp_path):
    tracker = MetricsTracker(tmp_path, ["jsonl"], total_steps=2, wall_clock=lambda: 1700000000.25)
    assert (tmp_path / "metrics.jsonl").exists()  # from the start
    tracker.log(1, {"reward/mean": 0.5, "note": "text is not a metric"})
    tracker.close()
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == \
        [{"step": 1, "time/unix": 1700000000.25, "reward/mean": 0.5}]
    write_samples(tmp_path / "samples.jsonl", 1, step_samples(), count=3)
    rows = read_records(tmp_path / "samples.jsonl")
    assert [(row["step"], row["group"], row["status"]) for row in rows] == \
        [(1, 0, "finished"), (1, 0, "truncated"), (1, 1, "finished")]


def test_a_resumed_tracker_hides_later_tensorboard_steps(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsTracker(tmp_path, ["tensorboard"], total_steps=3)
    for step in (1, 2, 3):
        first.log(step, {"reward/mean": float(step)})
    first.close()
    resumed = MetricsTracker(tmp_path, ["tensorboard"], total_steps=3, resumed_at=1)
    resumed.log(2, {"reward/mean": 20.0})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 1.0), (2, 20.0)]
