"""Rollout scheduler: routes prompt groups to rollout workers and turns completions into scored `Sample`s.

Each prompt's group of samples is one request (prompt affinity: a group stays on one worker, which also
shares its prefill). Requests go to the least-loaded worker (samples in flight) among those under the
per-worker cap on in-flight requests; the rest wait and are sent as workers free up. Rewards are computed per group as soon as its
completion arrives, while the other groups are still generating. Model rewards (an LLM judge, a reward
model) score the whole group in one call on reward workers: the scheduler sends the group, keeps collecting
other groups' completions and finishes the group's samples when the scores arrive.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from rollflow.data.prompts import EncodedPrompt
from rollflow.data.sample import Sample, SampleStatus
from rollflow.engines.base import Completion, GenerationRequest, SamplingParams
from rollflow.rewards.combine import PendingGroup

# (completion text, row) -> (total reward, {name: value})
RewardFn = Callable[..., tuple[float, dict[str, float]]]

_STATUS = {"stop": SampleStatus.FINISHED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


@dataclass
class RolloutResult:
    samples: list[Sample]
    metrics: dict[str, float]


class RolloutScheduler:
    """Drives generation for one step over a list of rollout workers (Ray actor handles).

    Args:
        workers: `RolloutWorker` actor handles.
        reward_fn: the combined reward (`rollflow.rewards.CombinedReward`), or any function
            `(completion, **row) -> (total, parts)`.
        decode: `list[int] -> str` for completion text.
        max_in_flight: most requests (prompt groups) one worker holds at a time; the rest wait in the
            scheduler and go to whichever worker frees up first (`roles.actor_infer.max_in_flight_requests`).
    """

    def __init__(self, workers: list, reward_fn: RewardFn, decode: Callable[[list[int]], str],
                 max_in_flight: int = 64):
        self.workers = workers
        self.max_in_flight = max_in_flight
        self.reward_fn = reward_fn
        self.decode = decode
        # A `CombinedReward` scores whole groups and may wait on reward workers; a plain function is called
        # per sample on the driver.
        self.batched = hasattr(reward_fn, "submit_group")
        self._ids = itertools.count()
        self._groups = itertools.count()

    def generate(self, prompts: list[EncodedPrompt], params: SamplingParams) -> RolloutResult:
        """Sample `params.n` completions for every prompt, score them, return all samples."""
        started = time.perf_counter()
        load = [0] * len(self.workers)  # samples in flight per worker
        requests = [0] * len(self.workers)  # requests in flight per worker (capped)
        waiting = collections.deque(prompts)
        in_flight: dict[ray.ObjectRef, tuple[EncodedPrompt, int, int]] = {}

        def dispatch() -> None:
            """Send waiting groups to the least-loaded workers that are under their in-flight cap."""
            while waiting:
                open_workers = [w for w in range(len(self.workers)) if requests[w] < self.max_in_flight]
                if not open_workers:
                    return
                worker = min(open_workers, key=load.__getitem__)
                prompt = waiting.popleft()
                load[worker] += params.n
                requests[worker] += 1
                request = GenerationRequest(f"req-{next(self._ids)}", prompt.token_ids, params)
                ref = self.workers[worker].generate.remote(request)
                in_flight[ref] = (prompt, worker, next(self._groups))

        dispatch()
        scoring: dict[ray.ObjectRef, tuple[_GroupScoring, int]] = {}  # model-reward future -> (group, index)
        samples: list[Sample] = []
        reward_seconds = 0.0
        first_done = generation_done = None
        while in_flight or scoring:
            pending = [*in_flight, *scoring]
            ray.wait(pending, num_returns=1)  # block until one is done, then take every finished one
            done, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
            generated = [ref for ref in done if ref in in_flight]
            first_done = first_done or (time.perf_counter() - started if generated else None)
            for ref, completion in zip(generated, ray.get(generated)):
                prompt, worker, group_id = in_flight.pop(ref)
                load[worker] -= params.n
                requests[worker] -= 1
                reward_started = time.perf_counter()
                if self.batched:  # plain rewards now; model rewards go to reward workers and arrive later
                    group = self._submit(prompt, completion, group_id)
                    scoring.update({future: (group, i) for i, future in enumerate(group.pending.futures)})
                    if not group.pending.futures:
                        samples.extend(self._finish(group))
                else:
                    samples.extend(self._score(prompt, completion, group_id))
                reward_seconds += time.perf_counter() - reward_started
            dispatch()  # freed capacity takes the next waiting groups
            if not in_flight and generation_done is None:
                generation_done = time.perf_counter()
            for ref in (ref for ref in done if ref in scoring):
                group, index = scoring.pop(ref)
                try:
                    group.results[index] = ray.get(ref)
                except Exception as err:  # the reward worker raised or died: that reward fails the group
                    group.results[index] = err
                group.missing -= 1
                if group.missing == 0:
                    reward_started = time.perf_counter()
                    samples.extend(self._finish(group))
                    reward_seconds += time.perf_counter() - reward_started
        elapsed = time.perf_counter() - started
        tokens = sum(len(s.response_ids) for s in samples)
        return RolloutResult(samples, {
            "time/rollout": elapsed,
            "time/reward": reward_seconds,
            # What model rewards add to the step: waiting for scores after the last completion arrived.
            "time/reward_wait": time.perf_counter() - (generation_done or started) if prompts else 0.0,
            "time/first_group_done": first_done or 0.0,
            "rollout/tokens_per_second": tokens / max(elapsed, 1e-9),
        })

    def _samples(self, prompt: EncodedPrompt, completion: Completion, group_id: int) -> list[Sample]:
        """The group's samples, not yet scored."""
        samples = []
        for output in completion.outputs:
            samples.append(Sample(
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
                metadata={"request_id": completion.request_id, **completion.metadata},
            ))
        return samples

    def _score(self, prompt: EncodedPrompt, completion: Completion, group_id: int) -> list[Sample]:
        """Score a group sample by sample on the driver (a plain `(completion, **row)` reward function)."""
        samples = self._samples(prompt, completion, group_id)
        for sample in samples:
            try:
                sample.reward, sample.rewards = self.reward_fn(sample.response_text, **prompt.row)
            except Exception as err:  # a broken reward fails its sample, never the step
                _fail(sample, err)
        return samples

    def _submit(self, prompt: EncodedPrompt, completion: Completion, group_id: int) -> _GroupScoring:
        """Send the group to the model rewards and compute its plain rewards (`CombinedReward.submit_group`).

        An error starting a reward worker propagates: the run cannot score anything without it.
        """
        samples = self._samples(prompt, completion, group_id)
        pending = self.reward_fn.submit_group([s.response_text for s in samples], [prompt.row] * len(samples))
        return _GroupScoring(samples, pending, [None] * len(pending.futures), len(pending.futures))

    @staticmethod
    def _finish(group: _GroupScoring) -> list[Sample]:
        for sample, outcome in zip(group.samples, group.pending.finish(group.results)):
            if isinstance(outcome, Exception):  # a broken reward fails its sample, never the step
                _fail(sample, outcome)
            else:
                sample.reward, sample.rewards = outcome
        return group.samples


@dataclass
class _GroupScoring:
    """A group whose model rewards are being scored: its samples and the results that have arrived."""

    samples: list[Sample]
    pending: PendingGroup
    results: list[Any]  # one per model-reward future: its values, or the exception getting them raised
    missing: int  # futures not arrived yet


def _fail(sample: Sample, err: Exception) -> None:
    sample.status = SampleStatus.FAILED
    sample.metadata["error"] = f"{type(err).__name__}: {err}"
