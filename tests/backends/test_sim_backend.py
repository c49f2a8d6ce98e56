"""The `sim` training backend: it sleeps what the profile says a step costs, over its simulated GPUs, returns the
engine's own logprobs, moves a real payload that every step changes, and checkpoints its position."""

from __future__ import annotations

import time

import pytest
import torch

from rollflow.backends import create_backend
from rollflow.backends.base import TrainerSettings, TrainingBackend
from rollflow.backends.sim import SimBackend
from rollflow.data.sample import Sample, collate
from rollflow.sim.profiles import PROFILES

SCALE = 1000.0  # simulated seconds per wall second


def _batch():
    samples = [Sample([1, 2, 3], [4, 5], [-0.5, -1.5]), Sample([1], [6, 7, 8], [-0.1, -0.2, -0.3])]
    return collate(samples, pad_token_id=0)  # 3 + 2 + 1 + 3 = 9 real tokens


def _backend(gpus: int = 1, **settings) -> SimBackend:
    simulation = {"time_scale": SCALE, "token_scale": 1000, "gpus": gpus}
    return create_backend("sim", TrainerSettings("tiny", lr=1e-3, **settings), simulation=simulation)


def test_a_train_step_costs_its_tokens_over_the_gpus():
    hardware = PROFILES.get("h800-7b")
    one, four = _backend(gpus=1), _backend(gpus=4)
    assert isinstance(one, TrainingBackend)
    for backend, gpus in ((one, 1), (four, 4)):
        started = time.perf_counter()
        metrics = backend.train_step(_batch(), loss_fn=None)
        wall = time.perf_counter() - started
        # 9 tokens x 1000 simulated tokens each x 1.15e-4 GPU-s / gpus, plus the optimizer step's 0.5 s
        expected = 9000 * hardware.train_gpu_s_per_token / gpus + hardware.optimizer_step_s
        assert backend.stats["simulated_seconds"] == pytest.approx(expected)
        assert expected / SCALE <= wall < expected / SCALE + 0.2
        assert metrics == {"loss": 0.0, "grad_norm": 0.0, "lr": 1e-3, "skipped_steps": 0.0,
                           "sim/train_tokens": 9000.0}


def test_logprobs_are_the_engines_and_weights_change_every_step():
    backend = _backend()
    batch = _batch()
    assert torch.equal(backend.forward_logprobs(batch), batch.rollout_logprobs)  # parity, ratios of 1
    before = backend.named_weights()
    backend.train_step(batch, loss_fn=None)
    after = backend.named_weights()
    assert list(after) == ["sim.weights"] and after["sim.weights"].numel() * 4 == 1 << 16
    assert not torch.equal(before["sim.weights"], after["sim.weights"])


def test_offload_refuses_work_and_a_checkpoint_resumes_the_schedule(tmp_path):
    backend = _backend(warmup_steps=4)
    lrs = [backend.train_step(_batch(), None)["lr"] for _ in range(2)]
    assert lrs == pytest.approx([2.5e-4, 5e-4])  # warm-up: (step + 1) / 4 of 1e-3
    backend.save(tmp_path / "ckpt")
    backend.offload()
    with pytest.raises(RuntimeError, match="offloaded"):
        backend.train_step(_batch(), None)
    backend.onload()
    resumed = _backend(warmup_steps=4)
    resumed.load(tmp_path / "ckpt")
    assert resumed.train_step(_batch(), None)["lr"] == backend.train_step(_batch(), None)["lr"] == 7.5e-4
    with pytest.raises(AssertionError, match="frozen"):
        _backend(trainable=False).train_step(_batch(), None)
