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


def test_samples_of_named_domains_get_per_domain_metrics():
    from rollflow.data.sample import Sample, SampleStatus

    samples = [
        Sample([1], [2], domain="add2", reward=1.0, rewards={"math_answer": 1.0}),
        Sample([1], [2, 3], domain="add2", reward=0.0, rewards={"math_answer": 0.0}),
        Sample([1], [2], domain="add2", status=SampleStatus.FAILED),
        # sum3 has its own second reward, `short`, weight 0.5: totals 1 + 0.5 * -0.2 = 0.9 and 0 + 0.5 * -0.4 = -0.2
        Sample([1], [2], domain="sum3", reward=0.9, rewards={"math_answer": 1.0, "short": -0.2}),
        Sample([1], [2], domain="sum3", reward=-0.2, rewards={"math_answer": 0.0, "short": -0.4}),
    ]
    metrics = rollout_metrics(samples)
    assert metrics["rollout/add2/samples"] == 3 and metrics["rollout/sum3/samples"] == 2
    assert metrics["rollout/add2/accuracy"] == pytest.approx(1 / 3)  # the failed sample is not correct
    assert metrics["rollout/sum3/accuracy"] == pytest.approx(1 / 2)
    assert metrics["reward/add2"] == pytest.approx((1.0 + 0.0 + 0.0) / 3)
    assert metrics["reward/sum3"] == pytest.approx((0.9 - 0.2) / 2)
    assert metrics["reward/mean"] == pytest.approx((1.0 + 0.0 + 0.0 + 0.9 - 0.2) / 5)  # every sample
    assert metrics["rollout/accuracy"] == pytest.approx(2 / 5)
    assert metrics["rollout/reward/math_answer"] == pytest.approx(2 / 5)
    assert metrics["rollout/reward/short"] == pytest.approx((-0.2 - 0.4) / 2)  # over sum3's samples only
    evaluated = rollout_metrics(samples, prefix="eval")
    assert evaluated["eval/add2/accuracy"] == pytest.approx(1 / 3)
    assert evaluated["eval/accuracy"] == pytest.approx(2 / 5)
    assert not any(key.startswith("reward/") for key in evaluated)


def test_a_run_of_one_dataset_keeps_todays_metrics():
    metrics = rollout_metrics(step_samples())  # every sample of the domain "default"
    assert not any("default" in key for key in metrics)
    assert set(metrics) == {"rollout/samples", "rollout/accuracy", "rollout/response_length",
                            "rollout/truncated_ratio", "rollout/failed_ratio", "rollout/reward_mean",
                            "rollout/reward/math_answer", "reward/mean", "reward/std"}
