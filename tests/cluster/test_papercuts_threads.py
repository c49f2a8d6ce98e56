"""`pinned_threads`: a pipeline driver pins its threads and gives the caller's back (a notebook that calls
`run_rlvr` keeps its torch thread count and its OMP / MKL variables), whether the run returns or raises."""

from __future__ import annotations

import os

import pytest
import torch

from rollflow.cluster.runtime import THREAD_VARIABLES, pinned_threads
from rollflow.config import load_config


class RayWouldStart(Exception):
    """Raised in place of starting Ray: the runner got past its checks."""


@pytest.fixture
def caller_threads(monkeypatch):
    """The caller runs 2 torch threads, with OMP_NUM_THREADS=2 and no MKL / OpenBLAS variable set."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    yield
    torch.set_num_threads(before)


def _callers_threads_are_back():
    assert torch.get_num_threads() == 2
    assert {var: os.environ.get(var) for var in THREAD_VARIABLES} == {
        "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": None, "OPENBLAS_NUM_THREADS": None}


def test_pinned_threads_restores_after_return_and_raise(caller_threads):
    with pinned_threads(1) as threads:
        assert threads == 1 and torch.get_num_threads() == 1 and os.environ["MKL_NUM_THREADS"] == "1"
    _callers_threads_are_back()

    @pinned_threads(1)
    def fails():
        assert torch.get_num_threads() == 1
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        fails()
    _callers_threads_are_back()


@pytest.mark.parametrize("runner, config_path, overrides", [
    ("rollflow.pipelines.rlvr:run_rlvr", None, ["data.train.limit=8", "data.eval.limit=8"]),
    ("rollflow.pipelines.agentic:run_agentic", None, ["pipeline=agentic"]),
    ("rollflow.pipelines.supervised:run_supervised", "examples/sft_tiny.yaml",
     ["model.path=tiny", "data.train.limit=128", "data.eval.limit=8"]),
    ("rollflow.pipelines.evaluate:run_eval", None, ["data.eval.limit=8"]),
], ids=["rlvr", "agentic", "sft", "eval"])
def test_every_runner_gives_the_callers_threads_back(caller_threads, monkeypatch, tmp_path, runner, config_path,
                                                     overrides):
    from rollflow.registry import import_object

    def refuse(*args, **kwargs):
        assert torch.get_num_threads() == 1  # the driver runs pinned
        raise RayWouldStart

    monkeypatch.setattr("rollflow.workers.roles.start_ray", refuse)
    config = load_config(config_path, [*overrides, f"output.dir={tmp_path}"])
    with pytest.raises(RayWouldStart):
        import_object(runner)(config)
    _callers_threads_are_back()
