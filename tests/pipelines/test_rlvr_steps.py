import pytest
import torch

from rollflow.config import AlgorithmConfig
from rollflow.data.sample import Sample, SampleStatus, collate
from rollflow.errors import ParityError
from rollflow.pipelines.rlvr_steps import (
    check_logprob_parity,
    compute_advantages,
    is_correct,
    rollout_metrics,
    usable,
)


def _samples():
    return [
        Sample([1, 2], [3, 4], [-0.5, -0.25], group_id=0, reward=1.0, rewards={"math_answer": 1.0}),
        Sample([1, 2], [5], [-1.0], group_id=0, reward=0.0, rewards={"math_answer": 0.0},
               status=SampleStatus.TRUNCATED),
        Sample([1], [6, 7, 8], [-0.1, -0.2, -0.3], group_id=1, reward=0.5, rewards={"math_answer": 0.5}),
        Sample([1], [], group_id=1, status=SampleStatus.FAILED),
    ]


def test_parity_check_measures_the_gap_and_stops_on_a_large_one():
    batch = collate(_samples()[:3], pad_token_id=0)
    close = batch.rollout_logprobs + 1e-4 * batch.response_mask
    assert check_logprob_parity(batch, close, tolerance=1e-2) == pytest.approx(1e-4, rel=1e-3)
    far = batch.rollout_logprobs.clone()
    far[1, 0] -= 0.5  # one token disagrees by 0.5
    with pytest.raises(ParityError, match="differ by up to 0.5"):
        check_logprob_parity(batch, far, tolerance=1e-2)
    padded = batch.rollout_logprobs.clone()
    padded[1, 2] = 9.0  # padding is ignored
    assert check_logprob_parity(batch, padded, tolerance=1e-2) == 0.0


def test_usable_drops_failed_and_empty_samples():
    assert len(usable(_samples())) == 3


def test_rollout_metrics_count_accuracy_on_the_primary_reward():
    samples = _samples()
    metrics = rollout_metrics(samples)
    # correct: only the first (0.5 is not a full score, the failed one never counts)
    assert metrics["rollout/accuracy"] == pytest.approx(1 / 4)
    assert metrics["reward/mean"] == pytest.approx((1.0 + 0.0 + 0.5 + 0.0) / 4)
    assert metrics["rollout/response_length"] == pytest.approx((2 + 1 + 3 + 0) / 4)
    assert metrics["rollout/truncated_ratio"] == pytest.approx(1 / 4)
    assert metrics["rollout/failed_ratio"] == pytest.approx(1 / 4)
    assert metrics["rollout/reward/math_answer"] == pytest.approx(1.5 / 4)
    assert not is_correct(samples[3])


def test_compute_advantages_uses_the_configured_estimator():
    batch = collate(_samples()[:3], pad_token_id=0)
    metrics = compute_advantages(batch, AlgorithmConfig(advantage="grpo"))
    advantages = batch.extras["advantages"]
    # group 0 has rewards (1, 0): mean 0.5, unbiased std 0.7071 -> +-0.7071 on every response token
    assert advantages[0, :2].tolist() == pytest.approx([0.70710, 0.70710], abs=1e-4)
    assert advantages[1, 0].item() == pytest.approx(-0.70710, abs=1e-4)
    assert torch.all(advantages[1, 1:] == 0)  # padding
    assert torch.all(advantages[2] == 0)  # a group of one has no baseline signal
    assert "advantage/zero_std_group_frac" in metrics
