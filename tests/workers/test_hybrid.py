"""The hybrid worker (`roles.actor_infer.hybrid`): actor_train and its engine in one process. It generates,
trains, and syncs weights in memory with the same checksums as any transport; the plan, the worker groups
and the colocation state machine treat the engine as living inside actor_train's worker; configs it cannot
serve fail at load with the reason."""

import asyncio

import pytest
import torch

from rollflow.cluster.colocation import ColocationManager
from rollflow.cluster.groups import WorkerGroup, WorkerGroups
from rollflow.cluster.placement import WorkerPlacement
from rollflow.config import load_config
from rollflow.data.sample import Sample, collate
from rollflow.engines.base import GenerationRequest, SamplingParams
from rollflow.errors import ConfigError, WeightSyncError
from rollflow.pipelines.rl_step import PHASES
from rollflow.spans import take, traced
from rollflow.workers.hybrid import HybridWorker
from rollflow.workers.roles import describe_roles, plan_roles
from rollflow.workers.specs import HybridSpec, engine_spec, trainer_spec

PLACEMENT = WorkerPlacement("actor_train", 0, (), None, (), threads=1)
HYBRID = ["roles.actor_infer.hybrid=true", "rollout.groups_per_step=8"]


def _config(*overrides):
    return load_config(None, [*HYBRID, *overrides])


def hybrid_spec(config, objective: str) -> HybridSpec:
    return HybridSpec(trainer_spec(config, "actor_train", objective), engine_spec(config))


@pytest.fixture(scope="module")
def worker(random_model_dir):
    worker = traced(HybridWorker, lambda placement, *_: f"actor_train {placement.index}")(
        PLACEMENT, hybrid_spec(_config(f"model.path={random_model_dir}", "train.lr=1e-2"), "nll"))
    worker.init_backend("127.0.0.1", 0, world_size=1)
    yield worker
    worker.close()


def _engine_weights(worker) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in worker.engine.model.named_parameters()}


def _trainer_weights(worker) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in worker.trainer.backend.named_weights().items()}


def test_generates_trains_and_syncs_in_memory(worker):
    request = GenerationRequest("r0", [3, 20, 5], SamplingParams(max_new_tokens=3, n=2))
    completion = asyncio.run(worker.generate(request))
    assert len(completion.outputs) == 2 and completion.metadata["worker"] == 0
    assert all(1 <= len(output.token_ids) <= 3 for output in completion.outputs)

    batch = collate([Sample([3, 20, 5], [21, 22, 1]), Sample([3, 23, 5], [24, 1])], pad_token_id=0)
    worker.train(batch)  # one optimizer step of the NLL objective
    trained, engine = _trainer_weights(worker), _engine_weights(worker)
    assert any(not torch.equal(trained[name], engine[name]) for name in engine)  # not shared: a copy

    synced = worker.sync_engine(bucket_bytes=64 * 1024, checksum="bucket")
    assert synced["version"] == worker.trainer.version == worker.engine.version == 1
    assert synced["num_buckets"] > 1 and synced["nbytes"] == sum(t.numel() * t.element_size()
                                                                  for t in trained.values())
    engine = _engine_weights(worker)
    assert all(torch.equal(trained[name], engine[name]) for name in engine)


def test_a_corrupted_in_memory_sync_is_caught_before_the_engine_loads_it(worker):
    before, version = _engine_weights(worker), worker.engine.version
    with pytest.raises(WeightSyncError, match="checksum mismatch in bucket 0"):
        worker.sync_engine(bucket_bytes=64 * 1024, checksum="bucket", corrupt=True)
    after = _engine_weights(worker)
    assert worker.engine.version == version and all(torch.equal(before[n], after[n]) for n in before)


def test_engine_calls_are_spans_in_the_engine_lane(worker):
    take()
    asyncio.run(worker.abort(["nothing"]))
    worker.sync_engine(bucket_bytes=2**20)
    worker.onload()
    lanes = {span["name"]: span["lane"] for span in take()}
    assert lanes == {"abort": "actor_infer 0", "sync_engine": "actor_infer 0", "onload": "actor_train 0"}


def test_the_plan_puts_the_engine_inside_actor_train():
    config = _config("algorithm.kl_loss_coef=0.1", "roles.actor_train.num_cpus=2")
    plan = plan_roles(config, ["actor_train", "actor_infer", "reference"], devices_per_node=2)
    assert plan.hosted == {"actor_infer": "actor_train"}
    infer, train = plan.workers["actor_infer"][0], plan.workers["actor_train"][0]
    assert (infer.role, infer.index, infer.threads) == ("actor_infer", 0, train.threads) == ("actor_infer", 0, 2)
    assert "actor_infer runs inside the actor_train worker" in plan.describe()
    assert describe_roles(config, ["actor_train", "actor_infer"]) == \
        "actor_train x1 (torch), actor_infer x1 (hf, inside actor_train)"
    # a run without actor_train (`rollflow eval`) starts an engine worker of its own
    assert plan_roles(config, ["actor_infer"], devices_per_node=2).hosted == {}


def test_hosted_groups_start_stop_and_move_with_their_host():
    config = _config("algorithm.kl_loss_coef=0.1")
    plan = plan_roles(config, ["actor_train", "actor_infer", "reference"], devices_per_node=2)
    groups = WorkerGroups(plan)
    handle = object()  # never called: nothing in this test may reach a worker
    groups.groups["actor_train"] = WorkerGroup("actor_train", [handle], plan.workers["actor_train"])
    groups.groups["reference"] = WorkerGroup("reference", [object()], plan.workers["reference"])
    engines = groups.host("actor_infer")
    assert engines.handles == [handle] and engines.host == "actor_train"
    assert [p.role for p in engines.placements] == ["actor_infer"]
    assert [group.role for group in groups.own()] == ["actor_train", "reference"]  # closed, asked for spans once
    colocation = ColocationManager(plan, dict(groups), PHASES)
    assert set(colocation.resident) == {"actor_train", "reference"}
    colocation.in_flight = []
    offload_calls = []
    for group in (groups["actor_train"], groups["reference"]):
        group.call_async = lambda method, *args, role=group.role: offload_calls.append((role, method)) or []
    colocation.enter("rollout")  # the engine's phase moves nothing: the trainer hosts the engine
    assert offload_calls == []
    colocation.enter("reference")
    assert offload_calls == [("actor_train", "offload")]


@pytest.mark.parametrize("overrides, reason", [
    (["roles.actor_train.backend=fsdp2"], "actor_train.backend ('fsdp2', not 'torch')"),
    (["roles.actor_infer.engine=vllm"], "actor_infer.engine ('vllm', not 'hf')"),
    (["roles.actor_infer.num_workers=2"], "actor_infer.num_workers (2, not 1)"),
    (["roles.actor_train.device_mapping=[0]", "roles.actor_infer.device_mapping=[1]"],
     "actor_infer.device_mapping (set); actor_train.device_mapping (set)"),
    (["cluster.weight_sync_transport=broadcast"], "broadcast needs separate engine workers"),
    (["cluster.device=gpu"], "hybrid is for CPU runs"),
])
def test_configs_a_hybrid_worker_cannot_serve_fail_at_load(overrides, reason):
    with pytest.raises(ConfigError) as error:
        _config(*overrides)
    assert reason in str(error.value)
