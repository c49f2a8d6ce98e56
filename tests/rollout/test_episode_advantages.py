"""Multi-turn samples as typed fields (`episode`, `turn_spans`), the tensors `collate` makes of them, and the
agentic advantage stage on the `Batch` alone: each turn's advantage lands on that turn's tokens."""

from __future__ import annotations

import pytest
import torch

from rollflow.algorithms import AGENTIC_ADVANTAGES, AgenticAdvantageInputs, discounted_step_returns
from rollflow.config.agentic import AgenticConfig
from rollflow.data.sample import EpisodeInfo, EpisodeRow, Sample, TurnSpan, collate
from rollflow.rollout.episode_advantages import EpisodeAdvantages

PAD = 0


def _trajectory(slot: int, group: int, turns: list[tuple[int, int]], rewards: list[float], anchors: list[str],
                length: int) -> Sample:
    """One trajectory sample: model turns at `turns` ([start, end) of the response), observations between."""
    mask = [0] * length
    for start, end in turns:
        mask[start:end] = [1] * (end - start)
    return Sample(prompt_ids=[7, 8], response_ids=list(range(1, length + 1)), loss_mask=mask, group_id=group,
                  reward=sum(rewards), step_rewards=rewards, episode=EpisodeInfo((group, slot), tuple(anchors)),
                  turn_spans=[TurnSpan(number, start, end) for number, (start, end) in enumerate(turns)])


def test_collate_makes_the_turn_tensors_and_the_batch_s_episodes():
    first = _trajectory(0, 0, [(0, 2), (4, 5)], [0.0, 1.0], ["a", "b"], 5)
    second = _trajectory(1, 0, [(0, 1)], [0.5], ["a"], 1)
    batch = collate([first, second], PAD)
    assert batch.extras["segment_ids"].tolist() == [[0, 0, -1, -1, 1], [0, -1, -1, -1, -1]]
    assert batch.extras["turn_ids"].tolist() == [[0, 0, -1, -1, 1], [0, -1, -1, -1, -1]]
    assert batch.extras["episode_index"].tolist() == [0, 1]
    assert batch.episodes == (EpisodeRow((0, 0), 0, 1.0, (0.0, 1.0), ("a", "b")),
                              EpisodeRow((0, 1), 0, 0.5, (0.5,), ("a",)))
    assert batch.select(torch.tensor([1])).episodes == batch.episodes  # indices into it stay valid
    assert "segment_ids" not in collate([Sample(prompt_ids=[1], response_ids=[2])], PAD).extras  # single-turn
    with pytest.raises(ValueError, match="single-turn samples beside multi-turn"):
        collate([first, Sample(prompt_ids=[1], response_ids=[2])], PAD)


def _step_samples(slot: int, group: int, turn_lengths: list[int], rewards: list[float], anchors: list[str],
                  dropped: tuple[int, ...] = ()) -> list[Sample]:
    """An episode's step samples (one per turn), leaving out the turns in `dropped` (an empty turn is)."""
    info = EpisodeInfo((group, slot), tuple(anchors))
    return [Sample(prompt_ids=[5] * (turn + 1), response_ids=[9] * length, group_id=group, reward=sum(rewards),
                   step_rewards=rewards, episode=info, turn_spans=[TurnSpan(turn, 0, length)])
            for turn, length in enumerate(turn_lengths) if turn not in dropped]


def _expected(samples: list[Sample], episodes: list[list[Sample]], width: int, gamma: float, **options):
    """Each token's advantage by hand: the estimator on one row per turn of each episode (turns without a
    sample included), then each turn's value on its span."""
    returns, groups, ids, anchors, rewards, turns, where = [], [], [], [], [], [], {}
    anchor_ids: dict[str, int] = {}
    for index, episode in enumerate(episodes):
        sample = episode[0]
        for turn, (anchor, reward) in enumerate(zip(sample.episode.anchors, sample.step_rewards)):
            where[(sample.episode.key, turn)] = len(returns)
            returns.append(sample.reward)
            groups.append(sample.group_id)
            ids.append(index)
            anchors.append(anchor_ids.setdefault(anchor, len(anchor_ids)))
            rewards.append(reward)
            turns.append(turn)
    episode_ids = torch.tensor(ids)
    inputs = AgenticAdvantageInputs(
        episode_returns=torch.tensor(returns), group_ids=torch.tensor(groups), episode_ids=episode_ids,
        anchor_ids=torch.tensor(anchors),
        step_returns=discounted_step_returns(torch.tensor(rewards), episode_ids, torch.tensor(turns), gamma))
    advantages, _ = AGENTIC_ADVANTAGES.get("gigpo")(inputs, **options)
    expected = torch.zeros(len(samples), width)
    for row, sample in enumerate(samples):
        for span in sample.turn_spans:
            expected[row, span.start:span.end] = advantages[where[(sample.episode.key, span.turn)]]
    return expected


def test_each_turn_s_advantage_lands_on_its_tokens_even_with_a_turn_left_out():
    """GiGPO on step samples of two episodes of one group; episode 0's turn 1 has no sample (an empty turn),
    yet its reward still counts in turn 0's return and its row in the anchor groups."""
    episode_0 = _step_samples(0, 3, [2, 0, 3], [0.0, 1.0, 0.5], ["s0", "s1", "s0"], dropped=(1,))
    episode_1 = _step_samples(1, 3, [1, 2], [0.0, 2.0], ["s0", "s1"])
    samples = [episode_0[0], episode_1[0], episode_0[1], episode_1[1]]
    batch = collate(samples, PAD)
    algorithm = AgenticConfig.model_validate({"algorithm": {"advantage": "gigpo", "gamma": 0.9}}).algorithm
    metrics = EpisodeAdvantages(algorithm)(batch)
    expected = _expected(samples, [episode_0, episode_1], batch.response_width, 0.9)
    assert expected.abs().sum() > 0
    torch.testing.assert_close(batch.extras["advantages"], expected * batch.response_mask, rtol=0, atol=0)
    assert set(metrics) and all(key.startswith("advantage/") for key in metrics)


def test_trajectory_advantages_leave_the_observation_tokens_at_zero():
    samples = [_trajectory(0, 0, [(0, 2), (4, 5)], [0.0, 1.0], ["a", "b"], 5),
               _trajectory(1, 0, [(0, 1), (2, 4)], [0.0, 0.0], ["a", "c"], 4)]
    batch = collate(samples, PAD)
    algorithm = AgenticConfig.model_validate({"algorithm": {"advantage": "gigpo"}}).algorithm
    EpisodeAdvantages(algorithm)(batch)
    expected = _expected(samples, [[samples[0]], [samples[1]]], batch.response_width, 1.0)
    torch.testing.assert_close(batch.extras["advantages"], expected * batch.response_mask, rtol=0, atol=0)
    assert batch.extras["advantages"][0, 2:4].eq(0).all() and batch.extras["advantages"][0, [0, 1, 4]].ne(0).all()


def test_collate_spreads_a_distillation_ce_mask_over_the_response_columns():
    rows = [Sample(prompt_ids=[1], response_ids=[2, 3, 4], ce_mask=[0, 1, 1]),
            Sample(prompt_ids=[1], response_ids=[5], ce_mask=[1])]
    assert collate(rows, PAD).extras["ce_mask"].tolist() == [[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="ce_mask has 2 entries for 3 response tokens"):
        Sample(prompt_ids=[1], response_ids=[2, 3, 4], ce_mask=[0, 1])


def test_advantage_clip_bounds_every_turn_s_advantage():
    samples = [_trajectory(0, 0, [(0, 2), (4, 5)], [0.0, 3.0], ["a", "b"], 5),
               _trajectory(1, 0, [(0, 1), (2, 4)], [0.0, 0.0], ["a", "c"], 4)]
    batch = collate(samples, PAD)
    algorithm = AgenticConfig.model_validate({"algorithm": {"advantage": "gigpo", "advantage_clip": 0.1}}).algorithm
    EpisodeAdvantages(algorithm)(batch)
    unclipped = _expected(samples, [[samples[0]], [samples[1]]], batch.response_width, 1.0)
    assert unclipped.abs().max() > 0.1  # the clip has something to do
    torch.testing.assert_close(batch.extras["advantages"], unclipped.clamp(-0.1, 0.1) * batch.response_mask)
