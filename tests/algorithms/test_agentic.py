"""Agentic advantages (StarPO, GiGPO, step REINFORCE, discounted step returns) and the ipa_chunk turn-level
loss: hand-computed values, vectorized code against plain loops, gradients, and equivalence with gspo."""

import math
import random

import pytest
import torch
from torch.testing import assert_close

from rollflow.algorithms import (
    AGENTIC_ADVANTAGES,
    POLICY_LOSSES,
    AgenticAdvantageInputs,
    PolicyLossInputs,
    aggregate_loss,
    check_hyperparams,
    discounted_step_returns,
    episode_group_advantages,
    gigpo_advantages,
    step_reinforce_advantages,
)

SQRT_HALF = 1.0 / math.sqrt(
    2.0
)  # 0.70711: (x - mean) / std for either member of a group of two (unbiased std)


# ---- StarPO: trajectory-level group advantages -------------------------------------------------------------

# Episodes (one row each): group 7 = rows {0, 2}, group 4 = rows {1, 4, 5}, group 9 = row {3} (a singleton).
RETURNS = torch.tensor([3.0, 1.0, 1.0, 5.0, 4.0, 1.0])
GROUPS = torch.tensor([7, 4, 7, 9, 4, 4])


def test_episode_group_advantages_unbiased_std():
    # Group 7 returns {3, 1}: mean 2, deviations (1, -1), unbiased var 2/1, std 1.41421 -> A = +-0.70711.
    # Group 4 returns {1, 4, 1}: mean 2, deviations (-1, 2, -1), squares 6, unbiased var 3, std 1.73205
    #   -> A = -0.57735, 1.15470, -0.57735.
    # Group 9 has one episode: deviation 0, std 0 -> A = 0.
    advantages = episode_group_advantages(RETURNS, GROUPS)
    expected = torch.tensor([SQRT_HALF, -0.57735, -SQRT_HALF, 0.0, 1.15470, -0.57735])
    assert_close(advantages, expected, atol=1e-5, rtol=0)


def test_episode_group_advantages_mean_centering_only():
    # REINFORCE with the group-mean baseline: R - mean = (3 - 2, 1 - 2, 1 - 2, 0, 4 - 2, 1 - 2).
    advantages = episode_group_advantages(RETURNS, GROUPS, normalize_std=False)
    assert_close(advantages, torch.tensor([1.0, -1.0, -1.0, 0.0, 2.0, -1.0]))


def test_starpo_registry_on_trajectory_rows():
    inputs = AgenticAdvantageInputs(episode_returns=RETURNS, group_ids=GROUPS, episode_ids=torch.arange(6))
    advantages, metrics = AGENTIC_ADVANTAGES.get("starpo")(inputs)
    assert_close(advantages, episode_group_advantages(RETURNS, GROUPS))
    assert metrics["zero_std_group_frac"] == pytest.approx(1 / 3)  # group 9 of the three groups
    advantages, _ = AGENTIC_ADVANTAGES.get("starpo")(inputs, normalize_std=False)
    assert_close(advantages, torch.tensor([1.0, -1.0, -1.0, 0.0, 2.0, -1.0]))


def test_starpo_on_step_rows_counts_each_episode_once():
    # Step-wise rows: episode 10 (return 1) has 3 steps, episode 11 (return 0) has 1, both in group 0.
    # Over distinct episodes {1, 0}: mean 0.5, unbiased std 0.70711 -> A = +-0.70711 on every step.
    # Had each step counted, {1, 1, 1, 0}: mean 0.75, std 0.5 -> A = 0.5 and -1.5 (the long episode weighs more).
    inputs = AgenticAdvantageInputs(
        episode_returns=torch.tensor([1.0, 1.0, 0.0, 1.0]),
        group_ids=torch.tensor([0, 0, 0, 0]),
        episode_ids=torch.tensor([10, 10, 11, 10]),
    )
    advantages, _ = AGENTIC_ADVANTAGES.get("starpo")(inputs)
    assert_close(advantages, torch.tensor([SQRT_HALF, SQRT_HALF, -SQRT_HALF, SQRT_HALF]), atol=1e-5, rtol=0)


def test_episode_rows_must_agree():
    inputs = AgenticAdvantageInputs(
        episode_returns=torch.tensor([1.0, 0.5]),
        group_ids=torch.tensor([0, 0]),
        episode_ids=torch.tensor([3, 3]),
    )
    with pytest.raises(ValueError, match="episode_returns differs"):
        AGENTIC_ADVANTAGES.get("starpo")(inputs)
    inputs.episode_returns = torch.tensor([1.0, 1.0])
    inputs.group_ids = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="group_ids differs"):
        AGENTIC_ADVANTAGES.get("starpo")(inputs)


# ---- Discounted step returns -------------------------------------------------------------------------------


def test_discounted_step_returns_by_hand():
    # Episode 3, steps 0..2, rewards (1, 0, 2), gamma 0.5: G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5.
    # Episode 8, steps 0..1, rewards (-1, 4): G1 = 4, G0 = -1 + 0.5*4 = 1.
    # Rows arrive shuffled.
    episode_ids = torch.tensor([8, 3, 3, 8, 3])
    step_index = torch.tensor([1, 2, 0, 0, 1])
    rewards = torch.tensor([4.0, 2.0, 1.0, -1.0, 0.0])
    returns = discounted_step_returns(rewards, episode_ids, step_index, gamma=0.5)
    assert_close(returns, torch.tensor([4.0, 2.0, 1.5, 1.0, 1.0]))


def test_discounted_step_returns_missing_step_counts_as_a_step():
    # Steps 0 and 2 present (1 dropped), rewards (1, 4), gamma 0.5: G2 = 4, G0 = 1 + 0.5^2 * 4 = 2.
    returns = discounted_step_returns(
        torch.tensor([1.0, 4.0]), torch.tensor([0, 0]), torch.tensor([0, 2]), 0.5
    )
    assert_close(returns, torch.tensor([2.0, 4.0]))


def test_discounted_step_returns_rejects_repeated_or_negative_steps():
    with pytest.raises(ValueError, match="share a step_index"):
        discounted_step_returns(torch.ones(2), torch.tensor([0, 0]), torch.tensor([1, 1]), 0.9)
    with pytest.raises(ValueError, match=">= 0"):
        discounted_step_returns(torch.ones(1), torch.tensor([0]), torch.tensor([-1]), 0.9)
    assert (
        discounted_step_returns(
            torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 0.9
        ).numel()
        == 0
    )


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_discounted_step_returns_matches_plain_loop(gamma):
    rng = random.Random(0)
    rows = [(episode, step) for episode in rng.sample(range(100), 12) for step in range(rng.randint(1, 7))]
    rng.shuffle(rows)
    rewards = [rng.uniform(-1.0, 1.0) for _ in rows]
    expected = []
    for episode, step in rows:  # G_t = sum over later steps k of the same episode of gamma^(k - t) r_k
        expected.append(
            sum(gamma ** (k - step) * r for (e, k), r in zip(rows, rewards) if e == episode and k >= step)
        )
    returns = discounted_step_returns(
        torch.tensor(rewards, dtype=torch.float64),
        torch.tensor([episode for episode, _ in rows]),
        torch.tensor([step for _, step in rows]),
        gamma,
    )
    assert_close(returns, torch.tensor(expected, dtype=torch.float64))


# ---- GiGPO ---------------------------------------------------------------------------------------------------

# Step rows. Env group 0: episode 0 (return 1, 3 steps), episode 1 (return 0, 1 step); both start from
# anchor state 100. Env group 1: episode 2 (return 2, anchors 100 then 103), episode 3 (return 0, anchor 103).
# Anchor 100 in group 1 is a different state group from anchor 100 in group 0.
#   row:        0     1     2     3     4     5     6
EPISODES = torch.tensor([0, 0, 0, 1, 2, 2, 3])
STEP_GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1])
ANCHORS = torch.tensor([100, 101, 102, 100, 100, 103, 103])
EPISODE_RETURNS = torch.tensor([1.0, 1.0, 1.0, 0.0, 2.0, 2.0, 0.0])
STEP_RETURNS = torch.tensor([0.81, 0.9, 1.0, 0.0, 1.8, 2.0, 0.0])


def _gigpo(**options):
    return gigpo_advantages(EPISODE_RETURNS, STEP_GROUPS, EPISODES, ANCHORS, STEP_RETURNS, **options)


def test_gigpo_by_hand():
    # Episode level, over distinct episodes: group 0 {1, 0} -> +-0.70711, group 1 {2, 0} -> +-0.70711.
    #   A_episode = (.70711, .70711, .70711, -.70711, .70711, .70711, -.70711).
    # Had every step counted, group 0 would be {1, 1, 1, 0}: mean .75, std .5 -> .5 and -1.5.
    # Step level, anchor groups (group, anchor): (0,100) = rows {0, 3}, returns {0.81, 0} -> +-0.70711;
    #   (0,101), (0,102), (1,100) are single steps -> 0; (1,103) = rows {5, 6}, returns {2, 0} -> +-0.70711.
    #   A_step = (.70711, 0, 0, -.70711, 0, .70711, -.70711).
    advantages, metrics = _gigpo()
    s = SQRT_HALF
    expected = torch.tensor([2 * s, s, s, -2 * s, s, 2 * s, -2 * s])
    assert_close(advantages, expected, atol=1e-5, rtol=0)
    # 5 anchor groups of sizes (2, 1, 1, 1, 2): mean size 7/5; rows in groups of 2: {0, 3, 5, 6} = 4/7.
    assert metrics["anchor_group_size_mean"] == pytest.approx(7 / 5)
    assert metrics["anchor_group_nontrivial_frac"] == pytest.approx(4 / 7)


def test_gigpo_step_weight_scales_the_step_term():
    # A = A_episode + 0.5 * A_step: 0.70711 * (1.5, 1, 1, -1.5, 1, 1.5, -1.5).
    advantages, _ = _gigpo(step_weight=0.5)
    expected = SQRT_HALF * torch.tensor([1.5, 1.0, 1.0, -1.5, 1.0, 1.5, -1.5])
    assert_close(advantages, expected, atol=1e-5, rtol=0)
    advantages, _ = _gigpo(step_weight=0.0)  # episode term only = StarPO on the step rows
    episode_only, _ = AGENTIC_ADVANTAGES.get("starpo")(
        AgenticAdvantageInputs(EPISODE_RETURNS, STEP_GROUPS, EPISODES)
    )
    assert_close(advantages, episode_only)


def test_gigpo_mean_centering_only():
    # Episode level: group 0 {1, 0} mean .5 -> (.5, -.5); group 1 {2, 0} mean 1 -> (1, -1).
    # Step level: (0,100) {0.81, 0} mean .405 -> (+.405, -.405); (1,103) {2, 0} mean 1 -> (+1, -1); others 0.
    # A = (.5 + .405, .5, .5, -.5 - .405, 1, 1 + 1, -1 - 1).
    advantages, _ = _gigpo(normalize_std=False)
    assert_close(advantages, torch.tensor([0.905, 0.5, 0.5, -0.905, 1.0, 2.0, -2.0]))


def test_gigpo_single_step_anchor_groups_get_no_step_advantage():
    # Every anchor distinct: A_step = 0 everywhere, so A = A_episode for any step_weight.
    advantages, metrics = gigpo_advantages(
        EPISODE_RETURNS, STEP_GROUPS, EPISODES, torch.arange(7), STEP_RETURNS, step_weight=3.0
    )
    s = SQRT_HALF
    assert_close(advantages, torch.tensor([s, s, s, -s, s, s, -s]), atol=1e-5, rtol=0)
    assert metrics["anchor_group_nontrivial_frac"] == 0.0
    assert metrics["anchor_group_size_mean"] == 1.0


def test_gigpo_registry():
    inputs = AgenticAdvantageInputs(EPISODE_RETURNS, STEP_GROUPS, EPISODES, ANCHORS, STEP_RETURNS)
    advantages, metrics = AGENTIC_ADVANTAGES.get("gigpo")(inputs, step_weight=0.5)
    assert_close(advantages, _gigpo(step_weight=0.5)[0])
    assert metrics["anchor_group_size_mean"] == pytest.approx(7 / 5)
    assert metrics["advantages_max"] == pytest.approx(1.5 * SQRT_HALF, abs=1e-5)
    with pytest.raises(ValueError, match="'gigpo' needs AgenticAdvantageInputs.anchor_ids"):
        AGENTIC_ADVANTAGES.get("gigpo")(AgenticAdvantageInputs(EPISODE_RETURNS, STEP_GROUPS, EPISODES))


# ---- Step-level REINFORCE -----------------------------------------------------------------------------------


def test_step_reinforce():
    # Group 0 step returns (0.81, 0.9, 1.0, 0): mean 2.71/4 = 0.6775 -> (0.1325, 0.2225, 0.3225, -0.6775).
    # Group 1 step returns (1.8, 2.0, 0): mean 3.8/3 = 1.26667 -> (0.53333, 0.73333, -1.26667).
    advantages = step_reinforce_advantages(STEP_RETURNS, STEP_GROUPS)
    expected = torch.tensor([0.1325, 0.2225, 0.3225, -0.6775, 0.53333, 0.73333, -1.26667])
    assert_close(advantages, expected, atol=1e-5, rtol=0)
    assert_close(step_reinforce_advantages(STEP_RETURNS, STEP_GROUPS, baseline="none"), STEP_RETURNS)
    with pytest.raises(ValueError, match="valid: group_mean, none"):
        step_reinforce_advantages(STEP_RETURNS, STEP_GROUPS, baseline="batch_mean")
    inputs = AgenticAdvantageInputs(EPISODE_RETURNS, STEP_GROUPS, EPISODES, step_returns=STEP_RETURNS)
    registered, _ = AGENTIC_ADVANTAGES.get("step_reinforce")(inputs)
    assert_close(registered, advantages)
    with pytest.raises(ValueError, match="needs AgenticAdvantageInputs.step_returns"):
        AGENTIC_ADVANTAGES.get("step_reinforce")(
            AgenticAdvantageInputs(EPISODE_RETURNS, STEP_GROUPS, EPISODES)
        )


# ---- Registry and options ------------------------------------------------------------------------------------


def test_registry_names_and_options():
    assert {"gigpo", "starpo", "step_reinforce"} <= set(AGENTIC_ADVANTAGES.names())
    check_hyperparams(AGENTIC_ADVANTAGES.get("starpo"), {"normalize_std": False, "eps": 1e-8})
    check_hyperparams(AGENTIC_ADVANTAGES.get("gigpo"), {"step_weight": 0.5})
    with pytest.raises(ValueError) as error:
        check_hyperparams(AGENTIC_ADVANTAGES.get("starpo"), {"normalise_std": False})
    assert str(error.value) == (
        "unknown option 'normalise_std' for agentic advantage estimator 'starpo'; "
        "did you mean 'normalize_std'? valid: eps, normalize_std"
    )
    with pytest.raises(
        ValueError, match="unknown option 'gamma' for agentic advantage estimator 'step_reinforce'"
    ):
        check_hyperparams(AGENTIC_ADVANTAGES.get("step_reinforce"), {"gamma": 0.9})


@pytest.mark.parametrize("name", AGENTIC_ADVANTAGES.names())
def test_agentic_contract(name):
    # Step rows, shuffled, several groups; every estimator returns finite [S] advantages and float metrics.
    generator = torch.Generator().manual_seed(1)
    episode_ids = torch.tensor([4, 4, 1, 7, 7, 7, 2, 9])
    group_ids = torch.tensor([0, 0, 0, 5, 5, 5, 5, 8])  # group 8: one episode of one step
    episode_returns = torch.tensor([1.0, 1.0, 0.0, 2.0, 2.0, 2.0, -1.0, 3.0])
    inputs = AgenticAdvantageInputs(
        episode_returns=episode_returns,
        group_ids=group_ids,
        episode_ids=episode_ids,
        anchor_ids=torch.tensor([0, 1, 0, 0, 2, 3, 0, 0]),
        step_returns=torch.rand(8, generator=generator),
    )
    advantages, metrics = AGENTIC_ADVANTAGES.get(name)(inputs)
    assert advantages.shape == (8,) and torch.isfinite(advantages).all()
    assert advantages[7] == 0.0  # group 8 is one episode of one step: nothing to compare it with
    assert all(isinstance(value, float) and math.isfinite(value) for value in metrics.values())


# ---- ipa_chunk: one importance ratio per turn ---------------------------------------------------------------


def _ipa_hand_inputs():
    # Row 0: turn 0 = tokens 0-1, an env token at 2 (segment -1, mask 0), turn 1 = tokens 3-4, padding at 5.
    # Row 1: one turn = tokens 0-2, padding after. Padding logprobs are NaN: they must not leak.
    nan = float("nan")
    logprobs = torch.tensor(
        [[0.1, -0.3, nan, 0.2, 0.4, nan], [0.5, 0.5, 0.5, nan, nan, nan]], requires_grad=True
    )
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]])
    segment_ids = torch.tensor([[0, 0, -1, 1, 1, -1], [0, 0, 0, -1, -1, -1]])
    advantages = torch.tensor([[2.0, 2.0, 0.0, 1.0, 1.0, 0.0], [-1.0, -1.0, -1.0, 0.0, 0.0, 0.0]])
    return PolicyLossInputs(logprobs, torch.zeros(2, 6), advantages, mask, segment_ids=segment_ids)


def test_ipa_chunk_value_by_hand():
    # Row 0 turn 0: log ratios (0.1, -0.3), mean -0.1, r = exp(-0.1) = 0.904837, A = 2, inside [0.8, 1.2]:
    #   loss = -2 * 0.904837 = -1.809675 on both tokens.
    # Row 0 turn 1: log ratios (0.2, 0.4), mean 0.3, r = 1.349859, A = 1 > 0 and r > 1.2: clipped, loss -1.2.
    # Row 1 turn 0: log ratios all 0.5, r = 1.648721, A = -1: max(1.648721, 1.2) = 1.648721 (PPO does not clip a
    #   negative advantage from above).
    inputs = _ipa_hand_inputs()
    loss, metrics = POLICY_LOSSES.get("ipa_chunk")(inputs, clip_low=0.2, clip_high=0.2)
    expected = torch.tensor([
        [-1.809675, -1.809675, 0.0, -1.2, -1.2, 0.0],
        [1.648721, 1.648721, 1.648721, 0.0, 0.0, 0.0],
    ])  # fmt: skip
    assert_close(loss.detach(), expected, atol=1e-5, rtol=0)
    assert metrics["clip_frac"] == pytest.approx(1 / 3)  # one turn of three
    assert metrics["turn_ratio_mean"] == pytest.approx((0.904837 + 1.349859 + 1.648721) / 3, rel=1e-5)


def test_ipa_chunk_gradient_by_hand():
    # Averaging the loss over each turn's tokens: d/d logp_t = -A_c * r_c / |c| for an unclipped turn, 0 if clipped.
    # Row 0 turn 0: -2 * 0.904837 / 2 = -0.904837 on tokens 0, 1. Turn 1 is clipped: 0 on tokens 3, 4.
    # Row 1: -(-1) * 1.648721 / 3 = 0.549574 on tokens 0-2. Env and padding tokens: 0 (finite despite NaN).
    inputs = _ipa_hand_inputs()
    loss, _ = POLICY_LOSSES.get("ipa_chunk")(inputs, clip_low=0.2, clip_high=0.2)
    turn_sizes = torch.tensor([[2.0, 2.0, 1.0, 2.0, 2.0, 1.0], [3.0, 3.0, 3.0, 1.0, 1.0, 1.0]])
    (loss / turn_sizes).sum().backward()
    expected = torch.tensor([
        [-0.904837, -0.904837, 0.0, 0.0, 0.0, 0.0],
        [0.549574, 0.549574, 0.549574, 0.0, 0.0, 0.0],
    ])  # fmt: skip
    assert_close(inputs.logprobs.grad, expected, atol=1e-6, rtol=0)


def test_ipa_chunk_matches_turn_level_objective_loop():
    # Unclipped: the turn-mean of the per-token loss has the gradient of -sum_c A_c * exp(mean_{t in c} log ratio),
    # the turn ratio NOT detached, written as a plain loop over turns.
    generator = torch.Generator().manual_seed(5)
    segment_ids = torch.tensor([[0, 0, -1, 1, 1, 1, -1, 2], [0, 0, 0, -1, -1, 1, -1, -1]])
    mask = (segment_ids >= 0).float()
    old = -torch.rand(2, 8, generator=generator)
    base = old + 0.01 * torch.randn(2, 8, generator=generator)
    turn_advantages = {(0, 0): 0.5, (0, 1): -1.0, (0, 2): 2.0, (1, 0): 1.5, (1, 1): -0.3}
    advantages = torch.zeros(2, 8)
    for (row, turn), value in turn_advantages.items():
        advantages[row][segment_ids[row] == turn] = value
    logprobs = base.clone().requires_grad_()
    loss, metrics = POLICY_LOSSES.get("ipa_chunk")(
        PolicyLossInputs(logprobs, old, advantages, mask, segment_ids=segment_ids),
        clip_low=0.5,
        clip_high=0.5,
    )
    assert metrics["clip_frac"] == 0.0
    turn_mean_loss = 0.0
    for row, turn in turn_advantages:
        tokens = segment_ids[row] == turn
        turn_mean_loss = turn_mean_loss + loss[row][tokens].mean()
    turn_mean_loss.backward()
    reference = base.clone().requires_grad_()
    objective = 0.0
    for (row, turn), value in turn_advantages.items():
        tokens = segment_ids[row] == turn
        objective = objective - value * (reference[row][tokens] - old[row][tokens]).mean().exp()
    objective.backward()
    assert_close(logprobs.grad, reference.grad * mask, atol=1e-6, rtol=1e-5)


def test_ipa_chunk_with_one_turn_is_gspo():
    # One turn spanning each row's trained tokens: the same loss, gradient and clip fraction as gspo.
    generator = torch.Generator().manual_seed(2)
    mask = torch.tensor(
        [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    )
    old = -torch.rand(4, 4, generator=generator)
    base = old + 0.3 * torch.randn(4, 4, generator=generator)  # large enough that some rows clip
    advantages = torch.tensor([0.5, -1.0, 2.0, 1.0]).unsqueeze(1) * mask
    results = {}
    for name, segment_ids in (("gspo", None), ("ipa_chunk", torch.where(mask > 0, 0, -1))):
        logprobs = base.clone().requires_grad_()
        inputs = PolicyLossInputs(logprobs, old, advantages, mask, segment_ids=segment_ids)
        loss, metrics = POLICY_LOSSES.get(name)(inputs, clip_low=0.2, clip_high=0.2)
        aggregate_loss(loss, mask, "seq_mean_token_mean").backward()
        results[name] = (loss.detach(), logprobs.grad, metrics)
    gspo_loss, gspo_grad, gspo_metrics = results["gspo"]
    ipa_loss, ipa_grad, ipa_metrics = results["ipa_chunk"]
    assert_close(ipa_loss, gspo_loss)
    assert_close(ipa_grad, gspo_grad)
    assert 0.0 < gspo_metrics["clip_frac"] < 1.0  # the comparison covers clipped and unclipped rows
    assert ipa_metrics["clip_frac"] == pytest.approx(gspo_metrics["clip_frac"])
    assert ipa_metrics["turn_ratio_mean"] == pytest.approx(gspo_metrics["seq_ratio_mean"])


def test_ipa_chunk_needs_segment_ids():
    inputs = _ipa_hand_inputs()
    inputs.segment_ids = None
    with pytest.raises(ValueError, match="needs PolicyLossInputs.segment_ids"):
        POLICY_LOSSES.get("ipa_chunk")(inputs)
    inputs = _ipa_hand_inputs()
    inputs.segment_ids = inputs.segment_ids.clone()
    inputs.segment_ids[0, 0] = -1  # a trained token outside any turn
    with pytest.raises(ValueError, match="has segment_ids -1"):
        POLICY_LOSSES.get("ipa_chunk")(inputs)
    with pytest.raises(ValueError, match="unknown option 'clip'"):
        check_hyperparams(POLICY_LOSSES.get("ipa_chunk"), {"clip": 0.2})
