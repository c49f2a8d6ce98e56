"""Advantage estimators: hand-computed values, and vectorized code against plain python loops."""

import math
import random

import pytest
import torch
from torch.testing import assert_close

from rollflow.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs
from rollflow.algorithms.advantages import discounted_returns, terminal_token_rewards

# Shared batch: group 5 = samples {0, 2, 3} (not contiguous), group 9 = sample {1} (a singleton).
GROUP_IDS = torch.tensor([5, 9, 5, 5])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])


def _expand(per_sample):
    """[B] python list -> [B, T] masked advantages."""
    return torch.tensor(per_sample).unsqueeze(1) * MASK


def _run(name, **kwargs):
    options = kwargs.pop("options", {})
    return ADVANTAGE_ESTIMATORS.get(name)(AdvantageInputs(**kwargs), **options)


def test_grpo_unbiased_std():
    # Group 5 rewards {1, 0, 1}: mean 2/3, deviations (1/3, -2/3, 1/3), squared sum 6/9,
    # unbiased var (6/9)/2 = 1/3, std 0.57735. A = 0.33333/0.57735 = 0.57735 and -0.66667/0.57735 = -1.15470.
    # Group 9 is a single sample: std 0, deviation 0, A = 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    advantages, returns, metrics = _run("grpo", rewards=rewards, mask=MASK, group_ids=GROUP_IDS)
    expected = _expand([0.57735, 0.0, -1.15470, 0.57735])
    assert_close(advantages, expected, atol=1e-5, rtol=0)
    assert_close(returns, advantages)
    assert metrics["zero_std_group_frac"] == 0.5  # group 9 of the two groups


def test_grpo_biased_std_and_no_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    # Biased: var (6/9)/3 = 2/9, std 0.47140; A = 0.33333/0.47140 = 0.70711, -0.66667/0.47140 = -1.41421.
    advantages, _, _ = _run(
        "grpo", rewards=rewards, mask=MASK, group_ids=GROUP_IDS, options={"unbiased_std": False}
    )
    assert_close(advantages, _expand([0.70711, 0.0, -1.41421, 0.70711]), atol=1e-5, rtol=0)
    # No std scaling (= dr_grpo): A = r - mean = 1/3, 0, -2/3, 1/3.
    expected = _expand([1 / 3, 0.0, -2 / 3, 1 / 3])
    advantages, _, _ = _run(
        "grpo", rewards=rewards, mask=MASK, group_ids=GROUP_IDS, options={"scale_by_std": False}
    )
    assert_close(advantages, expected)
    advantages, _, _ = _run("dr_grpo", rewards=rewards, mask=MASK, group_ids=GROUP_IDS)
    assert_close(advantages, expected)


def test_grpo_adds_reward_to_go_of_token_rewards():
    # Row 0 token rewards (-0.1, -0.2, 5.0 on an untrained token): reward-to-go -0.3, -0.2, 0.
    token_rewards = torch.tensor([[-0.1, -0.2, 5.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    advantages, _, _ = _run(
        "grpo", rewards=rewards, mask=MASK, group_ids=GROUP_IDS, token_rewards=token_rewards
    )
    assert_close(advantages[0], torch.tensor([0.57735 - 0.3, 0.57735 - 0.2, 0.0]), atol=1e-5, rtol=0)


def test_rloo():
    # Group 5 rewards {1, 0, 1}: A0 = 1 - (0 + 1)/2 = 0.5, A2 = 0 - (1 + 1)/2 = -1, A3 = 1 - (1 + 0)/2 = 0.5.
    # Group 9 is a singleton: no other sample, A = 0.
    advantages, _, _ = _run(
        "rloo", rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]), mask=MASK, group_ids=GROUP_IDS
    )
    assert_close(advantages, _expand([0.5, 0.0, -1.0, 0.5]))


def test_lite_ppo_group_mean_batch_std():
    # Rewards (1, 2, 0, 1): batch mean 1, deviations (0, 1, -1, 0), unbiased var 2/3, std 0.81650.
    # Group means: group 5 = 2/3, group 9 = 2. A0 = (1/3)/0.81650 = 0.40825, A1 = 0, A2 = -(2/3)/0.81650 = -0.81650.
    advantages, _, _ = _run(
        "lite_ppo", rewards=torch.tensor([1.0, 2.0, 0.0, 1.0]), mask=MASK, group_ids=GROUP_IDS
    )
    assert_close(advantages, _expand([0.40825, 0.0, -0.81650, 0.40825]), atol=1e-5, rtol=0)


def test_reinforce_discounted_returns():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    token_rewards = torch.tensor([[-0.1, -0.1, -0.1], [0.0, -0.5, 9.0]])
    # gamma 0.5. Row 0: r = (-0.1, -0.1, -0.1 + 1) -> G2 = 0.9, G1 = -0.1 + 0.45 = 0.35, G0 = -0.1 + 0.175 = 0.075.
    # Row 1: r = (0, -0.5 + 2, [9 untrained, ignored]) -> G1 = 1.5, G0 = 0.75, G2 = 0.
    advantages, returns, _ = _run(
        "reinforce",
        rewards=torch.tensor([1.0, 2.0]),
        mask=mask,
        group_ids=torch.tensor([0, 1]),
        token_rewards=token_rewards,
        options={"gamma": 0.5},
    )
    assert_close(advantages, torch.tensor([[0.075, 0.35, 0.9], [0.75, 1.5, 0.0]]))
    assert_close(returns, advantages)


def test_reinforce_skips_untrained_tokens_inside_a_row():
    # Multi-turn: token 1 is an env token. r = (0, -, 1); G2 = 1; G0 = 0 + 0.5 * 1 = 0.5 (one discount step).
    advantages, _, _ = _run(
        "reinforce",
        rewards=torch.tensor([1.0]),
        mask=torch.tensor([[1.0, 0.0, 1.0]]),
        group_ids=torch.tensor([0]),
        options={"gamma": 0.5},
    )
    assert_close(advantages, torch.tensor([[0.5, 0.0, 1.0]]))


def test_reinforce_pp():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # Returns (gamma 1): row 0 = (1, 1), row 1 = (0, -). Trained tokens 1, 1, 0: mean 2/3,
    # deviations (1/3, 1/3, -2/3), unbiased var (6/9)/2 = 1/3, std 0.57735 -> A = 0.57735, 0.57735, -1.15470.
    advantages, returns, _ = _run(
        "reinforce_pp", rewards=torch.tensor([1.0, 0.0]), mask=mask, group_ids=torch.tensor([0, 0])
    )
    assert_close(advantages, torch.tensor([[0.57735, 0.57735], [-1.15470, 0.0]]), atol=1e-5, rtol=0)
    assert_close(returns, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    # Group baseline: rewards minus group mean 0.5 -> (0.5, -0.5); returns (0.5, 0.5), (-0.5, -);
    # whitening is shift-invariant, so the advantages are the same.
    advantages, returns, _ = _run(
        "reinforce_pp",
        rewards=torch.tensor([1.0, 0.0]),
        mask=mask,
        group_ids=torch.tensor([0, 0]),
        options={"group_baseline": True},
    )
    assert_close(returns, torch.tensor([[0.5, 0.5], [-0.5, 0.0]]))
    assert_close(advantages, torch.tensor([[0.57735, 0.57735], [-1.15470, 0.0]]), atol=1e-5, rtol=0)


def test_gae():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.2, 0.4], [1.0, 0.0, 7.0]])
    # gamma 0.9, lam 0.8 (gamma * lam = 0.72).
    # Row 0, r = (0, 0, 1):
    #   t2: delta = 1 + 0 - 0.4 = 0.6;            A2 = 0.6
    #   t1: delta = 0 + 0.9*0.4 - 0.2 = 0.16;     A1 = 0.16 + 0.72*0.6 = 0.592
    #   t0: delta = 0 + 0.9*0.2 - 0.5 = -0.32;    A0 = -0.32 + 0.72*0.592 = 0.10624
    #   returns = A + V = (0.60624, 0.792, 1.0)
    # Row 1, r = (0, 2, -), value 7.0 on the pad is ignored:
    #   t1: delta = 2 + 0 - 0 = 2;  A1 = 2
    #   t0: delta = 0 + 0.9*0 - 1 = -1;  A0 = -1 + 0.72*2 = 0.44;  returns = (1.44, 2.0, 0)
    advantages, returns, _ = _run(
        "gae",
        rewards=torch.tensor([1.0, 2.0]),
        mask=mask,
        group_ids=torch.tensor([0, 1]),
        values=values,
        options={"gamma": 0.9, "lam": 0.8},
    )
    assert_close(advantages, torch.tensor([[0.10624, 0.592, 0.6], [0.44, 2.0, 0.0]]))
    assert_close(returns, torch.tensor([[0.60624, 0.792, 1.0], [1.44, 2.0, 0.0]]))


def test_opd():
    # A = teacher - logprobs = (-0.5 + 1, -3 + 2) = (0.5, -1); reverse KL mean = mean(logp - teacher) = 0.25.
    advantages, returns, metrics = _run(
        "opd",
        rewards=torch.tensor([0.0]),
        mask=torch.tensor([[1.0, 1.0, 0.0]]),
        group_ids=torch.tensor([0]),
        logprobs=torch.tensor([[-1.0, -2.0, 0.0]]),
        teacher_logprobs=torch.tensor([[-0.5, -3.0, -9.0]]),
    )
    assert_close(advantages, torch.tensor([[0.5, -1.0, 0.0]]))
    assert_close(returns, advantages)
    assert metrics["reverse_kl_mean"] == pytest.approx(0.25)


@pytest.mark.parametrize(("name", "field"), [("gae", "values"), ("opd", "logprobs")])
def test_missing_inputs_raise(name, field):
    with pytest.raises(ValueError, match=field):
        _run(name, rewards=torch.zeros(1), mask=torch.ones(1, 2), group_ids=torch.zeros(1, dtype=torch.long))


# ---- vectorized vs plain python loops -------------------------------------------------------------------


def _random_case(seed, batch=9, length=7):
    rng = random.Random(seed)
    mask = [[1.0 if rng.random() < 0.8 else 0.0 for _ in range(length)] for _ in range(batch)]
    for row in mask:  # right padding after a random length
        cut = rng.randint(0, length)
        for t in range(cut, length):
            row[t] = 0.0
    rewards = [rng.choice([0.0, 1.0, 0.5, -1.0]) for _ in range(batch)]
    token_rewards = [[rng.uniform(-0.2, 0.2) for _ in range(length)] for _ in range(batch)]
    values = [[rng.uniform(-1, 1) for _ in range(length)] for _ in range(batch)]
    group_ids = [rng.choice([11, 4, 7, 2]) for _ in range(batch)]
    return mask, rewards, token_rewards, values, group_ids


def _loop_token_rewards(mask_row, reward, token_row):
    r = [tr * m for tr, m in zip(token_row, mask_row)]
    trained = [t for t, m in enumerate(mask_row) if m > 0]
    if trained:
        r[trained[-1]] += reward
    return r


def _loop_returns(mask_row, r, gamma):
    out = [0.0] * len(r)
    running = 0.0
    for t in reversed(range(len(r))):
        if mask_row[t] > 0:
            running = r[t] + gamma * running
            out[t] = running
    return out


def _loop_gae(mask_row, r, values_row, gamma, lam):
    advantages = [0.0] * len(r)
    next_value, next_advantage = 0.0, 0.0
    for t in reversed(range(len(r))):
        if mask_row[t] == 0:
            continue
        delta = r[t] + gamma * next_value - values_row[t]
        next_advantage = delta + gamma * lam * next_advantage
        next_value = values_row[t]
        advantages[t] = next_advantage
    return advantages


@pytest.mark.parametrize("gamma", [0.9, 1.0])  # 1.0 takes the cumulative-sum path
@pytest.mark.parametrize("seed", range(5))
def test_returns_and_gae_match_loops(seed, gamma):
    mask, rewards, token_rewards, values, group_ids = _random_case(seed)
    lam = 0.7
    inputs = AdvantageInputs(
        rewards=torch.tensor(rewards, dtype=torch.float64),
        mask=torch.tensor(mask, dtype=torch.float64),
        group_ids=torch.tensor(group_ids),
        token_rewards=torch.tensor(token_rewards, dtype=torch.float64),
        values=torch.tensor(values, dtype=torch.float64),
    )
    expected_returns, expected_advantages, expected_gae_returns = [], [], []
    for b in range(len(mask)):
        r = _loop_token_rewards(mask[b], rewards[b], token_rewards[b])
        expected_returns.append(_loop_returns(mask[b], r, gamma))
        advantages = _loop_gae(mask[b], r, values[b], gamma, lam)
        expected_advantages.append(advantages)
        expected_gae_returns.append([(a + v) * m for a, v, m in zip(advantages, values[b], mask[b])])
    dense = terminal_token_rewards(inputs.rewards, inputs.mask, inputs.token_rewards)
    assert_close(
        discounted_returns(dense, inputs.mask, gamma), torch.tensor(expected_returns, dtype=torch.float64)
    )
    returns, _, _ = ADVANTAGE_ESTIMATORS.get("reinforce")(inputs, gamma=gamma)
    assert_close(returns, torch.tensor(expected_returns, dtype=torch.float64))
    advantages, gae_returns, _ = ADVANTAGE_ESTIMATORS.get("gae")(inputs, gamma=gamma, lam=lam)
    assert_close(advantages, torch.tensor(expected_advantages, dtype=torch.float64))
    assert_close(gae_returns, torch.tensor(expected_gae_returns, dtype=torch.float64))


@pytest.mark.parametrize("seed", range(5))
def test_group_estimators_match_loops(seed):
    mask, rewards, _, _, group_ids = _random_case(seed)
    groups = {g: [i for i, gi in enumerate(group_ids) if gi == g] for g in set(group_ids)}
    grpo_expected, rloo_expected, lite_expected = [], [], []
    batch_mean = sum(rewards) / len(rewards)
    batch_std = math.sqrt(sum((r - batch_mean) ** 2 for r in rewards) / (len(rewards) - 1))
    for i, reward in enumerate(rewards):
        members = [rewards[j] for j in groups[group_ids[i]]]
        n = len(members)
        mean = sum(members) / n
        std = math.sqrt(sum((m - mean) ** 2 for m in members) / (n - 1)) if n > 1 else 0.0
        grpo_expected.append((reward - mean) / (std + 1e-6))
        rloo_expected.append(reward - (sum(members) - reward) / (n - 1) if n > 1 else 0.0)
        lite_expected.append((reward - mean) / (batch_std + 1e-6))
    inputs = AdvantageInputs(
        rewards=torch.tensor(rewards, dtype=torch.float64),
        mask=torch.tensor(mask, dtype=torch.float64),
        group_ids=torch.tensor(group_ids),
    )
    mask_tensor = torch.tensor(mask, dtype=torch.float64)
    for name, expected in (("grpo", grpo_expected), ("rloo", rloo_expected), ("lite_ppo", lite_expected)):
        advantages, _, _ = ADVANTAGE_ESTIMATORS.get(name)(inputs)
        expected_tensor = torch.tensor(expected, dtype=torch.float64).unsqueeze(1) * mask_tensor
        assert_close(advantages, expected_tensor.to(advantages.dtype), atol=1e-5, rtol=1e-5, msg=name)
