"""Reward normalization, clipping, whitening, overlong shaping/filtering and the difficulty mask."""

import random
import statistics

import pytest
import torch
from torch.testing import assert_close

from rollflow.algorithms import (
    RunningMoments,
    clip_advantages,
    clip_rewards,
    difficulty_mask,
    normalize_rewards,
    normalize_rewards_by_domain,
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


# Two domains interleaved: domain 0 = samples {0, 2} with rewards (1, 3), domain 1 = samples {1, 3, 4} with
# rewards (0, 10, 20).
DOMAIN_REWARDS = torch.tensor([1.0, 0.0, 3.0, 10.0, 20.0])
DOMAIN_GROUPS = torch.tensor([0, 1, 0, 2, 2])
DOMAIN_IDS = torch.tensor([0, 1, 0, 1, 1])


def test_normalize_by_domain_takes_each_domains_batch_moments():
    # domain 0: mean 2, unbiased std sqrt(2) = 1.414214 -> (-0.707107, 0.707107);
    # domain 1: mean 10, unbiased var (100 + 0 + 100) / 2 = 100, std 10 -> (-1, 0, 1).
    result = normalize_rewards_by_domain(DOMAIN_REWARDS, DOMAIN_GROUPS, DOMAIN_IDS, "batch", "batch")
    assert_close(result, torch.tensor([-0.707107, -1.0, 0.707107, 0.0, 1.0]), atol=1e-5, rtol=0)
    # mean only: (1 - 2, 0 - 10, 3 - 2, 10 - 10, 20 - 10)
    assert_close(normalize_rewards_by_domain(DOMAIN_REWARDS, DOMAIN_GROUPS, DOMAIN_IDS, "batch", "none"),
                 torch.tensor([-1.0, -10.0, 1.0, 0.0, 10.0]))
    # group scopes are within one domain already: the same as without domains
    assert_close(normalize_rewards_by_domain(DOMAIN_REWARDS, DOMAIN_GROUPS, DOMAIN_IDS, "group", "group"),
                 normalize_rewards(DOMAIN_REWARDS, DOMAIN_GROUPS, "group", "group"))
    # one domain: normalize_rewards itself
    one_domain = torch.zeros(4, dtype=torch.long)
    assert_close(normalize_rewards_by_domain(REWARDS, GROUP_IDS, one_domain, "batch", "batch"),
                 normalize_rewards(REWARDS, GROUP_IDS, "batch", "batch"))


def test_normalize_by_domain_keeps_running_moments_per_domain():
    stats = [RunningMoments(), RunningMoments()]
    first = normalize_rewards_by_domain(DOMAIN_REWARDS, DOMAIN_GROUPS, DOMAIN_IDS, "running", "running", stats)
    assert_close(first, torch.tensor([-0.707107, -1.0, 0.707107, 0.0, 1.0]), atol=1e-5, rtol=0)  # = batch
    # second batch: 5 of domain 0, 30 of domain 1.
    # domain 0 has seen (1, 3, 5): mean 3, squared deviations 4 + 0 + 4 = 8, unbiased std 2 -> (5 - 3) / 2 = 1.
    # domain 1 has seen (0, 10, 20, 30): mean 15, squared deviations 225 + 25 + 25 + 225 = 500, unbiased var
    # 500 / 3 = 166.6667, std 12.909944 -> (30 - 15) / 12.909944 = 1.161895.
    second = normalize_rewards_by_domain(torch.tensor([5.0, 30.0]), torch.tensor([3, 4]), torch.tensor([0, 1]),
                                         "running", "running", stats)
    assert_close(second, torch.tensor([1.0, 1.161895]), atol=1e-5, rtol=0)
    assert (stats[0].count, stats[0].mean, stats[1].count, stats[1].mean) == (3, 3.0, 4, 15.0)
    # a domain with no sample in the batch keeps its moments
    normalize_rewards_by_domain(torch.tensor([7.0]), torch.tensor([0]), torch.tensor([1]), "running", "running",
                                stats)
    assert stats[0].count == 3 and stats[1].count == 5


def test_normalize_by_domain_matches_a_plain_loop():
    rng = random.Random(0)
    for _ in range(20):
        size = rng.randint(2, 12)
        rewards = [rng.uniform(-2, 5) for _ in range(size)]
        domains = [rng.randint(0, 2) for _ in range(size)]
        expected = []
        for reward, domain in zip(rewards, domains):
            same = [r for r, d in zip(rewards, domains) if d == domain]
            std = statistics.stdev(same) if len(same) > 1 else 0.0  # one value: no spread
            expected.append((reward - statistics.fmean(same)) / (std + 1e-6))
        result = normalize_rewards_by_domain(torch.tensor(rewards, dtype=torch.float64), torch.arange(size),
                                             torch.tensor(domains), "batch", "batch")
        assert_close(result, torch.tensor(expected, dtype=torch.float64), atol=1e-9, rtol=1e-9)
