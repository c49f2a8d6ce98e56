"""The advantage stage of the agentic pipeline: one advantage per model turn, from the episodes' returns,
step rewards and anchor states (what their samples carry: `reward`, `step_rewards`, `metadata["anchors"]`),
spread over the turn's tokens.

It runs on the driver between the rollout and the actor update; the math is in
`rollflow.algorithms.agentic` (`AGENTIC_ADVANTAGES`: starpo, gigpo, step_reinforce).
"""

from __future__ import annotations

import torch

from rollflow.algorithms import AGENTIC_ADVANTAGES, AgenticAdvantageInputs, discounted_step_returns
from rollflow.data.sample import Batch, Sample
from rollflow.rollout.episodes import per_token


class EpisodeAdvantages:
    """Fills `batch.extras["advantages"]` [B, T] (each turn's advantage on its tokens) and
    `["segment_ids"]` [B, T] (the turn of each model token, -1 elsewhere: `ipa_chunk` takes a ratio per turn).

    Args:
        algorithm: the agentic algorithm config (`advantage`, `advantage_kwargs`, `gamma`, `advantage_clip`).
        mode: "trajectory" or "step" (`rollout.samples`).
    """

    needs_policy_logprobs = False  # the returns alone make the advantages (`RLStep.update` asks)

    def __init__(self, algorithm, mode: str):
        self.estimator = AGENTIC_ADVANTAGES.get(algorithm.advantage)
        self.kwargs = dict(algorithm.advantage_kwargs)
        self.gamma = algorithm.gamma
        self.clip = algorithm.advantage_clip
        self.mode = mode

    def __call__(self, batch: Batch, samples: list[Sample]) -> dict[str, float]:
        """`samples`: the batch's rows, from `episode_samples`."""
        inputs, keys = step_rows(samples, self.gamma)
        advantages, metrics = self.estimator(inputs, **self.kwargs)  # [S]
        if self.clip is not None:
            advantages = advantages.clamp(-self.clip, self.clip)
        by_step = dict(zip(keys, advantages.tolist()))
        values, segments = per_token(samples, by_step, batch.response_width)  # [B, T], [B, T]
        batch.extras["advantages"] = values * batch.response_mask
        batch.extras["segment_ids"] = segments
        return {f"advantage/{k}": float(v) for k, v in metrics.items()}


def step_rows(samples: list[Sample], gamma: float) -> tuple[AgenticAdvantageInputs, list[tuple]]:
    """One row per model turn of the samples' episodes (an episode's samples count once, step-wise ones
    included): its episode's return and group, its anchor state (as an id equal for equal states) and its
    discounted return.

    Returns:
        (the estimator's inputs [S], the (episode, turn) of each row).
    """
    keys, returns, groups, episode_ids, anchors, rewards, turns = [], [], [], [], [], [], []
    anchor_index: dict[str, int] = {}
    episodes = list({sample.metadata["episode"]: sample for sample in samples}.values())
    for index, episode in enumerate(episodes):
        for number, (anchor, reward) in enumerate(zip(episode.metadata["anchors"], episode.step_rewards)):
            keys.append((episode.metadata["episode"], number))
            returns.append(episode.reward)
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
    return inputs, keys
