"""The advantage stage of the agentic pipeline: one advantage per model turn, from the episodes' returns,
step rewards and anchor states (what `collate` puts in `Batch.episodes`), on the turn's tokens (the batch's
`turn_ids` and `episode_index`).

It runs on the driver between the rollout and the actor update; the math is in
`rollflow.algorithms.agentic` (`AGENTIC_ADVANTAGES`: starpo, gigpo, step_reinforce).
"""

from __future__ import annotations

import torch

from rollflow.algorithms import AGENTIC_ADVANTAGES, AgenticAdvantageInputs, discounted_step_returns
from rollflow.data.sample import Batch, EpisodeRow


class EpisodeAdvantages:
    """Fills `batch.extras["advantages"]` [B, T]: each turn's advantage on its tokens (`ipa_chunk` takes a ratio
    per turn over the batch's `segment_ids`, which `collate` made).

    Args:
        algorithm: the agentic algorithm config (`advantage`, `advantage_kwargs`, `gamma`, `advantage_clip`).
    """

    needs_policy_logprobs = False  # the returns alone make the advantages (`RLStep.update` asks)

    def __init__(self, algorithm):
        self.estimator = AGENTIC_ADVANTAGES.get(algorithm.advantage)
        self.kwargs = dict(algorithm.advantage_kwargs)
        self.gamma = algorithm.gamma
        self.clip = algorithm.advantage_clip

    def __call__(self, batch: Batch) -> dict[str, float]:
        inputs, first_rows = step_rows(batch.episodes, self.gamma)
        advantages, metrics = self.estimator(inputs, **self.kwargs)  # [S]
        if self.clip is not None:
            advantages = advantages.clamp(-self.clip, self.clip)
        turns = batch.extras["turn_ids"]  # [B, T], -1 off the model's turns
        rows = first_rows[batch.extras["episode_index"]].unsqueeze(1) + turns.clamp(min=0)  # [B, T] into [S]
        values = torch.where(turns >= 0, advantages[rows], torch.zeros((), dtype=advantages.dtype))  # [B, T]
        batch.extras["advantages"] = values * batch.response_mask
        return {f"advantage/{k}": float(v) for k, v in metrics.items()}

    def state(self) -> None:
        """Nothing carries over from step to step (the RLVR stage's running statistics do)."""
        return None

    def load_state(self, state: None) -> None:
        return None


def step_rows(episodes: tuple[EpisodeRow, ...], gamma: float) -> tuple[AgenticAdvantageInputs, torch.Tensor]:
    """One row per model turn of the episodes, episode by episode: its episode's return and group, its anchor
    state (as an id equal for equal states) and its discounted return.

    Returns:
        (the estimator's inputs [S], [E] long: the row of each episode's turn 0).
    """
    returns, groups, episode_ids, anchors, rewards, turns, first_rows = [], [], [], [], [], [], []
    anchor_index: dict[str, int] = {}
    for index, episode in enumerate(episodes):
        first_rows.append(len(returns))
        for number, (anchor, reward) in enumerate(zip(episode.anchors, episode.step_rewards)):
            returns.append(episode.episode_return)
            groups.append(episode.group_id)
            episode_ids.append(index)
            anchors.append(anchor_index.setdefault(anchor, len(anchor_index)))
            rewards.append(reward)
            turns.append(number)
    episode_tensor = torch.tensor(episode_ids, dtype=torch.long)
    step_returns = discounted_step_returns(torch.tensor(rewards, dtype=torch.float32), episode_tensor,
                                           torch.tensor(turns, dtype=torch.long), gamma)  # [S]
    inputs = AgenticAdvantageInputs(
        episode_returns=torch.tensor(returns, dtype=torch.float32),
        group_ids=torch.tensor(groups, dtype=torch.long),
        episode_ids=episode_tensor,
        anchor_ids=torch.tensor(anchors, dtype=torch.long),
        step_returns=step_returns,
    )
    return inputs, torch.tensor(first_rows, dtype=torch.long)
