"""Placement, data-parallel training and weight-sync integrity, end to end on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollflow.config import load_config

pytestmark = pytest.mark.slow

FAST = ["rollout.groups_per_step=4", "rollout.group_size=4", "train.train_micro_batch_size=8",
        "data.eval.limit=16", "eval.every_steps=0", "output.trackers=[jsonl]", "train.steps=2"]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run(tmp_path: Path, name: str, *overrides: str) -> tuple[dict, list[dict]]:
    from rollflow.pipelines.rlvr import run_rlvr

    # separate engine workers (the quickstart's hybrid engine needs one torch trainer and no device_mapping)
    overrides = [*FAST, f"name={name}", f"output.dir={tmp_path}", "roles.actor_infer.hybrid=false", *overrides]
    config = load_config("examples/quickstart.yaml", overrides)
    run_rlvr(config, manage_ray=False)
    placement = json.loads((tmp_path / name / "placement.json").read_text())
    return placement, _metrics(tmp_path / name)


def test_corrupted_weight_transfer_stops_the_run_with_a_clear_error(tmp_path, cli):
    result = cli("train", "examples/quickstart.yaml", *FAST, "name=corrupt", f"output.dir={tmp_path}",
                 "checks.fault_injection_flip_sync_byte_at=1")
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("rollflow: error:")]
    assert len(errors) == 1 and "weight sync checksum mismatch" in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    steps = [row["step"] for row in _metrics(tmp_path / "corrupt")]
    assert steps == [0]  # the step whose sync failed was never logged as done
    assert not (tmp_path / "corrupt" / "checkpoints").exists()


def test_colocated_fsdp2_run_resumes_disaggregated_on_one_rank(tmp_path, ray_session):
    # colocated: 2 FSDP2 ranks and 2 engines share the 2 slots; weights go by torch broadcast (gloo)
    placement, rows = _run(tmp_path, "run", "roles.actor_train.backend=fsdp2",
                           "roles.actor_train.num_workers=2", "roles.actor_train.device_mapping=[0,1]",
                           "roles.actor_infer.device_mapping=[0,1]", "roles.actor_infer.num_workers=2",
                           "cluster.weight_sync_transport=broadcast")
    assert [w["devices"] for w in placement["actor_train"]] == [[0], [1]]
    assert [w["devices"] for w in placement["actor_infer"]] == [[0], [1]]
    last = rows[-1]
    assert last["step"] == 2 and last["sync/version"] == 2
    assert last["offload/actor_train_seconds"] >= 0 and last["onload/actor_infer_seconds"] >= 0  # they swap
    assert rows[1]["check/logprob_max_abs_diff"] < 1e-3  # samples of both engines checked at step 1
    assert (tmp_path / "run" / "checkpoints" / "step_2" / "model" / "optimizer").is_dir()  # sharded optimizer

    # resume the same run disaggregated: 1 FSDP2 rank on slot 0 (the 2-rank optimizer state is resharded),
    # the engine on slot 1, weights through the object store
    placement, rows = _run(tmp_path, "run", "roles.actor_train.backend=fsdp2",
                           "roles.actor_train.device_mapping=[0]", "roles.actor_infer.device_mapping=[1]",
                           "resume=true", "train.steps=3")
    assert placement["actor_train"][0]["devices"] == [0] and placement["actor_infer"][0]["devices"] == [1]
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    last = rows[-1]
    assert last["sync/version"] == 3 and "loss" in last  # continues the policy version after the checkpoint
    assert not any(key.startswith(("offload/", "onload/")) for key in last)  # nothing shares a device


def test_critic_and_reference_run_as_fsdp2_ranks(tmp_path, ray_session):
    """Every trainer role takes roles.<role>.backend: a 2-rank sharded critic and reference beside the actor."""
    placement, rows = _run(tmp_path, "sharded", "algorithm.advantage=gae", "algorithm.kl_loss_coef=0.1",
                           "roles.critic.backend=fsdp2", "roles.critic.num_workers=2",
                           "roles.reference.backend=fsdp2", "roles.reference.num_workers=2",
                           # a full-size first update: k3 of a warm-up step's tiny change rounds to 0 in fp32
                           "train.warmup_steps=0", "train.lr=1e-3")
    assert len(placement["critic"]) == 2 and len(placement["reference"]) == 2
    last = rows[-1]
    assert last["step"] == 2 and last["sync/version"] == 2
    assert last["critic/value_loss"] > 0 and last["critic/grad_norm"] > 0  # the sharded critic trains
    assert last["actor/kl"] > 0  # the sharded reference's logprobs reach the loss (after one update)
    assert (tmp_path / "sharded" / "checkpoints" / "step_2" / "critic" / "optimizer").is_dir()


MULTI_NODE = """
import sys
from ray.cluster_utils import Cluster
from rollflow.config import load_config
from rollflow.pipelines.rlvr import run_rlvr

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
cluster.add_node(num_cpus=1)
cluster.wait_for_nodes()
try:
    config = load_config("examples/quickstart.yaml", sys.argv[2:] + [f"cluster.address={cluster.address}"])
    run_rlvr(config)  # joins the running cluster instead of starting Ray
finally:
    cluster.shutdown()
"""


def test_roles_spread_over_two_nodes_of_a_ray_cluster(tmp_path):
    # Two simulated nodes of 1 CPU slot each: device 0 is node 0, device 1 is node 1.
    overrides = [*FAST, "name=two_nodes", f"output.dir={tmp_path}", *MULTI_NODE_ROLES]
    result = subprocess.run([sys.executable, "-c", MULTI_NODE, "--", *overrides],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "cluster: 2 node(s) x 1 CPU slots" in result.stdout
    placement = json.loads((tmp_path / "two_nodes" / "placement.json").read_text())
    nodes = {role: [w["node"] for w in workers] for role, workers in placement.items()}
    # the trainer's ranks on both nodes; the engine on the node of rank 1, so rank 0 syncs to another node
    assert len(set(nodes["actor_train"])) == 2 and nodes["actor_infer"] == [nodes["actor_train"][1]], nodes
    assert _metrics(tmp_path / "two_nodes")[-1]["sync/version"] == 2


# FSDP2 rank 0 on node 0 and rank 1 on node 1 (gloo across nodes), the engine on node 1: rank 0's weights cross
# nodes to it (one engine: each worker costs a process start, ~7 CPU-s)
MULTI_NODE_ROLES = ["roles.actor_infer.hybrid=false", "roles.actor_train.backend=fsdp2", "roles.actor_train.num_workers=2",
                    "roles.actor_train.device_mapping=[0,1]", "roles.actor_infer.device_mapping=[1]"]
