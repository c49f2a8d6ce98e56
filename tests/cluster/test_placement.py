"""The placement plan: device -> node arithmetic, colocation, and one-line errors for bad mappings."""

import re

import pytest

from rollflow.config import RLVRConfig, load_config
from rollflow.errors import ConfigError
from rollflow.workers.roles import plan_roles


def _config(*overrides: str) -> RLVRConfig:
    return load_config(None, ["rollout.groups_per_step=8", *overrides])


def test_no_device_mapping_places_nothing_and_everything_is_colocated():
    plan = plan_roles(_config("roles.actor_train.num_cpus=2"), ["actor_train", "actor_infer"], 2)
    assert not plan.placed
    assert [w.threads for w in plan.workers["actor_train"]] == [2]
    assert plan.colocated("actor_train", "actor_infer")
    assert plan.colocation_groups() == [["actor_train", "actor_infer"]]


def test_devices_split_over_workers_and_nodes():
    # 2 nodes x 4 devices: global device 5 is local device 1 of node 1
    config = _config("roles.actor_train.backend=fsdp2", "roles.actor_train.num_workers=2",
                     "roles.actor_train.device_mapping=[0,1,2,3]",
                     "roles.actor_infer.num_workers=4", "roles.actor_infer.device_mapping=[4,5,6,7]")
    plan = plan_roles(config, ["actor_train", "actor_infer"], devices_per_node=4, num_nodes=2)
    train, infer = plan.workers["actor_train"], plan.workers["actor_infer"]
    assert [w.devices for w in train] == [(0, 1), (2, 3)]
    assert [w.threads for w in train] == [2, 2]  # CPU: a worker's thread count is its slot count
    assert [(w.node, w.local_devices) for w in infer] == [(1, (0,)), (1, (1,)), (1, (2,)), (1, (3,))]
    assert not plan.colocated("actor_train", "actor_infer")
    assert plan.colocation_groups() == [["actor_train"], ["actor_infer"]]
    assert "disaggregated (may run concurrently): actor_train | actor_infer" in plan.describe()


def test_reference_follows_actor_train_and_overlap_colocates():
    config = _config("roles.actor_train.device_mapping=[0]", "roles.actor_infer.device_mapping=[0,1]",
                     "roles.actor_infer.num_workers=2", "algorithm.kl_loss_coef=0.1")
    plan = plan_roles(config, ["actor_train", "actor_infer", "reference"], 2)
    assert plan.workers["reference"][0].devices == (0,)
    assert plan.colocated("actor_train", "actor_infer")  # share device 0
    assert plan.colocation_groups() == [["actor_train", "actor_infer", "reference"]]
    assert "colocated (time-share, offload between phases): actor_train + actor_infer + reference" in plan.describe()


@pytest.mark.parametrize("overrides, message", [
    (["roles.actor_train.device_mapping=[0,4]", "roles.actor_infer.device_mapping=[1]"],
     "roles.actor_train.device_mapping uses device 4, but the cluster has 4 device(s)"),
    (["roles.actor_train.device_mapping=[0,0]", "roles.actor_infer.device_mapping=[1]"],
     "lists device(s) [0] more than once"),
    (["roles.actor_train.device_mapping=[0]", "roles.actor_infer.device_mapping=[0,1,2]",
      "roles.actor_infer.num_workers=2"], "lists 3 devices for roles.actor_infer.num_workers=2"),
    (["roles.actor_train.device_mapping=[0]"], "roles.actor_infer.device_mapping is missing"),
    (["roles.actor_train.device_mapping=[1,2]", "roles.actor_infer.device_mapping=[0]"],
     "worker 0 of actor_train would span nodes [0, 1]"),
    (["cluster.device=gpu"], "no role has a device_mapping"),
])
def test_bad_mappings_fail_with_one_line(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        plan_roles(_config(*overrides), ["actor_train", "actor_infer"], devices_per_node=2, num_nodes=2)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("overrides, message", [
    (["roles.actor_train.num_workers=2"], "set roles.actor_train.backend: fsdp2"),
    (["roles.actor_train.num_workers=3", "roles.actor_train.backend=fsdp2"],
     "3 data-parallel ranks .* cannot split evenly"),
    (["roles.actor_train.backend=fsdp2", "roles.actor_train.lora.rank=4"], "lora works with the torch backend"),
    (["roles.actor_train.backend_kwargs={lora: {rank: 2}}"], "backend_kwargs sets lora, which rollflow sets"),
])
def test_config_rejects_what_the_backends_cannot_run(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _config(*overrides)
