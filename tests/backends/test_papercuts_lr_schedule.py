"""A resumed run with a raised `train.steps` continues its cosine schedule stretched to the new total: at the
resumed step the LR is the one a run configured with the new total has there, not the old schedule's nor a
restarted (warm-up) one. With `train.critic_warmup_steps` the actor's schedule spans the steps it trains, so
its cosine reaches 0 at its last update."""

from __future__ import annotations

import math

import pytest

from rollflow.backends.base import TrainerSettings, lr_multiplier
from rollflow.backends.torch_backend import TorchBackend
from rollflow.cluster.placement import WorkerPlacement
from rollflow.config import AlgorithmConfig, load_config
from rollflow.workers.actor_loss import ActorLoss
from rollflow.workers.actor_train import ActorTrainWorker
from rollflow.workers.specs import trainer_spec
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


# ---- critic warm-up: the actor's schedule spans the steps it trains ----------------------------------------
GAE_RUN = ["algorithm.advantage=gae", "train.steps=6", "train.critic_warmup_steps=2",
           "train.optimizer_steps_per_step=2", "train.lr_schedule=cosine", "train.warmup_steps=1",
           "rollout.groups_per_step=8"]


def _trainer_lrs(worker, updates: int) -> list[float]:
    """The LR after each of `updates` optimizer steps of an initialized worker's backend."""
    worker.init_backend("127.0.0.1", 0, world_size=1)  # the torch backend: one process, no rendezvous
    backend = worker.backend
    return [backend.train_step(_batch(), ActorLoss(AlgorithmConfig(), temperature=1.0))["lr"] for _ in range(updates)]


def test_with_a_critic_warm_up_the_actors_cosine_reaches_0_at_its_last_update(random_model_dir):
    config = load_config(None, [f"model.path={random_model_dir}", f"train.lr={LR}", *GAE_RUN])
    actor = ActorTrainWorker(WorkerPlacement("actor_train", 0, (), None, (), threads=1),
                             trainer_spec(config, "actor_train"))
    # steps 1-2 train only the critic: the actor takes (6 - 2) x 2 = 8 optimizer steps, 1 of them warm-up;
    # the LR after update u (1-based) is LR x 0.5 (1 + cos(pi (u - 1) / 7)): 1, 0.950, ..., 0.188, 0.050, 0
    assert config.actor_optimizer_steps == (6 - 2) * 2
    lrs = _trainer_lrs(actor, updates=(6 - 2) * 2)
    assert lrs[-1] == 0.0  # the run's last actor update leaves it at 0 (over all 12: 0.292 x LR)
    assert lrs[-2] == pytest.approx(LR * 0.5 * (1 + math.cos(math.pi * 6 / 7)))
    assert lrs[0] == pytest.approx(LR)  # warm-up done after the actor's first update, not the run's first step
