"""One multi-turn episode as the rollout plays it (`Episode`), and how finished episodes become `Sample`s.

Trajectory-wise: one sample per episode, the first observation as its prompt and every later token as its
response: the model's turns (trained, with their logprobs and versions) and the observation turns between
them (masked, logprob 0, version -1), the episode return on the sample. Step-wise: one sample per turn, its
prompt the one the engine was given that turn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rollflow.data.sample import EpisodeInfo, Sample, SampleStatus, TurnSpan
from rollflow.errors import StepFailedError

# Counters an env may put in a reply's info, summed per episode: a tool-use env's `tool_calls`, `tool_errors` and
# `tool_seconds`; a remote env's `env_retries` (calls a server failed and a fresh session redid).
COUNTED_INFO = ("tool_calls", "tool_errors", "tool_seconds", "env_retries")


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
    vision: Any = None  # the images of `prompt_ids` (`VisionInputs`; None: none), for a step-wise sample


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
        context_full: truncated at the context limit: the tokens of the prompt its next turn did not fit after
            (0: it was not).
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
    counters: dict[str, float] = field(default_factory=dict)  # COUNTED_INFO keys summed over the env's replies
    vision: Any = None  # the images of every observation so far, in order (`VisionInputs`; None: text only)
    context_full: int = 0

    def count(self, info: dict[str, Any]) -> None:
        """Add an env reply's counters (`COUNTED_INFO`: tool calls, tool errors, time in tools, env retries)."""
        for key in COUNTED_INFO:
            value = info.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.counters[key] = self.counters.get(key, 0.0) + float(value)

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


def episode_samples(episodes: list[Episode], group_id: int, mode: str) -> list[Sample]:
    """The samples of a group's kept episodes: one per episode (`trajectory`) or one per turn (`step`).

    Each carries what the agentic advantages read, typed: `episode` (its key (group id, slot) and each turn's
    anchor state), `turn_spans` (trajectory: every turn's tokens in the response; step: its one turn),
    `step_rewards` (every turn's reward) and `reward` (the episode's return); and in `metadata` what the
    metrics read: `success`, `seed`, `turns`, `invalid_actions`, `env_seconds`, `prefix_reused_tokens`,
    `turn_prompt_tokens`, `first_prompt_tokens`, `context_full` (the prompt tokens its next turn did not fit
    after, 0 if none) and `counters`.
    """
    samples = []
    for episode in episodes:
        info = EpisodeInfo((group_id, episode.slot), tuple(turn.anchor for turn in episode.turns))
        common = dict(group_id=group_id, reward=episode.episode_return, status=episode.status,
                      step_rewards=[turn.reward for turn in episode.turns], episode=info)
        meta = {"seed": episode.seed, "success": episode.success, "turns": len(episode.turns),
                "invalid_actions": sum(turn.invalid for turn in episode.turns), "env_seconds": episode.env_seconds,
                "prefix_reused_tokens": sum(turn.prefix_reused_tokens for turn in episode.turns),
                "turn_prompt_tokens": sum(len(turn.prompt_ids) for turn in episode.turns),
                "first_prompt_tokens": len(episode.prompt_ids), "context_full": episode.context_full,
                "counters": dict(episode.counters)}
        if mode == "trajectory":
            samples.append(Sample(
                prompt_ids=episode.prompt_ids, response_ids=episode.response_ids,
                response_logprobs=episode.response_logprobs, loss_mask=episode.loss_mask,
                policy_versions=episode.response_versions,
                response_text=" | ".join(turn.text for turn in episode.turns), metadata=meta,
                turn_spans=[TurnSpan(number, start, end) for number, (start, end) in enumerate(episode.spans)],
                vision=episode.vision, **common))
        else:
            for number, turn in enumerate(episode.turns):
                samples.append(Sample(
                    prompt_ids=turn.prompt_ids, response_ids=turn.token_ids, response_logprobs=turn.logprobs,
                    loss_mask=[1] * len(turn.token_ids), policy_versions=turn.versions, response_text=turn.text,
                    metadata=dict(meta), turn_spans=[TurnSpan(number, 0, len(turn.token_ids))], vision=turn.vision,
                    **common))
    return [sample for sample in samples if sample.response_ids]


def failed_samples(episodes: list[Episode], group_id: int = -1) -> list[Sample]:
    """Failed episodes as `Sample`s (never trained on, `usable()` leaves them out): what was played of them,
    status `failed`, and in `metadata` why (`error`, one line; `error_details`, the env's traceback)."""
    return [Sample(prompt_ids=episode.prompt_ids, response_ids=episode.response_ids,
                   response_text=" | ".join(turn.text for turn in episode.turns), group_id=group_id,
                   reward=episode.episode_return, status=SampleStatus.FAILED,
                   episode=EpisodeInfo((group_id, episode.slot)),
                   metadata={"seed": episode.seed, "turns": len(episode.turns),
                             "success": False, "error": episode.error, "error_details": episode.error_details,
                             "counters": dict(episode.counters)})
            for episode in episodes]


def episode_metrics(samples: list[Sample], prefix: str, failed: list[Sample] | None = None) -> dict[str, float]:
    """Success rate (failed episodes count as failures), and the mean return, turns, invalid actions and env
    time of the episodes that did not fail (`rollout/` or `eval/`), from their samples (one episode's samples
    count once); tool and env-retry counters when the env reports them (`counter_metrics`). `failed`: failed
    episodes left out of `samples`, whose env retries still count."""
    episodes = list({sample.episode.key: sample for sample in samples}.values())
    if not episodes:
        return {}
    played = [e for e in episodes if e.status != SampleStatus.FAILED]
    turns = sum(e.metadata["turns"] for e in played)
    count = max(len(played), 1)
    metrics = {
        f"{prefix}/success": sum(bool(e.metadata["success"]) for e in played) / len(episodes),
        f"{prefix}/return": sum(e.reward for e in played) / count,
        f"{prefix}/turns": turns / count,
        f"{prefix}/invalid_action_frac": sum(e.metadata["invalid_actions"] for e in played) / max(turns, 1),
        f"{prefix}/truncated_frac": sum(e.status == SampleStatus.TRUNCATED for e in played) / count,
        f"{prefix}/context_truncated_frac": sum(bool(e.metadata.get("context_full")) for e in played) / count,
        f"{prefix}/env_seconds_per_turn": sum(e.metadata["env_seconds"] for e in played) / max(turns, 1),
        f"{prefix}/prefix_reused_frac": (sum(e.metadata["prefix_reused_tokens"] for e in played)
                                         / max(sum(e.metadata["turn_prompt_tokens"] for e in played), 1)),
    }
    metrics.update(counter_metrics(episodes + list(failed or []), played, prefix))
    return {k: v for k, v in metrics.items() if math.isfinite(v)}


def counter_metrics(episodes: list[Sample], played: list[Sample], prefix: str) -> dict[str, float]:
    """Tool-use and remote-env metrics, when the env reports their counters: tool calls per played episode,
    the share of calls that failed (malformed ones included), seconds per call; env retries, summed over every
    episode (failed ones too: a retry is what a dying server costs)."""
    def total(key: str, among: list[Sample]) -> float:
        return sum(e.metadata.get("counters", {}).get(key, 0.0) for e in among)

    reported = {key for e in episodes for key in e.metadata.get("counters", {})}
    metrics = {}
    if "tool_calls" in reported:
        calls = total("tool_calls", played)
        metrics[f"{prefix}/tool_calls_per_episode"] = calls / max(len(played), 1)
        errors = total("tool_errors", played)  # a failed call an env did not count as a call is one still
        metrics[f"{prefix}/tool_error_frac"] = errors / max(calls, errors, 1)
        metrics[f"{prefix}/tool_seconds_per_call"] = total("tool_seconds", played) / max(calls, 1)
    if "env_retries" in reported:
        metrics[f"{prefix}/env_retries"] = total("env_retries", episodes)
    return metrics


def no_episodes_error(where: str, failed: list[Sample], finished: int, group_size: int) -> StepFailedError:
    """The error of a step (or eval) that has nothing to train on (or score): every episode failed, or too
    many did for any group to fill.

    Args:
        where: "step 3", "eval at step 0".
        failed: the samples of the episodes that failed (`failed_samples`), the first first.
        finished: episodes that did not fail but whose group was dropped.
        group_size: episodes a group needs (`rollout.group_size`; 1 for eval).

    Returns:
        A `StepFailedError` whose message names the first error and whose `details` count every distinct
        error and hold the first traceback.
    """
    if not failed:
        return StepFailedError(f"{where}: no env group was played to the end (every group was dropped as stale "
                               "or by the refill bound); nothing to train on")
    first = failed[0].metadata.get("error") or "no error recorded"
    if finished == 0:
        message = f"{where}: all {len(failed)} episodes failed; the first failed with: {first}"
    else:
        message = (f"{where}: no env group of {group_size} episodes finished: {len(failed)} of "
                   f"{len(failed) + finished} episodes failed, the first with: {first}; raise "
                   "rollout.group_redundancy (spares replace failed episodes) or fix the env")
    return StepFailedError(message, details=error_summary(failed))


def error_summary(failed: list[Sample]) -> str:
    """Every distinct episode error with its count (most frequent first), then the first env traceback."""
    counts: dict[str, int] = {}
    for sample in failed:
        counts[_error(sample)] = counts.get(_error(sample), 0) + 1
    lines = [f"{count} x {error}" for error, count in sorted(counts.items(), key=lambda item: -item[1])]
    traceback = next((s.metadata["error_details"] for s in failed if s.metadata.get("error_details")), "")
    return "\n".join(["episode errors:", *lines, *(["", "the first env traceback:", traceback] if traceback else [])])


class EpisodeErrorWarnings:
    """Warns on stderr of each new episode error of a run (`rollflow: warning: step 3: 2 episodes failed:
    ...`), at most `limit` distinct ones; later ones are counted (`rollout/failed`) and written to
    `samples.jsonl`, not printed."""

    def __init__(self, limit: int = 3):
        self.limit, self.seen = limit, set()

    def lines(self, where: str, failed: list[Sample]) -> list[str]:
        """The warning lines for the episodes that failed in `where` ("step 3", "eval at step 0"), from their
        samples (`failed_samples`)."""
        lines = []
        for sample in failed:
            error = _error(sample)
            if error in self.seen or len(self.seen) >= self.limit:
                continue
            self.seen.add(error)
            count = sum(_error(other) == error for other in failed)
            more = "; further new errors are counted in rollout/failed and logged in samples.jsonl, not printed" \
                if len(self.seen) == self.limit else ""
            lines.append(f"{where}: {count} of its episodes failed with: {error}{more}")
        return lines


@dataclass(frozen=True)
class TurnBudget:
    """The token budget of an episode's turns, as the messages about it name it.

    Attributes:
        context: tokens a turn's prompt and its answer must fit (`rollout.max_context_tokens`, else the model's).
        max_new_tokens: tokens a turn may generate (`rollout.max_new_tokens`).
        max_turns: model turns an episode may take (`env.max_turns`).
        prefix: tokens of the first prompt that are not the observation: the system prompt, the tools and the
            chat template's markers.
    """

    context: int
    max_new_tokens: int
    max_turns: int
    prefix: int


class ContextLimitWarning:
    """Warns on stderr, once a run, when episodes end truncated because their next turn would not fit the
    context: that cuts an episode short silently (the answer after a long tool call, say), which
    `rollout/truncated_frac` alone does not tell from the turn limit."""

    def __init__(self, budget: TurnBudget):
        self.budget, self.warned = budget, False

    def lines(self, where: str, samples: list[Sample], prefix: str = "rollout") -> list[str]:
        """The warning for the episodes of `where` ("step 3", "eval at step 0"), from their samples
        (`episode_samples`); none when no episode hit the context limit, or after the first warning. `prefix`:
        their metrics' (`rollout`, `eval`)."""
        episodes = list({s.episode.key: s for s in samples if s.status != SampleStatus.FAILED}.values())
        cut = [e for e in episodes if e.metadata.get("context_full")]
        if self.warned or not cut:
            return []
        self.warned = True
        budget, first = self.budget, cut[0].metadata
        room = budget.context - budget.max_new_tokens
        return [f"{where}: {len(cut)} of {len(episodes)} episodes ended truncated at the context limit, before their "
                f"last turn or answer: the context holds {budget.context} tokens (rollout.max_context_tokens, "
                f"default the model's), so with rollout.max_new_tokens = {budget.max_new_tokens} a turn's prompt "
                f"must stay within {room} tokens; one episode's reached {first['context_full']} after "
                f"{first['turns']} of env.max_turns = {budget.max_turns} turns (its first prompt: "
                f"{first['first_prompt_tokens']} tokens, {budget.prefix} of them the system prompt, tools and chat "
                "markers). Lower rollout.max_new_tokens or env.max_turns, shorten the system prompt or the "
                "observations (tool results), or use a model with a longer context; "
                f"{prefix}/context_truncated_frac counts these episodes"]


def _error(sample: Sample) -> str:
    return sample.metadata.get("error", "")
