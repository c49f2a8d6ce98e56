"""The RLVR step's rollout, with a core that hands out a prepared batch (no engines, no Ray): samples that
failed (a reward that raises on some rows) are warned of once a run, on stderr."""

from __future__ import annotations

from rollflow.config import load_config
from rollflow.data.sample import Sample, SampleStatus
from rollflow.pipelines.rlvr import RLVRStep
from rollflow.rollout.core import RolloutResult


class _Core:
    def __init__(self, batches):
        self.batches = batches

    def next_batch(self, step, version):
        return RolloutResult(self.batches[step - 1], {})


class _Colocation:
    def enter(self, phase):
        pass


def _batch(failed: int) -> list[Sample]:
    samples = [Sample([1], [2], [-0.1], group_id=0, reward=1.0) for _ in range(4)]
    for sample in samples[:failed]:
        sample.status, sample.metadata["error"] = SampleStatus.FAILED, "ValueError: cannot score this row"
    return samples


def test_failed_samples_are_warned_of_once_a_run(capsys):
    step = RLVRStep(load_config(None, ["checks.logprob_parity_samples=0"]))
    step.core, step.colocation = _Core([_batch(0), _batch(1), _batch(2)]), _Colocation()
    for number in (1, 2, 3):
        generated, metrics = step.rollout(number)
    assert capsys.readouterr().err == (
        "rollflow: warning: step 2: 1 of 4 samples failed; the first failed with: ValueError: cannot score this row "
        "(failed samples are not trained on; later failures are counted in rollout/failed_ratio and logged in "
        "samples.jsonl, not printed)\n")
    assert len(generated.usable) == 2 and metrics["rollout/failed_ratio"] == 0.5
