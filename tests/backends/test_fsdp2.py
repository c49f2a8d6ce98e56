"""The fsdp2 backend against the single-process TorchBackend (the reference implementation).

One 2-rank FSDP2 job on CPU (gloo on 127.0.0.1, 1 torch thread per rank) runs every distributed scenario
once (the spawn and imports cost most of the time) and saves each rank's results; the tests compare them with
TorchBackend on the same global batches. The reference TorchBackend runs contiguous full-width micro-batches
(`trim_micro_batches=False`), so the comparisons also check the ranks' length-ordered, trimmed passes (the
batches' prompts and responses have uneven lengths) against untrimmed ones.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rollflow.backends.base import TrainerSettings
from rollflow.backends.fsdp2 import mixed_precision_policy, passes_per_rank, shard_rows
from rollflow.backends.torch_backend import TorchBackend
from rollflow.config import AlgorithmConfig
from rollflow.data.sample import Sample, collate
from rollflow.workers.actor_loss import ActorLoss
from rollflow.workers.objectives import CriticLoss

WORLD = 2
LR = 1e-3
MICRO_BATCH = 2
AGGREGATIONS = ("token_mean", "seq_mean_token_mean")
# (rows, seed) of consecutive steps; with 2 ranks and 2 rows per micro-batch: 8 rows = 2 + 2 passes on each
# rank; 7 = (2, 2) and (2, 1); 5 = (2, 1) and (2, placeholder); 1 = (1) and (placeholder: an empty shard)
STEPS = ((8, 1), (7, 2), (5, 3), (1, 4))
WEIGHT_TOLERANCE = 1e-5
JOB_TIMEOUT_S = 420  # ~25 s of CPU; generous because the 2 cores are shared with other test runs


def _batch(rows: int, seed: int):
    """`rows` samples of varied prompt / response lengths (one env token masked out in some), random
    per-sequence advantages."""
    gen = torch.Generator().manual_seed(seed)

    def ints(low, high, n):
        return torch.randint(low, high, (n,), generator=gen).tolist()

    samples = []
    for i in range(rows):
        prompt, response = ints(3, 60, ints(1, 5, 1)[0]), ints(3, 60, ints(1, 7, 1)[0])
        mask = [0 if (i % 3 == 2 and t == 1) else 1 for t in range(len(response))]  # a tool token
        samples.append(Sample(prompt_ids=prompt, response_ids=response, loss_mask=mask, group_id=i // 2,
                              reward=float(i % 2)))
    batch = collate(samples, pad_token_id=0)
    batch.extras["advantages"] = torch.randn(rows, 1, generator=gen) * batch.response_mask  # [B, T]
    return batch


def _vl_batch(model_dir: str, rows: int, offset: int):
    """`rows` count_shapes prompts with their images (one each) and a two-token answer, random advantages."""
    from rollflow.data.prompts import PromptEncoder
    from rollflow.data.vision import load_vision_processor
    from rollflow.data.visual_tasks import count_shapes_splits
    from rollflow.models import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    encoder = PromptEncoder(tokenizer, processor=load_vision_processor(model_dir, tokenizer))
    samples = []
    for i, row in enumerate(count_shapes_splits()[0][offset:offset + rows]):
        prompt = encoder.encode(row)
        answer = tokenizer.encode(row["answer"], add_special_tokens=False) + [tokenizer.eos_token_id]
        samples.append(Sample(prompt.token_ids, answer, loss_mask=[1] * len(answer), group_id=i // 2,
                              vision=prompt.vision))
    batch = collate(samples, pad_token_id=0)
    gen = torch.Generator().manual_seed(offset)
    batch.extras["advantages"] = torch.randn(rows, 1, generator=gen) * batch.response_mask
    return batch


VL_STEPS = ((5, 0), (3, 5))  # (rows, first row): 5 rows = (2, 1) passes on rank 0 and (2) on rank 1


def _critic_batch(rows: int, seed: int):
    batch = _batch(rows, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    batch.extras["values"] = torch.zeros_like(batch.response_mask)  # the zero-initialized head's values
    batch.extras["returns"] = torch.rand(batch.response_mask.shape, generator=gen) * batch.response_mask
    return batch


def _actor_loss(aggregation: str):
    return ActorLoss(AlgorithmConfig(loss_aggregation=aggregation), temperature=1.0)


def _critic_loss():
    return CriticLoss("seq_mean_token_mean", None)  # the other scenarios' critic uses token_mean


def _settings(model_dir: str, **overrides) -> TrainerSettings:
    # warm-up makes the LR differ step to step, so a scheduler that is not restored shows
    return TrainerSettings(model_dir, **{"lr": LR, "micro_batch_size": MICRO_BATCH, "max_grad_norm": 1.0,
                                        "warmup_steps": 3, **overrides})


def _single(settings: TrainerSettings) -> TorchBackend:
    """The single-process reference: contiguous micro-batches at the batch's full width."""
    return TorchBackend(settings, trim_micro_batches=False)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _two_rank_job(rank: int, port: int, model_dir: str, out_dir: str, vl_dir: str) -> None:
    """Every distributed scenario, on one rank; saves this rank's results to `out_dir/rank{rank}.pt`."""
    torch.set_num_threads(1)  # 2 shared cores
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from rollflow.backends import create_backend
    from rollflow.backends.base import TrainingBackend
    from rollflow.backends.fsdp2 import FSDP2Backend

    results, backends = {}, []
    for aggregation in AGGREGATIONS:
        backend = FSDP2Backend(_settings(model_dir))
        backends.append(backend)
        results[aggregation] = [(backend.train_step(_batch(rows, seed), _actor_loss(aggregation)),
                                 backend.named_weights()) for rows, seed in STEPS]
    results["logprobs"] = backend.forward_logprobs(_batch(7, 10), temperature=0.7)

    reference = FSDP2Backend(TrainerSettings(model_dir, trainable=False, micro_batch_size=MICRO_BATCH))
    results["reference_logprobs"] = reference.forward_logprobs(_batch(3, 11))
    # the reference role on fsdp2 ranks: every batch shape of STEPS, down to an empty shard on rank 1
    results["reference_steps"] = [reference.forward_logprobs(_batch(rows, seed), temperature=0.7)
                                  for rows, seed in STEPS]
    try:
        reference.train_step(_batch(*STEPS[0]), _actor_loss("token_mean"))
    except AssertionError as error:  # raised before any collective, on every rank
        results["frozen_train_error"] = str(error)
    results["reference_frozen"] = (reference.optimizer is None,
                                   any(p.requires_grad for p in reference.model.parameters()))
    results["reference_weights"] = reference.named_weights()

    critic = FSDP2Backend(_settings(model_dir, value_head=True))
    results["critic_metrics"] = critic.train_step(_critic_batch(5, 12), CriticLoss("token_mean", None))
    results["values"] = critic.forward_values(_critic_batch(5, 12))
    critic.save(Path(out_dir) / "critic")
    restored_critic = FSDP2Backend(_settings(model_dir, value_head=True))
    restored_critic.load(Path(out_dir) / "critic")
    results["restored_values"] = restored_critic.forward_values(_critic_batch(5, 12))

    # the critic role on fsdp2 ranks, built the way a worker builds it; blocks stay gathered between forward
    # and backward (reshard_after_forward=False) and micro-batches are contiguous and full width
    # (trim_micro_batches=False), the paths the other scenarios do not take
    critic_role = create_backend("fsdp2", _settings(model_dir, value_head=True), reshard_after_forward=False,
                                 trim_micro_batches=False)
    results["implements_protocol"] = isinstance(critic_role, TrainingBackend)
    results["critic_steps"] = [(critic_role.train_step(_critic_batch(rows, seed), _critic_loss()),
                                critic_role.named_weights()) for rows, seed in STEPS]

    mixed = FSDP2Backend(_settings(model_dir),
                         mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"})
    results["mixed_precision"] = (mixed.train_step(_batch(7, 2), _actor_loss("token_mean")), mixed.named_weights())

    # checkpoint after step 1; a fresh backend loads it; both take steps 2 and 3
    loss = _actor_loss("token_mean")
    uninterrupted = FSDP2Backend(_settings(model_dir))
    uninterrupted.train_step(_batch(*STEPS[0]), loss)
    uninterrupted.save(Path(out_dir) / "checkpoint")
    results["saved_weights"] = uninterrupted.named_weights()
    resumed = FSDP2Backend(_settings(model_dir))
    resumed.load(Path(out_dir) / "checkpoint")
    for name, run in (("uninterrupted", uninterrupted), ("resumed", resumed)):
        metrics = [run.train_step(_batch(*step), loss) for step in STEPS[1:3]]
        results[name] = (metrics, run.named_weights())

    uninterrupted.offload()
    try:
        uninterrupted.train_step(_batch(*STEPS[0]), loss)
    except RuntimeError as error:  # raised before any collective, on every rank
        results["offloaded_error"] = str(error)
    uninterrupted.onload()
    results["onloaded_logprobs"] = uninterrupted.forward_logprobs(_batch(3, 13))
    # a vision-language model: each rank's rows keep their own images, and the tower trains with the rest
    vl = FSDP2Backend(_settings(vl_dir))
    results["vl_steps"] = [(vl.train_step(_vl_batch(vl_dir, rows, first), _actor_loss("token_mean")),
                            vl.named_weights()) for rows, first in VL_STEPS]
    results["vl_logprobs"] = vl.forward_logprobs(_vl_batch(vl_dir, 3, 20))
    backends.append(vl)
    results["world_size"], results["rank"] = uninterrupted.world_size, uninterrupted.rank
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    for backend in [*backends, reference, critic, restored_critic, critic_role, mixed, uninterrupted,
                    resumed]:
        backend.close()


# the 2-rank job spawns 2 processes that import torch and meet in a gloo group (~30 s on 2 cores): slow
two_rank_job = pytest.mark.slow


@pytest.fixture(scope="module")
def two_ranks(random_model_dir, tmp_path_factory):
    """Run `_two_rank_job` on 2 spawned processes; returns (rank 0 results, rank 1 results, out_dir)."""
    from rollflow.fresh_model import save_fresh_vl_model

    out_dir = tmp_path_factory.mktemp("fsdp2")
    save_fresh_vl_model(out_dir / "vl", seed=0)
    context = mp.start_processes(_two_rank_job, args=(_free_port(), random_model_dir, str(out_dir),
                                                      str(out_dir / "vl")),
                                 nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not context.join(timeout=1):  # re-raises a rank's exception
        if time.monotonic() > deadline:  # a collective mismatch hangs rather than fails
            for process in context.processes:
                process.kill()
            pytest.fail(f"the 2-rank FSDP2 job did not finish in {JOB_TIMEOUT_S} s (deadlock?)")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)] + [out_dir]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b)
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def _assert_metrics_close(got: dict[str, float], expected: dict[str, float]) -> None:
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_shard_rows_split_like_tensor_split_and_passes_cover_the_largest_shard():
    for rows in range(0, 12):
        for world in (1, 2, 3, 4):
            expected = [len(part) for part in torch.arange(rows).tensor_split(world)]
            slices = [shard_rows(rows, world, rank) for rank in range(world)]
            assert [s.stop - s.start for s in slices] == expected
            assert [s.start for s in slices] == [sum(expected[:rank]) for rank in range(world)]  # contiguous
    # 7 rows on 2 ranks: shards 4 and 3; 2 rows per pass -> 2 passes each; 1 row: 1 pass even on the empty rank
    assert passes_per_rank(7, 2, 2) == 2
    assert passes_per_rank(5, 2, 2) == 2  # shards 3 and 2
    assert passes_per_rank(1, 2, 2) == 1
    assert passes_per_rank(9, 4, 1) == 3  # shards 3, 2, 2, 2


def test_mixed_precision_spec_maps_dtype_names_and_rejects_typos():
    policy = mixed_precision_policy({"param_dtype": "bfloat16", "reduce_dtype": "float32"})
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision_policy(None).param_dtype is None
    with pytest.raises(ValueError, match="param_dtype"):
        mixed_precision_policy({"param_type": "bfloat16"})
    with pytest.raises(ValueError, match="bfloat16"):
        mixed_precision_policy({"param_dtype": "bf16"})


@two_rank_job
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_two_ranks_train_like_one_process(two_ranks, random_model_dir, aggregation):
    """Loss, metrics and updated weights equal TorchBackend's after each of 4 steps on batches of 8, 7, 5 and 1
    rows (uneven shards, placeholder passes, an empty shard; Adam state carried between steps)."""
    rank0, rank1, _ = two_ranks
    torch.manual_seed(0)
    single = _single(_settings(random_model_dir))
    before = {name: tensor.clone() for name, tensor in single.named_weights().items()}
    for step, (rows, seed) in enumerate(STEPS):
        expected = single.train_step(_batch(rows, seed), _actor_loss(aggregation))
        (metrics, weights), (metrics1, weights1) = rank0[aggregation][step], rank1[aggregation][step]
        # grad_norm is what catches averaging instead of summing over ranks: clipping and Adam are (nearly)
        # invariant to the gradient's scale, so the weights alone would not (measured: 2.44 vs 1.22)
        _assert_metrics_close(metrics, expected)
        assert metrics1 == metrics  # global metrics, identical on every rank
        assert weights1 == {}  # full weights only on rank 0
        assert _max_diff(weights, single.named_weights()) <= WEIGHT_TOLERANCE, (step, rows)
    assert expected["grad_norm"] > 0 and _max_diff(before, single.named_weights()) > 100 * WEIGHT_TOLERANCE


@two_rank_job
def test_forward_logprobs_and_frozen_reference_match_and_every_rank_gets_all_rows(two_ranks, random_model_dir):
    rank0, rank1, _ = two_ranks
    torch.manual_seed(0)
    single = _single(_settings(random_model_dir))
    for rows, seed in STEPS:  # the last aggregation's run
        single.train_step(_batch(rows, seed), _actor_loss(AGGREGATIONS[-1]))
    expected = single.forward_logprobs(_batch(7, 10), temperature=0.7)  # [7, T]
    assert rank0["logprobs"].shape == expected.shape
    assert torch.allclose(rank0["logprobs"], expected, atol=1e-5)
    assert torch.equal(rank1["logprobs"], rank0["logprobs"])
    frozen = _single(TrainerSettings(random_model_dir, trainable=False, micro_batch_size=MICRO_BATCH))
    reference = frozen.forward_logprobs(_batch(3, 11))
    assert torch.allclose(rank0["reference_logprobs"], reference, atol=1e-5)
    assert torch.equal(rank1["reference_logprobs"], rank0["reference_logprobs"])


@two_rank_job
def test_critic_trains_like_one_process_and_round_trips(two_ranks, random_model_dir):
    rank0, rank1, _ = two_ranks
    torch.manual_seed(0)
    single = _single(_settings(random_model_dir, value_head=True))
    batch = _critic_batch(5, 12)
    _assert_metrics_close(rank0["critic_metrics"], single.train_step(batch, CriticLoss("token_mean", None)))
    values = single.forward_values(batch)  # [5, T]
    assert values.abs().max() > 0  # the head moved off its zero init
    assert torch.allclose(rank0["values"], values, atol=1e-5)
    assert torch.equal(rank1["values"], rank0["values"])
    assert torch.equal(rank0["restored_values"], rank0["values"])


@two_rank_job
def test_critic_role_on_two_ranks_takes_the_same_value_loss_steps_as_one_process(two_ranks, random_model_dir):
    """`roles.critic.backend: fsdp2`: a value-head backend from `create_backend` matches TorchBackend's
    value-loss steps, metrics and weights, after each of the 8-, 7-, 5- and 1-row steps (uneven shards,
    placeholder passes, an empty shard)."""
    rank0, rank1, _ = two_ranks
    assert rank0["implements_protocol"] and rank1["implements_protocol"]
    torch.manual_seed(0)
    single = _single(_settings(random_model_dir, value_head=True))
    before = {name: tensor.clone() for name, tensor in single.named_weights().items()}
    for step, (rows, seed) in enumerate(STEPS):
        expected = single.train_step(_critic_batch(rows, seed), _critic_loss())
        (metrics, weights), (metrics1, weights1) = rank0["critic_steps"][step], rank1["critic_steps"][step]
        _assert_metrics_close(metrics, expected)
        assert metrics1 == metrics  # global metrics, identical on every rank
        assert weights1 == {}  # full weights only on rank 0
        assert _max_diff(weights, single.named_weights()) <= WEIGHT_TOLERANCE, (step, rows)
    assert "value_head.weight" in weights  # the head travels with the backbone
    assert expected["critic/value_loss"] > 0
    assert _max_diff(before, single.named_weights()) > 100 * WEIGHT_TOLERANCE


@two_rank_job
def test_frozen_two_rank_backend_reads_like_one_process_and_refuses_to_train(two_ranks, random_model_dir):
    """`roles.reference.backend: fsdp2`: no optimizer, no trainable weight, the initial weights, and the same
    logprobs as a frozen TorchBackend on every batch shape (an empty shard on rank 1 for the 1-row batch)."""
    rank0, rank1, _ = two_ranks
    frozen = _single(TrainerSettings(random_model_dir, trainable=False, micro_batch_size=MICRO_BATCH))
    for index, (rows, seed) in enumerate(STEPS):
        expected = frozen.forward_logprobs(_batch(rows, seed), temperature=0.7)  # [rows, T]
        assert rank0["reference_steps"][index].shape == expected.shape
        assert torch.allclose(rank0["reference_steps"][index], expected, atol=1e-5), rows
        assert torch.equal(rank1["reference_steps"][index], rank0["reference_steps"][index])
    assert rank0["reference_frozen"] == rank1["reference_frozen"] == (True, False)
    assert "frozen" in rank0["frozen_train_error"] and "frozen" in rank1["frozen_train_error"]
    assert _max_diff(rank0["reference_weights"], frozen.named_weights()) == 0
    assert rank1["reference_weights"] == {}


@two_rank_job
def test_bfloat16_compute_with_float32_reduction_trains_close_to_float32(two_ranks, random_model_dir):
    rank0, rank1, _ = two_ranks
    initial = TorchBackend(TrainerSettings(random_model_dir, trainable=False)).named_weights()
    torch.manual_seed(0)
    expected = TorchBackend(_settings(random_model_dir)).train_step(_batch(7, 2), _actor_loss("token_mean"))
    metrics, weights = rank0["mixed_precision"]
    assert rank1["mixed_precision"][0] == metrics
    # first step from the sampling policy: ratio == 1, so the loss is -sum(A * m) / N in any precision
    assert metrics["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    # the gradient is computed in bfloat16: close to the float32 one, but not equal
    assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=0.05)
    assert metrics["grad_norm"] != pytest.approx(expected["grad_norm"], rel=1e-5)
    assert weights["model.norm.weight"].dtype == torch.float32  # the sharded parameters stay float32
    # Adam's first step moves each weight by lr * g / (|g| + eps) <= lr = LR / 3 (warm-up step 1 of 3)
    assert LR / 10 < _max_diff(weights, initial) <= LR / 3 * (1 + 1e-4)


@two_rank_job
def test_save_load_then_steps_equal_uninterrupted_steps(two_ranks):
    rank0, rank1, _ = two_ranks
    (metrics, weights), (resumed_metrics, resumed_weights) = rank0["uninterrupted"], rank0["resumed"]
    assert [m["lr"] for m in metrics] == [m["lr"] for m in resumed_metrics] == pytest.approx([LR, LR])  # after steps 2, 3 of warm-up 3
    for got, expected in zip(resumed_metrics, metrics, strict=True):
        _assert_metrics_close(got, expected)
    assert _max_diff(resumed_weights, weights) <= 1e-7
    assert _max_diff(weights, rank0["saved_weights"]) > 100 * WEIGHT_TOLERANCE  # the later steps moved them
    assert rank1["resumed"][1] == {}


@two_rank_job
def test_checkpoint_is_a_hugging_face_model(two_ranks):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rank0, _, out_dir = two_ranks
    path = out_dir / "checkpoint"
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.architectures == ["Qwen2ForCausalLM"]  # not FSDP's wrapper class name
    loaded = {name: p.detach() for name, p in model.named_parameters()}
    assert _max_diff(loaded, rank0["saved_weights"]) == 0
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    assert AutoTokenizer.from_pretrained(path).decode([3, 4]) != ""
    assert sorted(p.name for p in (path / "optimizer").iterdir())  # the sharded optimizer state
    assert {f"trainer_state_rank{r}.pt" for r in range(WORLD)} <= {p.name for p in path.iterdir()}


@two_rank_job
def test_offloaded_backend_refuses_work_until_onloaded(two_ranks):
    rank0, rank1, _ = two_ranks
    assert "onload()" in rank0["offloaded_error"] and "onload()" in rank1["offloaded_error"]
    assert (rank0["rank"], rank1["rank"], rank0["world_size"]) == (0, 1, WORLD)
    assert torch.equal(rank0["onloaded_logprobs"], rank1["onloaded_logprobs"])


def test_world_size_one_in_process_and_bfloat16_compute(random_model_dir, monkeypatch):
    """World size 1 works (same step as TorchBackend); param_dtype bfloat16 really computes in bfloat16."""
    from rollflow.backends.fsdp2 import FSDP2Backend

    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(_free_port())).items():
        monkeypatch.setenv(name, value)
    loss = _actor_loss("seq_mean_token_sum_norm")
    backend = FSDP2Backend(_settings(random_model_dir, max_response_length=8))
    try:
        half = FSDP2Backend(TrainerSettings(random_model_dir, trainable=False),
                            mixed_precision={"param_dtype": "bfloat16"})
        metrics = backend.train_step(_batch(5, 20), loss)
        batch = _batch(4, 21)
        weights = backend.named_weights()
        half_logprobs = half.forward_logprobs(batch)
    finally:
        backend.close()
    assert not torch.distributed.is_initialized()
    torch.manual_seed(0)
    single = _single(_settings(random_model_dir, max_response_length=8))
    _assert_metrics_close(metrics, single.train_step(_batch(5, 20), loss))
    assert _max_diff(weights, single.named_weights()) <= WEIGHT_TOLERANCE
    full = _single(TrainerSettings(random_model_dir, trainable=False)).forward_logprobs(batch)
    gap = float((half_logprobs - full).abs().max())
    assert 1e-4 < gap < 0.1  # bfloat16 rounding: visible, but small


def test_non_finite_steps_on_one_in_process_rank(random_model_dir, monkeypatch):
    """The non-finite checks read the global (DTensor) norms: a NaN gradient stops or skips without touching
    the shards, and weights a step made non-finite stop the run."""
    from rollflow.backends.fsdp2 import FSDP2Backend
    from rollflow.errors import NonFiniteError
    from tests.backends.test_torch_backend import NaNGradientLoss

    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(_free_port())).items():
        monkeypatch.setenv(name, value)
    stopping = FSDP2Backend(_settings(random_model_dir))  # owns the process group: closed last
    try:
        skipping = FSDP2Backend(_settings(random_model_dir, on_nonfinite="skip_step"))
        diverging = FSDP2Backend(_settings(random_model_dir, lr=float("inf"), on_nonfinite="skip_step"))
        before = stopping.named_weights()
        with pytest.raises(NonFiniteError, match=r"non-finite grad norm \(nan\) at optimizer step 1"):
            stopping.train_step(_batch(5, 30), NaNGradientLoss())
        assert _max_diff(before, stopping.named_weights()) == 0.0
        assert skipping.train_step(_batch(5, 30), NaNGradientLoss())["skipped_steps"] == 1.0
        assert _max_diff(before, skipping.named_weights()) == 0.0
        assert skipping.train_step(_batch(5, 31), _actor_loss("token_mean"))["skipped_steps"] == 0.0
        with pytest.raises(NonFiniteError, match="weights became non-finite after optimizer step 1"):
            diverging.train_step(_batch(5, 30), _actor_loss("token_mean"))
    finally:
        stopping.close()


@two_rank_job
def test_a_vision_language_model_on_two_ranks_trains_like_one_process(two_ranks):
    out_dir = two_ranks[2]
    vl_dir = str(out_dir / "vl")
    single = _single(_settings(vl_dir))
    for (metrics, weights), (rows, first) in zip(two_ranks[0]["vl_steps"], VL_STEPS):
        expected = single.train_step(_vl_batch(vl_dir, rows, first), _actor_loss("token_mean"))
        _assert_metrics_close(metrics, expected)
        # a looser bound than text's: Adam scales the ranks' differently summed near-zero gradients (the
        # tower's) up to a step of lr; measured 1.2e-5 after the second step
        assert _max_diff(weights, single.named_weights()) < 5 * WEIGHT_TOLERANCE
    assert any("visual" in name for name in two_ranks[0]["vl_steps"][0][1])  # the tower is synced
    expected = single.forward_logprobs(_vl_batch(vl_dir, 3, 20))
    assert torch.allclose(two_ranks[0]["vl_logprobs"], expected, atol=1e-5)
    assert torch.equal(two_ranks[0]["vl_logprobs"], two_ranks[1]["vl_logprobs"])
