"""A run whose worker died says what it leaves to resume from: the newest complete checkpoint, or none (it
used to claim "the last checkpoint is intact" before any existed)."""

from __future__ import annotations

from rollflow.cli import _checkpoint_note
from rollflow.pipelines.run_directory import write_driver_state


def test_no_checkpoint_yet_is_said_so(tmp_path):
    assert _checkpoint_note(tmp_path) == "no checkpoint was saved yet"
    (tmp_path / "checkpoints" / "step_4").mkdir(parents=True)  # begun, never completed (no driver state)
    assert _checkpoint_note(tmp_path) == "no checkpoint was saved yet"


def test_the_newest_complete_checkpoint_is_named(tmp_path):
    for step in (2, 4):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
        write_driver_state(tmp_path / "checkpoints" / f"step_{step}", {"step": step})
    (tmp_path / "checkpoints" / "step_6").mkdir()
    assert _checkpoint_note(tmp_path) == "the last checkpoint, step_4, is intact (resume=true continues from it)"
