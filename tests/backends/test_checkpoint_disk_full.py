"""A full disk while a checkpoint is saved is `no space left on device writing ...`, also when torch.save is
what fills it, in a worker behind Ray: torch's own file writer reports a failed write only as `[enforce fail at
inline_container.cc] unexpected pos ...`, so the trainer's state is written through a Python file
(`save_training_state`), whose failed write raises OSError ENOSPC; and `write_failure_error` takes torch's message
for a full disk when the file system is full.

No real disk is filled: `/dev/full` (every write fails with ENOSPC) stands in through a symlink, or a small
tmpfs where mounting is allowed."""

from __future__ import annotations

import errno

import pytest
import torch

from rollflow.backends.base import TrainerSettings
from rollflow.backends.torch_backend import TorchBackend
from rollflow.cluster.groups import spawn_group
from rollflow.cluster.placement import WorkerPlacement
from rollflow.errors import DiskFullError
from rollflow.pipelines.run_directory import save_checkpoint
from rollflow.trackers.durable_files import write_failure_error
from tests.conftest import mounted_tmpfs


def _full_trainer_state(checkpoint):
    """`checkpoint/trainer_state.pt` leads to /dev/full: the model and tokenizer save, the trainer state fails."""
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.pt").symlink_to("/dev/full")


def test_a_full_disk_under_the_trainer_state_raises_enospc(random_model_dir, tmp_path):
    backend = TorchBackend(TrainerSettings(random_model_dir, lr=1e-2, micro_batch_size=8))
    checkpoint = tmp_path / "step_1" / "model"
    _full_trainer_state(checkpoint)
    with pytest.raises(OSError) as error:  # was: RuntimeError "[enforce fail ...] unexpected pos 576 vs 534"
        backend.save(checkpoint)
    assert error.value.errno == errno.ENOSPC
    assert str(write_failure_error(error.value, tmp_path / "step_1")) == \
        f"no space left on device writing {tmp_path / 'step_1'}"


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 64 KiB tmpfs (root only, where mounts are allowed; else skipped)."""
    with mounted_tmpfs(tmp_path / "small", "size=64k") as mount_point:
        yield mount_point


def test_torchs_own_writer_on_a_full_file_system_is_a_full_disk(small_tmpfs, tmp_path):
    with pytest.raises(RuntimeError, match="unexpected pos") as error:
        torch.save({"x": torch.zeros(100_000)}, small_tmpfs / "trainer_state.pt")  # 400 KB into 64 KiB
    assert str(write_failure_error(error.value, small_tmpfs / "step_1")) == \
        f"no space left on device writing {small_tmpfs / 'step_1'}"
    assert write_failure_error(error.value, tmp_path) is None  # the same words where there is room: not a full disk


class SavingWorker:
    """What the actor_train worker does on `save`: its backend's checkpoint."""

    def __init__(self, placement, model_dir: str):
        self.backend = TorchBackend(TrainerSettings(model_dir, lr=1e-2, micro_batch_size=8))

    def save(self, path: str) -> None:
        self.backend.save(path)


@pytest.mark.slow  # a worker process that imports torch and transformers, builds a model (~10 s on 2 cores)
def test_a_worker_filling_the_disk_reaches_the_driver_as_one_line(ray_session, random_model_dir, tmp_path):
    _full_trainer_state(tmp_path / "checkpoints" / "step_1" / "model")
    group = spawn_group("actor_train", SavingWorker, [WorkerPlacement("actor_train", 0, (), None, (), threads=1)],
                        None, random_model_dir)
    try:
        group.wait_ready()
        with pytest.raises(DiskFullError) as error:  # was: WorkerError "... failed in save: RuntimeError: [enforce
            save_checkpoint(tmp_path, {"actor_train": group}, {"step": 1})  # fail at inline_container.cc:672] ..."
    finally:
        group.close()
    assert str(error.value) == f"no space left on device writing {tmp_path / 'checkpoints' / 'step_1'}"
    assert error.value.exit_code == 1
    assert not (tmp_path / "checkpoints" / "step_1" / "driver_state.json").exists()  # not taken for complete
