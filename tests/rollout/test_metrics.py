import pytest

from rollflow.rollout.metrics import is_correct, rollout_metrics
from tests.conftest import step_samples


def test_rollout_metrics_count_accuracy_on_the_primary_reward():
    samples = step_samples()
    metrics = rollout_metrics(samples)
    # correct: only the first (0.5 is not a full score, the failed one never counts)
    assert metrics["rollout/accuracy"] == pytest.approx(1 / 4)
    assert metrics["reward/mean"] == pytest.approx((1.0 + 0.0 + 0.5 + 0.0) / 4)
    assert metrics["rollout/response_length"] == pytest.approx((2 + 1 + 3 + 0) / 4)
    assert metrics["rollout/truncated_ratio"] == pytest.approx(1 / 4)
    assert metrics["rollout/failed_ratio"] == pytest.approx(1 / 4)
    assert metrics["rollout/reward/math_answer"] == pytest.approx(1.5 / 4)
    assert not is_correct(samples[3])
