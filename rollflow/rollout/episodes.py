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
from rollflow.errors import StepFailedError


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
    prefix_reused_tokens: int = 0  # prompt tokens the engine's prefix cache already held


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
        info: the env's last info (success, ...); `error`: why it failed (one line), `error_details`: the
            env's traceback then, if it raised.
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
    error_details: str = ""
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

    def fail(self, error: str, details: str = "") -> None:
        """Mark the episode failed: `error` one line, `details` the env's traceback when there is one."""
        self.status, self.error, self.error_details = SampleStatus.FAILED, error, details

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


def failed_samples(episodes: list[Episode]) -> list[Sample]:
    """Failed episodes as `Sample`s for `samples.jsonl` (never trained on): what was played of them, status
    `failed` and `metadata["error"]`, why."""
    return [Sample(prompt_ids=episode.prompt_ids, response_ids=episode.response_ids,
                   response_text=" | ".join(turn.text for turn in episode.turns), group_id=episode.group,
                   reward=episode.episode_return, status=SampleStatus.FAILED,
                   metadata={"seed": episode.seed, "turns": len(episode.turns), "error": episode.error})
            for episode in episodes]


def no_episodes_error(where: str, failed: list[Episode], finished: int, group_size: int) -> StepFailedError:
    """The error of a step (or eval) that has nothing to train on (or score): every episode failed, or too
    many did for any group to fill.

    Args:
        where: "step 3", "eval at step 0".
        failed: the episodes that failed, the first first.
        finished: episodes that did not fail but whose group was dropped.
        group_size: episodes a group needs (`rollout.group_size`; 1 for eval).

    Returns:
        A `StepFailedError` whose message names the first error and whose `details` count every distinct
        error and hold the first traceback.
    """
    if not failed:
        return StepFailedError(f"{where}: no env group was played to the end (every group was dropped as stale "
                               "or by the refill bound); nothing to train on")
    first = failed[0].error or "no error recorded"
    if finished == 0:
        message = f"{where}: all {len(failed)} episodes failed; the first failed with: {first}"
    else:
        message = (f"{where}: no env group of {group_size} episodes finished: {len(failed)} of "
                   f"{len(failed) + finished} episodes failed, the first with: {first}; raise "
                   "rollout.group_redundancy (spares replace failed episodes) or fix the env")
    return StepFailedError(message, details=error_summary(failed))


def error_summary(failed: list[Episode]) -> str:
    """Every distinct episode error with its count (most frequent first), then the first env traceback."""
    counts: dict[str, int] = {}
    for episode in failed:
        counts[episode.error] = counts.get(episode.error, 0) + 1
    lines = [f"{count} x {error}" for error, count in sorted(counts.items(), key=lambda item: -item[1])]
    traceback = next((episode.error_details for episode in failed if episode.error_details), "")
    return "\n".join(["episode errors:", *lines, *(["", "the first env traceback:", traceback] if traceback else [])])


class EpisodeErrorWarnings:
    """Warns on stderr of each new episode error of a run (`rollflow: warning: step 3: 2 episodes failed:
    ...`), at most `limit` distinct ones; later ones are counted (`rollout/failed`) and written to
    `samples.jsonl`, not printed."""

    def __init__(self, limit: int = 3):
        self.limit, self.seen = limit, set()

    def lines(self, where: str, failed: list[Episode]) -> list[str]:
        """The warning lines for the episodes that failed in `where` ("step 3", "eval at step 0")."""
        lines = []
        for episode in failed:
            if episode.error in self.seen or len(self.seen) >= self.limit:
                continue
            self.seen.add(episode.error)
            count = sum(other.error == episode.error for other in failed)
            more = "; further new errors are counted in rollout/failed and logged in samples.jsonl, not printed" \
                if len(self.seen) == self.limit else ""
            lines.append(f"{where}: {count} of its episodes failed with: {episode.error}{more}")
        return lines
