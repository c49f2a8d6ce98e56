from rollflow.data.sample import Sample, SampleStatus
from rollflow.rollout.filters import failure_warning, filter_by_difficulty, usable
from tests.conftest import step_samples


def test_usable_drops_failed_and_emptystep_samples():
    assert len(usable(step_samples())) == 3


def _groups():
    return [Sample([1], [2], [-0.1], group_id=g, reward=r) for g, r in [(0, 1.0), (0, 0.0), (1, 1.0), (1, 1.0)]]


def test_difficulty_mask_drops_groups_without_signal():
    samples = _groups()
    assert filter_by_difficulty(samples, None) == {}
    assert [s.status for s in samples] == [SampleStatus.FINISHED] * 4  # off: nothing changes
    metrics = filter_by_difficulty(samples, (0.0, 1.0))
    kept = usable(samples)
    assert [s.group_id for s in kept] == [0, 0] and [s.reward for s in kept] == [1.0, 0.0]  # group 1 is all 1
    assert [s.status for s in samples[2:]] == [SampleStatus.FILTERED] * 2  # dropped, and says so
    assert metrics == {"difficulty_mask/kept_samples": 2.0, "difficulty_mask/kept_group_frac": 0.5}
    samples = _groups()
    metrics = filter_by_difficulty(samples, (0.6, 0.9))
    assert usable(samples) == [] and metrics["difficulty_mask/kept_group_frac"] == 0.0


def test_difficulty_mask_counts_only_usable_samples_of_a_group():
    samples = _groups()
    samples[1].status = SampleStatus.FAILED  # group 0 is now (1.0) alone: all right, no signal
    metrics = filter_by_difficulty(samples, (0.0, 1.0))
    assert usable(samples) == [] and metrics["difficulty_mask/kept_samples"] == 0.0
    assert samples[1].status == SampleStatus.FAILED  # a failed sample stays failed


def test_a_failure_warning_counts_the_failed_samples_and_names_the_first_error():
    samples = step_samples()  # its 4th sample failed, with no error recorded
    samples[1].status, samples[1].metadata["error"] = SampleStatus.FAILED, "ValueError: bad row\nmore lines"
    assert failure_warning(samples, "step 3") == ("step 3: 2 of 4 samples failed; the first failed with: "
                                                  "ValueError: bad row")
    assert failure_warning(step_samples()[:3], "step 3") is None
