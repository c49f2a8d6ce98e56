"""The prompt-group program of the rollout core: one prompt, `n` samples, scored, filtered (RLVR and its eval).

A group is one request (prompt affinity: its samples share the prompt's prefill on one engine worker). Its
rewards are computed as soon as its completion arrives, while other groups still generate: a plain reward
function is called per sample on the core's loop; a `CombinedReward` sends the group to model rewards (an LLM
judge, a reward model on reward workers) and its plain functions to the reward pool, and the group is
finished when every score has arrived. A group whose samples all failed, or that the difficulty mask leaves
without a usable sample, is dropped (the core refills it).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

from rollflow.data.prompts import EncodedPrompt
from rollflow.data.sample import Sample, SampleStatus
from rollflow.engines.base import Completion, SamplingParams
from rollflow.rollout.core import Group, GroupState, Play
from rollflow.rollout.filters import filter_by_difficulty, usable

# (completion text, **row) -> (total reward, {name: value})
RewardFn = Callable[..., tuple[float, dict[str, float]]]

_STATUS = {"stop": SampleStatus.FINISHED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


class PromptGroups:
    """Plays prompt groups (see the module docstring).

    Args:
        reward_fn: the combined reward (`rollflow.rewards.CombinedReward`), or any function
            `(completion, **row) -> (total, parts)`.
        decode: `list[int] -> str` for completion text.
        params: the sampling parameters of every group (`n` = samples per prompt).
        params_for: per-prompt sampling parameters (e.g. a domain's own lengths); default `params`.
        difficulty_mask: keep groups whose mean reward is within these bounds (`algorithm.difficulty_mask`);
            None: no filter (eval).
        tag: request ids are `<tag>-<n>`.
    """

    def __init__(self, reward_fn: RewardFn, decode: Callable[[list[int]], str], params: SamplingParams,
                 params_for: Callable[[EncodedPrompt, SamplingParams], SamplingParams] | None = None,
                 difficulty_mask: tuple[float, float] | None = None, tag: str = "train"):
        self.reward_fn, self.decode, self.params = reward_fn, decode, params
        self.params_for = params_for or (lambda prompt, params: params)
        self.difficulty_mask, self.tag = difficulty_mask, tag
        # A `CombinedReward` scores whole groups and may wait on reward workers or its reward pool; a plain
        # function is called per sample on the core's loop.
        self.batched = hasattr(reward_fn, "submit_group")
        self.reward_seconds = 0.0

    def participants(self, group: Group) -> int:
        return 1

    async def play(self, group: Group, play: Play) -> GroupState:
        prompt: EncodedPrompt = group.key
        params = self.params_for(prompt, self.params)
        seed_key = (*play.seed_key, group.index) if play.deterministic else None
        try:
            completion, _ = await play.generate(prompt.token_ids, params, order=(group.index,), seed_key=seed_key,
                                                vision=prompt.vision)
        finally:
            play.leave()
        group.samples = self.unscored_samples(prompt, completion, group.group_id)
        if any(s.status == SampleStatus.ABORTED for s in group.samples):
            return GroupState.ABORTED
        play.scoring()
        await self.score(prompt, group.samples, play)
        if all(s.status == SampleStatus.FAILED for s in group.samples):
            return GroupState.FAILED
        filter_by_difficulty(group.samples, self.difficulty_mask)
        return GroupState.READY if usable(group.samples) else GroupState.FILTERED

    async def score(self, prompt: EncodedPrompt, samples: list[Sample], play: Play) -> None:
        """Score the group's samples: per sample on this loop (a plain function), or through the combined
        reward's model rewards and pool (awaited while other groups go on). A broken reward fails its sample,
        never the step; an error starting a reward worker propagates (nothing can be scored without it)."""
        started = time.perf_counter()
        if not self.batched:
            for sample in samples:
                try:
                    sample.reward, sample.rewards = self.reward_fn(sample.response_text, **prompt.row)
                except Exception as err:  # noqa: BLE001 - a broken reward fails its sample, never the step
                    fail(sample, err)
            self.reward_seconds += time.perf_counter() - started
            return
        pending = self.reward_fn.submit_group([s.response_text for s in samples], [prompt.row] * len(samples))
        self.reward_seconds += time.perf_counter() - started
        results: list[Any] = []
        for future in pending.futures:
            try:
                results.append(await future)
            except Exception as err:  # noqa: BLE001 - the reward worker raised or died: that reward fails the group
                results.append(err)
            play.progress()
        for future in pending.plain_futures():
            await until_done(future)  # its outcome, error or not, is read by `finish`
            play.progress()
        started = time.perf_counter()
        for sample, outcome in zip(samples, pending.finish(results)):
            if isinstance(outcome, Exception):
                fail(sample, outcome)
            else:
                sample.reward, sample.rewards = outcome
        self.reward_seconds += time.perf_counter() - started

    def unscored_samples(self, prompt: EncodedPrompt, completion: Completion, group_id: int) -> list[Sample]:
        """The group's samples, not yet scored."""
        return [Sample(
            prompt_ids=prompt.token_ids,
            response_ids=output.token_ids,
            response_logprobs=output.logprobs,
            policy_versions=output.policy_versions,
            group_id=group_id,
            status=_STATUS[output.finish_reason],
            prompt_text=prompt.text,
            response_text=self.decode(output.token_ids),
            row=prompt.row,
            domain=str(prompt.row.get("domain", "default")),
            metadata={"request_id": completion.request_id, "slot": slot, **completion.metadata},
            vision=prompt.vision,
        ) for slot, output in enumerate(completion.outputs)]

    def batch_metrics(self, samples: list[Sample], ended: collections.Counter) -> dict[str, float]:
        metrics = {"time/reward": self.reward_seconds}
        self.reward_seconds = 0.0
        if self.difficulty_mask is not None:
            kept, dropped = ended[GroupState.CONSUMED], ended[GroupState.FILTERED]
            metrics["difficulty_mask/kept_samples"] = float(len(usable(samples)))
            metrics["difficulty_mask/kept_group_frac"] = kept / max(kept + dropped, 1)
        return metrics

    def key_state(self, key: EncodedPrompt) -> dict:
        return key.state()

    def load_key(self, state: dict) -> EncodedPrompt:
        return EncodedPrompt.from_state(state)

    def for_eval(self, params: SamplingParams) -> PromptGroups:
        """The eval program: the same rewards with `params` (greedy) for every prompt, no filter."""
        return PromptGroups(self.reward_fn, self.decode, params, tag="eval")


async def until_done(future: concurrent.futures.Future) -> None:
    """Wait until a pool future is done, leaving its outcome to be read from `future` itself.

    The asyncio copy that `wrap_future` makes gets the same outcome; its exception is read as soon as it is
    set (also when our wait was cancelled first), or collecting the copy would log "Future exception was
    never retrieved" with the reward's traceback for every sample whose reward raised.
    """
    copy = asyncio.wrap_future(future)
    copy.add_done_callback(_read_outcome)
    await asyncio.wait([copy])


def _read_outcome(copy: asyncio.Future) -> None:
    if not copy.cancelled():
        copy.exception()


def fail(sample: Sample, err: Exception) -> None:
    """Mark `sample` failed with `err`: its first line says what was raised; a remote call's error (a Ray task
    error, whose own first line is Ray's header naming the process) leads with the exception the call raised,
    then Ray's text with the worker's traceback."""
    sample.status = SampleStatus.FAILED
    cause = getattr(err, "cause", None)  # ray.exceptions.RayTaskError: what the remote method raised
    error = f"{type(err).__name__}: {err}"
    if isinstance(cause, BaseException):
        error = f"{type(cause).__name__}: {cause}\n{error}"
    sample.metadata["error"] = error
