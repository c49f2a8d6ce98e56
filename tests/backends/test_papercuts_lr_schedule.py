"""A resumed run with a raised `train.steps` continues its cosine schedule stretched to the new total: at the
resumed step the LR is the one a run configured with the new total has there, not the old schedule's nor a
restarted (warm-up) one."""

from __future__ import annotations

import pytest

from rollflow.backends.base import TrainerSettings, lr_multiplier
from rollflow.backends.torch_backend import TorchBackend
from rollflow.config import AlgorithmConfig
from rollflow.workers.actor_loss import ActorLoss
from tests.backends.test_torch_backend import _batch

LR, WARMUP = 1e-2, 2


def _backend(model_dir: str, total_steps: int) -> TorchBackend:
    return TorchBackend(TrainerSettings(model_dir, lr=LR, micro_batch_size=8, warmup_steps=WARMUP,
                                        lr_schedule="cosine", total_steps=total_steps))


def _lr(backend: TorchBackend) -> float:
    """The LR the next optimizer step uses."""
    return backend.optimizer.param_groups[0]["lr"]


def _train(backend: TorchBackend, steps: int) -> list[float]:
    """The LR each of `steps` optimizer steps used."""
    loss, used = ActorLoss(AlgorithmConfig(), temperature=1.0), []
    for _ in range(steps):
        used.append(_lr(backend))
        backend.train_step(_batch(), loss)
    return used


def test_a_longer_resumed_run_stretches_the_schedule(random_model_dir, tmp_path):
    short = _backend(random_model_dir, total_steps=10)
    _train(short, 5)
    short.save(tmp_path / "step_5")

    resumed = _backend(random_model_dir, total_steps=20)
    resumed.load(tmp_path / "step_5")
    fresh = _backend(random_model_dir, total_steps=20)
    _train(fresh, 5)
    # step 5 (0-based) of a 20-step cosine with 2 warm-up steps: 0.5 * (1 + cos(pi * 3 / 18)) = 0.9330
    assert _lr(resumed) == pytest.approx(LR * 0.5 * (1 + 0.8660254)) == pytest.approx(_lr(fresh))
    assert resumed.scheduler.get_last_lr() == [pytest.approx(_lr(fresh))]
    assert _lr(resumed) != pytest.approx(LR * lr_multiplier(5, WARMUP, 10, "cosine"))  # the old schedule: 0.691
    assert _lr(resumed) != pytest.approx(LR * lr_multiplier(0, WARMUP, 20, "cosine"))  # restarted: warm-up 0.5
    assert _train(resumed, 3) == pytest.approx(_train(fresh, 3))  # and goes on as the 20-step run does


def test_an_unchanged_total_resumes_at_the_saved_lr(random_model_dir, tmp_path):
    run = _backend(random_model_dir, total_steps=10)
    _train(run, 4)
    saved = _lr(run)
    run.save(tmp_path / "step_4")
    resumed = _backend(random_model_dir, total_steps=10)
    resumed.load(tmp_path / "step_4")
    assert _lr(resumed) == pytest.approx(saved) == pytest.approx(LR * lr_multiplier(4, WARMUP, 10, "cosine"))
