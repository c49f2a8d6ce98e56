"""Rollout scheduler: routes prompt groups to rollout workers and turns completions into scored `Sample`s.

Each prompt's group of samples is one request (prompt affinity: a group stays on one worker, which also
shares its prefill). Requests go to the least-loaded worker. Rewards are computed per group as soon as its
completion arrives, while the other groups are still generating.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray

from rollflow.data.prompts import EncodedPrompt
from rollflow.data.sample import Sample, SampleStatus
from rollflow.engines.base import Completion, GenerationRequest, SamplingParams

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
        reward_fn: combined reward function `(completion, **row) -> (total, parts)`.
        decode: `list[int] -> str` for completion text.
    """

    def __init__(self, workers: list, reward_fn: RewardFn, decode: Callable[[list[int]], str]):
        self.workers = workers
        self.reward_fn = reward_fn
        self.decode = decode
        self._ids = itertools.count()
        self._groups = itertools.count()

    def generate(self, prompts: list[EncodedPrompt], params: SamplingParams) -> RolloutResult:
        """Sample `params.n` completions for every prompt, score them, return all samples."""
        started = time.perf_counter()
        load = [0] * len(self.workers)
        in_flight: dict[ray.ObjectRef, tuple[EncodedPrompt, int, int]] = {}
        for prompt in prompts:
            worker = min(range(len(self.workers)), key=load.__getitem__)
            load[worker] += params.n
            request = GenerationRequest(f"req-{next(self._ids)}", prompt.token_ids, params)
            ref = self.workers[worker].generate.remote(request)
            in_flight[ref] = (prompt, worker, next(self._groups))
        samples: list[Sample] = []
        reward_seconds = 0.0
        first_done = None
        while in_flight:
            pending = list(in_flight)
            ray.wait(pending, num_returns=1)  # block until one is done, then take every finished one
            done, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
            first_done = first_done or time.perf_counter() - started
            for ref, completion in zip(done, ray.get(done)):
                prompt, worker, group_id = in_flight.pop(ref)
                load[worker] -= params.n
                reward_started = time.perf_counter()
                samples.extend(self._score(prompt, completion, group_id))
                reward_seconds += time.perf_counter() - reward_started
        elapsed = time.perf_counter() - started
        tokens = sum(len(s.response_ids) for s in samples)
        return RolloutResult(samples, {
            "time/rollout": elapsed,
            "time/reward": reward_seconds,
            "time/first_group_done": first_done or 0.0,
            "rollout/tokens_per_second": tokens / max(elapsed, 1e-9),
        })

    def _score(self, prompt: EncodedPrompt, completion: Completion, group_id: int) -> list[Sample]:
        samples = []
        for output in completion.outputs:
            text = self.decode(output.token_ids)
            sample = Sample(
                prompt_ids=prompt.token_ids,
                response_ids=output.token_ids,
                response_logprobs=output.logprobs,
                policy_versions=output.policy_versions,
                group_id=group_id,
                status=_STATUS[output.finish_reason],
                prompt_text=prompt.text,
                response_text=text,
                row=prompt.row,
                domain=str(prompt.row.get("domain", "default")),
                metadata={"request_id": completion.request_id, **completion.metadata},
            )
            try:
                sample.reward, sample.rewards = self.reward_fn(text, **prompt.row)
            except Exception as err:  # a broken reward fails its sample, never the step
                sample.status = SampleStatus.FAILED
                sample.metadata["error"] = f"{type(err).__name__}: {err}"
            samples.append(sample)
        return samples
