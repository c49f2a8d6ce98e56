"""Kept workers (`rollflow.cluster.pool`): a run adopts the workers the previous run of the same shape left, and
a run in adopted workers is the run it would have been in new ones, whatever ran in them before."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import ray
import torch

from rollflow.cluster.pool import WorkerPool, keep_workers, worker_pool
from rollflow.config import load_config
from rollflow.pipelines.rlvr import run_rlvr

QUICKSTART = str(Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml")
RUN = ["train.steps=2", "rollout.groups_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=6",
       "train.train_micro_batch_size=8", "train.lr=1e-3", "data.eval.limit=8", "eval.every_steps=0",
       "output.trackers=[jsonl]", "output.save_every_steps=0", "seed=5"]
NOISY = ("time/", "memory/", "seconds", "per_second")


def _metrics(run_dir: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not any(n in k for n in NOISY)} for row in rows]


class _Handle:
    def __init__(self, name: str):
        self.name = name


def test_the_pool_hands_out_by_key_and_holds_at_most_max_idle(monkeypatch):
    killed = []
    monkeypatch.setattr(ray, "kill", lambda handle: killed.append(handle.name))
    pool = WorkerPool(max_idle=2)
    a, b, c = _Handle("a"), _Handle("b"), _Handle("c")
    pool.park("train", a)
    pool.park("infer", b)
    assert pool.take("critic") is None
    pool.park("train", c)  # the longest idle (a) makes room
    assert killed == ["a"]
    assert pool.take("train") is c and pool.take("train") is None
    assert pool.take("infer") is b
    assert (pool.adopted, pool.started, pool.parked, pool.evicted) == (2, 2, 3, 1)
    assert pool.started_keys == {"critic": 1, "train": 1}
    with pytest.raises(ValueError, match="max_idle"):
        WorkerPool(max_idle=0)


def test_keep_workers_nests_and_kills_the_idle_on_the_way_out(monkeypatch):
    import rollflow.cluster.pool as pool_module

    monkeypatch.setattr(pool_module, "_pool", None)  # the test session's own (tests/conftest.py) aside
    killed = []
    monkeypatch.setattr(ray, "kill", lambda handle: killed.append(handle.name))
    assert worker_pool() is None
    with keep_workers(max_idle=3) as pool:
        with keep_workers() as inner:
            assert inner is pool
        pool.park("train", _Handle("a"))
    assert worker_pool() is None and killed == ["a"]


@pytest.mark.slow
def test_a_run_in_adopted_workers_is_the_run_new_workers_make(ray_session, tmp_path):
    """Run A in new workers; run B (another algorithm and learning rate) in A's; run C, A's config, in the
    workers B trained in: C logs A's metrics step by step."""
    pool = worker_pool()
    assert pool is not None, "the test session keeps its workers (tests/conftest.py ray_session)"
    pool.clear()  # A starts new workers
    run_rlvr(load_config(QUICKSTART, [*RUN, "name=a", f"output.dir={tmp_path}"]), manage_ray=False)
    adopted = pool.adopted
    run_rlvr(load_config(QUICKSTART, [*RUN, "name=b", f"output.dir={tmp_path}", "algorithm.advantage=rloo",
                                      "train.lr=3e-3", "seed=9"]), manage_ray=False)
    run_rlvr(load_config(QUICKSTART, [*RUN, "name=c", f"output.dir={tmp_path}"]), manage_ray=False)
    assert pool.adopted - adopted == 2  # B and C each took the hybrid worker (actor_train serves actor_infer)
    a, b, c = (_metrics(tmp_path / name) for name in "abc")
    assert any(row.get("grad_norm", 0) > 0 for row in a)  # it trained: there is something to differ
    assert a != b
    for first, adopted_row in zip(a, c, strict=True):
        assert first == adopted_row, {k: (first.get(k), adopted_row.get(k)) for k in first.keys() | adopted_row.keys()
                                      if first.get(k) != adopted_row.get(k)}


def test_a_kept_worker_is_pinned_to_its_new_runs_cores_or_given_the_machine_back():
    """A worker placed on core 1 by one run and adopted by a run that does not place it gets the cores its
    process started with, not core 1; placed again, core `d` still indexes those cores."""
    from rollflow.cluster.runtime import PROCESS_CORES, pin_worker

    if not hasattr(os, "sched_setaffinity") or len(PROCESS_CORES) < 2:
        pytest.skip("needs CPU affinity and 2 cores")
    threads = torch.get_num_threads()
    cores = sorted(PROCESS_CORES)
    try:
        pin_worker(1, (1,), "cpu")
        assert os.sched_getaffinity(0) == {cores[1]}
        pin_worker(1, (0,), "cpu")  # indexes the process's cores, not the last run's {cores[1]}
        assert os.sched_getaffinity(0) == {cores[0]}
        pin_worker(1, (), "cpu")
        assert os.sched_getaffinity(0) == set(PROCESS_CORES)
    finally:
        os.sched_setaffinity(0, PROCESS_CORES)
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_the_workers_of_a_placed_run_are_kept_on_a_one_node_cluster(ray_session, tmp_path):
    """examples/async.yaml places the trainer on core 0 and the engine on core 1; on the session's one node its
    placement group only reserves the cores, so its two workers are parked, and a run that does not place
    them adopts both."""
    pool = worker_pool()
    pool.clear()
    parked, adopted = pool.parked, pool.adopted
    run_rlvr(load_config(str(Path(QUICKSTART).with_name("async.yaml")),
                         [*RUN, "train.steps=1", "name=placed", f"output.dir={tmp_path}"]), manage_ray=False)
    assert pool.parked - parked == 2
    assert all(group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())  # released
    run_rlvr(load_config(QUICKSTART, [*RUN, "train.steps=1", "name=unplaced", f"output.dir={tmp_path}",
                                      "roles.actor_infer.hybrid=false"]), manage_ray=False)
    assert pool.adopted - adopted == 2
    assert _metrics(tmp_path / "unplaced")[-1]["step"] == 1


@pytest.mark.slow
def test_a_run_stopped_by_a_bad_input_while_its_workers_start_keeps_the_adopted_ones(ray_session, tmp_path):
    """A dataset without a prompt column is found while the workers start (`RoleLaunch.cancelled_on_error`): the
    run stops before any step, and the worker it had adopted is parked again, not killed with the start."""
    from rollflow.errors import RollflowError

    pool = worker_pool()
    run_rlvr(load_config(QUICKSTART, [*RUN, "train.steps=1", "name=good", f"output.dir={tmp_path}"]),
             manage_ray=False)
    hybrid = [key for key, _ in pool.idle.values() if key[0].endswith(":HybridWorker")]
    assert hybrid, pool.idle
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    started, adopted, parked = pool.started, pool.adopted, pool.parked
    with pytest.raises(RollflowError, match="no 'prompt' column"):
        run_rlvr(load_config(QUICKSTART, [*RUN, f"data.train={{path: {data}}}", "name=bad",
                                          f"output.dir={tmp_path}"]), manage_ray=False)
    assert (pool.started, pool.adopted, pool.parked) == (started, adopted + 1, parked + 1)
    run_rlvr(load_config(QUICKSTART, [*RUN, "train.steps=1", "name=again", f"output.dir={tmp_path}"]),
             manage_ray=False)
    assert (pool.started, pool.adopted) == (started, adopted + 2)  # the next run adopted it once more
