"""The CUDA paths, called directly (no Ray, no vLLM): the hf engine on a GPU, in float32 and bfloat16, against
the trainer on the GPU (logprobs, a weight load after a train step, sleep / wake); the torch backend's offload /
onload and checkpoint on a GPU (LoRA's dropout draws included); bfloat16 training; the fsdp2 backend on NCCL with one rank against the torch
backend. Marked `gpu`: every test skips without CUDA (the CPU paths are tested in tests/engines and
tests/backends).
"""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch

from rollflow.backends.base import TrainerSettings
from rollflow.backends.torch_backend import TorchBackend
from rollflow.data.sample import Sample, collate
from rollflow.engines.base import GenerationRequest, SamplingParams
from rollflow.engines.hf import HFEngine
from tests.backends.test_fsdp2 import STEPS, _actor_loss, _batch, _max_diff

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[3, 20, 21, 5], [3, 22, 5], [3, 23, 24, 25, 26, 5]]
# max |engine - trainer| logprob; bf16: the engine's KV-cached decode and the trainer's full forward round
# differently (the vLLM contract's bf16 bound)
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}
MiB = 2**20


def _generate(engine: HFEngine, params: SamplingParams, prefix: str = "r") -> list[Sample]:
    async def main():
        return await asyncio.gather(*[engine.generate(GenerationRequest(f"{prefix}{i}", prompt, params))
                                      for i, prompt in enumerate(PROMPTS)])

    completions = asyncio.run(main())
    return [Sample(PROMPTS[i], o.token_ids, o.logprobs, policy_versions=o.policy_versions)
            for i, c in enumerate(completions) for o in c.outputs]


def _gap(trainer: TorchBackend, samples: list[Sample], temperature: float) -> float:
    batch = collate(samples, pad_token_id=0)
    recomputed = trainer.forward_logprobs(batch, temperature=temperature)  # [B, T]
    return float(((recomputed - batch.rollout_logprobs).abs() * batch.response_mask).max())


def _allocated_mib() -> float:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / MiB


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_hf_engine_on_cuda_samples_the_logprobs_the_trainer_on_cuda_computes(contract_model_dir, dtype):
    engine = HFEngine(contract_model_dir, dtype=dtype, device="cuda", seed=0)
    trainer = TorchBackend(TrainerSettings(contract_model_dir, dtype=dtype, trainable=False, micro_batch_size=8,
                                           device="cuda"))
    assert next(engine.model.parameters()).device.type == "cuda" and trainer.device.type == "cuda"
    for temperature in (0.7, 0.0):
        params = SamplingParams(max_new_tokens=8, temperature=temperature, n=4 if temperature else 1)
        samples = _generate(engine, params)
        assert all(1 <= len(s.response_ids) <= 8 and len(s.response_logprobs) == len(s.response_ids)
                   for s in samples)
        gap = _gap(trainer, samples, temperature or 1.0)
        print(f"cuda {dtype} T={temperature}: max |engine - trainer| logprob {gap:.3g}")
        assert gap < TOLERANCE[dtype], (dtype, temperature, gap)
    engine.close()


def test_the_hf_engine_sleeps_off_the_gpu_and_wakes_to_the_same_greedy_tokens(contract_model_dir):
    engine = HFEngine(contract_model_dir, dtype="float32", device="cuda", seed=0)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    before, awake = [s.response_ids for s in _generate(engine, greedy)], _allocated_mib()
    weights_mib = sum(p.numel() * p.element_size() for p in engine.model.parameters()) / MiB
    engine.sleep()
    asleep = _allocated_mib()
    assert awake - asleep >= 0.9 * weights_mib, (awake, asleep, weights_mib)  # the weights left the GPU
    engine.wake()
    assert abs(_allocated_mib() - awake) <= 0.1 * weights_mib + 1
    assert [s.response_ids for s in _generate(engine, greedy, "w")] == before
    engine.close()


def test_trained_weights_loaded_into_the_cuda_engine_give_the_trainers_logprobs(contract_model_dir):
    trainer = TorchBackend(TrainerSettings(contract_model_dir, lr=1e-2, micro_batch_size=4, device="cuda"))
    engine = HFEngine(contract_model_dir, dtype="float32", device="cuda", seed=0)
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, n=2)
    samples = _generate(engine, sampling)
    batch = collate(samples, pad_token_id=0)
    batch.extras["advantages"] = torch.linspace(-1, 1, batch.size)[:, None] * batch.response_mask  # [B, T]
    trainer.train_step(batch, _actor_loss("token_mean"))
    assert _gap(trainer, samples, 1.0) > 1e-3  # the step changed the policy: the old logprobs are off
    engine.update_weights(trainer.named_weights(), version=1)
    fresh = _generate(engine, sampling, "v")
    assert {v for s in fresh for v in s.policy_versions} == {1}
    assert _gap(trainer, fresh, 1.0) < TOLERANCE["float32"]
    engine.close()


def test_torch_backend_offload_frees_the_gpu_and_onload_continues_as_if_never_moved(contract_model_dir):
    settings = TrainerSettings(contract_model_dir, lr=1e-3, micro_batch_size=2, warmup_steps=3, device="cuda")
    moved, stayed = TorchBackend(settings), TorchBackend(settings)
    loss = _actor_loss("token_mean")
    for backend in (moved, stayed):
        backend.train_step(_batch(*STEPS[0]), loss)  # the Adam moments now exist
    state_mib = (sum(p.numel() * p.element_size() for p in moved.model.parameters()) * 3) / MiB  # w, m, v
    resident = _allocated_mib()
    moved.offload()
    offloaded = _allocated_mib()
    assert resident - offloaded >= 0.9 * state_mib, (resident, offloaded, state_mib)
    with pytest.raises(RuntimeError, match="offloaded"):
        moved.train_step(_batch(*STEPS[1]), loss)
    moved.onload()
    assert all(p.device.type == "cuda" for p in moved.model.parameters())
    metrics = [backend.train_step(_batch(*STEPS[1]), loss) for backend in (moved, stayed)]
    assert metrics[0]["loss"] == pytest.approx(metrics[1]["loss"], rel=1e-5)
    assert _max_diff(moved.named_weights(), stayed.named_weights()) < 1e-6


def test_a_cuda_checkpoint_resumes_the_same_training(contract_model_dir, tmp_path):
    settings = TrainerSettings(contract_model_dir, lr=1e-3, micro_batch_size=2, warmup_steps=3, device="cuda")
    loss = _actor_loss("token_mean")
    uninterrupted = TorchBackend(settings)
    uninterrupted.train_step(_batch(*STEPS[0]), loss)
    uninterrupted.save(tmp_path / "step_1")
    resumed = TorchBackend(settings)
    resumed.load(tmp_path / "step_1")
    assert _max_diff(resumed.named_weights(), uninterrupted.named_weights()) == 0.0
    for rows, seed in STEPS[1:3]:  # the LR schedule and the Adam moments came back too
        got, expected = (backend.train_step(_batch(rows, seed), loss) for backend in (resumed, uninterrupted))
        assert got["lr"] == expected["lr"] and got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert _max_diff(resumed.named_weights(), uninterrupted.named_weights()) < 1e-6


def test_bfloat16_training_on_cuda_raises_the_logprobs_of_rewarded_tokens(contract_model_dir):
    trainer = TorchBackend(TrainerSettings(contract_model_dir, dtype="bfloat16", lr=3e-3, micro_batch_size=4,
                                           device="cuda"))
    assert next(trainer.model.parameters()).dtype == torch.bfloat16
    batch = _batch(8, 5)
    batch.extras["advantages"] = batch.response_mask.clone()  # every token rewarded: [B, T]
    before = float((trainer.forward_logprobs(batch) * batch.response_mask).sum())
    for _ in range(5):
        metrics = trainer.train_step(batch, _actor_loss("token_mean"))
        assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["skipped_steps"] == 0
    after = float((trainer.forward_logprobs(batch) * batch.response_mask).sum())
    assert after > before + 1.0, (before, after)


def test_a_cuda_lora_checkpoint_resumes_with_the_same_dropout_draws(random_model_dir, tmp_path):
    """LoRA dropout on a GPU draws from the CUDA generator: the checkpoint carries its state."""
    settings = TrainerSettings(random_model_dir, lr=1e-2, micro_batch_size=8, warmup_steps=4, device="cuda",
                               lora={"rank": 4, "alpha": 8, "dropout": 0.1})
    loss = _actor_loss("token_mean")
    torch.manual_seed(0)
    uninterrupted = TorchBackend(settings)
    for rows, seed in STEPS[:2]:
        uninterrupted.train_step(_batch(rows, seed), loss)
    uninterrupted.save(tmp_path / "ckpt")
    at_save = torch.get_rng_state(), torch.cuda.get_rng_state()
    resumed = TorchBackend(settings)
    torch.manual_seed(123)  # whatever the generators hold now, the load puts the saved states back
    resumed.load(tmp_path / "ckpt")
    assert torch.equal(torch.cuda.get_rng_state(), at_save[1])
    resumed.train_step(_batch(7, 9), loss)
    torch.set_rng_state(at_save[0])
    torch.cuda.set_rng_state(at_save[1])
    uninterrupted.train_step(_batch(7, 9), loss)
    assert _max_diff(resumed.named_weights(), uninterrupted.named_weights()) < 1e-6


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_fsdp2_on_nccl_with_one_rank_trains_offloads_and_saves_like_the_torch_backend(contract_model_dir,
                                                                                       tmp_path, monkeypatch):
    import torch.distributed as dist

    from rollflow.backends.fsdp2 import FSDP2Backend

    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(_free_port())).items():
        monkeypatch.setenv(name, value)
    settings = TrainerSettings(contract_model_dir, lr=1e-3, micro_batch_size=2, warmup_steps=3, device="cuda")
    loss = _actor_loss("token_mean")
    sharded, single = FSDP2Backend(settings), TorchBackend(settings, trim_micro_batches=False)
    try:
        assert dist.get_backend() == "nccl" and sharded.device.type == "cuda"
        for rows, seed in STEPS:  # uneven batch sizes, down to one row
            got, expected = (b.train_step(_batch(rows, seed), loss) for b in (sharded, single))
            assert got["loss"] == pytest.approx(expected["loss"], rel=1e-4, abs=1e-6)
            assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4, abs=1e-6)
        assert _max_diff(sharded.named_weights(), single.named_weights()) < 1e-5

        state_mib = sum(p.numel() * p.element_size() for p in sharded.model.parameters()) * 3 / MiB  # w, m, v
        resident = _allocated_mib()
        sharded.offload()
        assert resident - _allocated_mib() >= 0.9 * state_mib, (resident, _allocated_mib(), state_mib)
        sharded.onload()
        probe = _batch(3, 13)
        assert torch.allclose(sharded.forward_logprobs(probe), single.forward_logprobs(probe), atol=1e-5)

        sharded.save(tmp_path / "fsdp2")
        resumed = FSDP2Backend(settings)
        resumed.load(tmp_path / "fsdp2")
        assert _max_diff(resumed.named_weights(), sharded.named_weights()) == 0.0
        got, expected = (b.train_step(_batch(7, 2), loss) for b in (resumed, sharded))
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)

        mixed = FSDP2Backend(settings, mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"})
        metrics = mixed.train_step(_batch(7, 2), loss)
        assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["skipped_steps"] == 0
        for backend in (resumed, mixed):
            backend.close()
    finally:
        sharded.close()
    assert not dist.is_initialized()  # the first backend owned the group and took it down
