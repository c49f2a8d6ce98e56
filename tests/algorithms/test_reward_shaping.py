"""Reward normalization, clipping, whitening, overlong shaping/filtering and the difficulty mask."""

import random

import pytest
import torch
from torch.testing import assert_close

from rollflow.algorithms import (
    RunningMoments,
    clip_advantages,
    clip_rewards,
    difficulty_mask,
    normalize_rewards,
    overlong_filter_mask,
    overlong_reward_penalty,
    whiten,
)

REWARDS = torch.tensor([1.0, 2.0, 0.0, 1.0])
GROUP_IDS = torch.tensor([5, 9, 5, 5])  # group 5 = {0, 2, 3}, group 9 = {1}


def test_normalize_none_is_identity():
    assert_close(normalize_rewards(REWARDS, GROUP_IDS), REWARDS)


def test_normalize_batch():
    # mean 1, deviations (0, 1, -1, 0), unbiased var 2/3, std 0.816497 -> (0, 1.224745, -1.224745, 0).
    result = normalize_rewards(REWARDS, GROUP_IDS, "batch", "batch")
    assert_close(result, torch.tensor([0.0, 1.224745, -1.224745, 0.0]), atol=1e-5, rtol=0)


def test_normalize_group_and_mean_only():
    # Group 5 = {1, 0, 1}: mean 2/3, std 0.57735 -> (0.57735, -, -1.15470, 0.57735); group 9 singleton -> 0.
    result = normalize_rewards(REWARDS, GROUP_IDS, "group", "group")
    assert_close(result, torch.tensor([0.57735, 0.0, -1.15470, 0.57735]), atol=1e-5, rtol=0)
    # Mean only: r - group mean = (1/3, 0, -2/3, 1/3).
    assert_close(
        normalize_rewards(REWARDS, GROUP_IDS, "group", "none"), torch.tensor([1 / 3, 0.0, -2 / 3, 1 / 3])
    )


def test_normalize_group_mean_batch_std_is_lite_ppo():
    # Batch std of the raw rewards 0.816497; group means (2/3, 2, 2/3, 2/3) -> (0.408248, 0, -0.816497, 0.408248).
    result = normalize_rewards(REWARDS, GROUP_IDS, "group", "batch")
    assert_close(result, torch.tensor([0.408248, 0.0, -0.816497, 0.408248]), atol=1e-5, rtol=0)


def test_running_moments_and_running_normalization():
    stats = RunningMoments()
    assert stats.std == 1.0  # nothing seen yet
    # First batch (1, 2, 0, 1): updated first, then used -> same as batch normalization.
    result = normalize_rewards(REWARDS, GROUP_IDS, "running", "running", running_stats=stats)
    assert_close(result, torch.tensor([0.0, 1.224745, -1.224745, 0.0]), atol=1e-5, rtol=0)
    # Second batch (3, 3): all six values (1, 2, 0, 1, 3, 3) have mean 10/6 = 1.666667; squared deviations
    # 0.444444 + 0.111111 + 2.777778 + 0.444444 + 1.777778 + 1.777778 = 7.333333; unbiased var 7.333333/5 = 1.466667,
    # std 1.211060. Normalized: (3 - 1.666667)/1.211060 = 1.100964.
    result = normalize_rewards(
        torch.tensor([3.0, 3.0]), torch.tensor([0, 0]), "running", "running", running_stats=stats
    )
    assert stats.count == 6
    assert stats.mean == pytest.approx(1.666667, rel=1e-6)
    assert stats.std == pytest.approx(1.211060, rel=1e-6)
    assert_close(result, torch.tensor([1.100964, 1.100964]), atol=1e-5, rtol=0)


def test_normalize_rejects_bad_modes():
    with pytest.raises(ValueError, match="valid: none, batch, group, running"):
        normalize_rewards(REWARDS, GROUP_IDS, "groups", "none")
    with pytest.raises(ValueError, match="running_stats"):
        normalize_rewards(REWARDS, GROUP_IDS, "running", "none")


def test_clips():
    assert_close(clip_rewards(torch.tensor([-3.0, 0.5, 2.0]), 1.0), torch.tensor([-1.0, 0.5, 1.0]))
    assert_close(clip_advantages(torch.tensor([[-3.0, 0.0]]), 2.0), torch.tensor([[-2.0, 0.0]]))
    rewards = torch.tensor([5.0])
    assert clip_rewards(rewards, None) is rewards


def test_whiten():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # Tokens (1, 2, 3, 4): mean 2.5, squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5, unbiased var 5/3,
    # std 1.290994 -> (-1.161895, -0.387298, 0.387298, 1.161895).
    expected = torch.tensor([[-1.161895, -0.387298, 0.387298], [1.161895, 0.0, 0.0]])
    assert_close(whiten(values, mask), expected, atol=1e-5, rtol=0)
    assert_close(whiten(values, mask, shift_mean=False), (expected + 2.5) * mask, atol=1e-5, rtol=0)
    # One trained token: nothing to normalize against, returned unchanged (masked).
    single = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert_close(whiten(values, single), values * single)


def test_overlong_reward_penalty():
    # L = 20, C = 5: ramp from 15 to 20. (15 - len)/5 clamped to [-1, 0], times 0.5:
    # 10 -> 0, 15 -> 0, 16 -> -0.1, 18 -> -0.3, 20 -> -0.5, 25 -> -0.5.
    lengths = torch.tensor([10, 15, 16, 18, 20, 25])
    penalty = overlong_reward_penalty(lengths, max_response_length=20, overlong_buffer=5, penalty_factor=0.5)
    assert_close(penalty, torch.tensor([0.0, 0.0, -0.1, -0.3, -0.5, -0.5]))
    with pytest.raises(ValueError):
        overlong_reward_penalty(lengths, 20, 0)


def test_overlong_filter_mask():
    result = overlong_filter_mask(torch.ones(2, 3), torch.tensor([False, True]))
    assert_close(result, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))


def test_difficulty_mask():
    # Group means: g0 = {1, 1} -> 1 (drop), g1 = {0, 1} -> 0.5 (keep), g2 = {0} -> 0 (drop), g3 = {0.5} -> keep.
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.5])
    group_ids = torch.tensor([0, 0, 1, 1, 2, 3])
    keep = difficulty_mask(rewards, group_ids)
    assert keep.tolist() == [False, False, True, True, False, True]
    assert difficulty_mask(rewards, group_ids, low=0.4, high=0.45).tolist() == [False] * 6


@pytest.mark.parametrize("seed", range(5))
def test_difficulty_mask_matches_loop(seed):
    rng = random.Random(seed)
    rewards = [rng.choice([0.0, 1.0]) for _ in range(12)]
    group_ids = [rng.choice([3, 1, 4, 15]) for _ in range(12)]
    expected = []
    for i in range(12):
        members = [rewards[j] for j in range(12) if group_ids[j] == group_ids[i]]
        mean = sum(members) / len(members)
        expected.append(0.0 < mean < 1.0)
    assert difficulty_mask(torch.tensor(rewards), torch.tensor(group_ids)).tolist() == expected
