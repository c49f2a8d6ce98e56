"""One multi-turn episode as the rollout plays it (`Episode`), and how finished episodes become `Sample`s.

Trajectory-wise: one sample per episode, the first observation as its prompt and every later token as its
response: the model's turns (trained, with their logprobs and versions) and the observation turns between
them (masked, logprob 0, version -1), the episode return on the sample. Step-wise: one sample per turn, its
prompt the one the engine was given that turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rollflow.data.sample import Sample, SampleStatus


@dataclass
class Turn:
    """One model turn and what the env made of it."""

    prompt_ids: list[int]  # what the engine was given (step-wise samples train on it)
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str
    anchor: str  # the state the action was taken in (GiGPO's anchor state)
    reward: float = 0.0
    invalid: bool = False


@dataclass(eq=False)
class Episode:
    """An episode of one env seed, filled turn by turn.

    Attributes:
        group: index of its env group; `slot`: its place in the group.
        seed: the env seed (every episode of a group has the same).
        prompt_ids: the first prompt (trajectory-wise samples).
        response: every token after the prompt, as (ids, logprobs, versions, mask) lists.
        turns: the model's turns.
        spans: per turn, [start, end) of its tokens in `response`.
        status: finished (the env ended it), truncated (turn or context limit), failed (env error), aborted.
        info: the env's last info (success, ...); `error`: why it failed.
    """

    group: int
    slot: int
    seed: int
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    response_versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    status: SampleStatus = SampleStatus.FINISHED
    info: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    env_seconds: float = 0.0

    def add_turn(self, turn: Turn) -> None:
        start = len(self.response_ids)
        self.turns.append(turn)
        self.response_ids += turn.token_ids
        self.response_logprobs += turn.logprobs
        self.response_versions += turn.versions
        self.loss_mask += [1] * len(turn.token_ids)
        self.spans.append((start, len(self.response_ids)))

    def add_observation(self, token_ids: list[int]) -> None:
        self.response_ids += token_ids
        self.response_logprobs += [0.0] * len(token_ids)
        self.response_versions += [-1] * len(token_ids)
        self.loss_mask += [0] * len(token_ids)

    def fail(self, error: str) -> None:
        self.status, self.error = SampleStatus.FAILED, error

    @property
    def episode_return(self) -> float:
        return float(sum(turn.reward for turn in self.turns))

    @property
    def success(self) -> bool:
        return bool(self.info.get("success", False))

    @property
    def oldest_version(self) -> int | None:
        versions = [v for turn in self.turns for v in turn.versions if v >= 0]
        return min(versions) if versions else None

    @property
    def usable(self) -> bool:
        """Trainable: not failed or aborted, and the model took at least one turn."""
        return self.status not in (SampleStatus.FAILED, SampleStatus.ABORTED) and bool(self.turns)


def episode_samples(episodes: list[Episode], group_ids: dict[int, int], mode: str) -> list[Sample]:
    """The samples of usable episodes: one per episode (`trajectory`) or one per turn (`step`).

    Args:
        episodes: finished episodes.
        group_ids: episode group index -> the batch's group id.
        mode: "trajectory" or "step".

    Returns:
        Samples in episode order (a step-wise episode's turns in turn order). `metadata` holds `episode`
        (index in `episodes`), `turn` (step-wise) and `success`.
    """
    samples = []
    for index, episode in enumerate(episodes):
        if not episode.usable:
            continue
        common = dict(group_id=group_ids[episode.group], reward=episode.episode_return, status=episode.status,
                      step_rewards=[turn.reward for turn in episode.turns])
        meta = {"episode": index, "seed": episode.seed, "success": episode.success, "turns": len(episode.turns)}
        if mode == "trajectory":
            samples.append(Sample(
                prompt_ids=episode.prompt_ids, response_ids=episode.response_ids,
                response_logprobs=episode.response_logprobs, loss_mask=episode.loss_mask,
                policy_versions=episode.response_versions,
                response_text=" | ".join(turn.text for turn in episode.turns),
                metadata={**meta, "spans": list(episode.spans)}, **common))
        else:
            for number, turn in enumerate(episode.turns):
                samples.append(Sample(
                    prompt_ids=turn.prompt_ids, response_ids=turn.token_ids, response_logprobs=turn.logprobs,
                    loss_mask=[1] * len(turn.token_ids), policy_versions=turn.versions, response_text=turn.text,
                    metadata={**meta, "turn": number}, **common))
    return [sample for sample in samples if sample.response_ids]


def per_token(samples: list[Sample], step_values: dict[tuple[int, int], float], width: int,
              mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Spread one value per (episode, turn) over the tokens of that turn.

    Args:
        samples: from `episode_samples`.
        step_values: (episode index, turn) -> value (an advantage).
        width: T, the batch's response width.
        mode: "trajectory" or "step".

    Returns:
        (values [B, T] float: each turn's value on its tokens, 0 elsewhere; segment_ids [B, T] long: the turn
        index of each model token, -1 on observation and padding tokens).
    """
    values = torch.zeros(len(samples), width)
    segments = torch.full((len(samples), width), -1, dtype=torch.long)
    for row, sample in enumerate(samples):
        episode = sample.metadata["episode"]
        if mode == "trajectory":
            spans = sample.metadata["spans"]
        else:
            spans = [(0, len(sample.response_ids))]
        for number, (start, end) in enumerate(spans):
            turn = number if mode == "trajectory" else sample.metadata["turn"]
            values[row, start:end] = step_values[(episode, turn)]
            segments[row, start:end] = number
    return values, segments
