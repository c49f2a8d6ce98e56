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
from dataclasses import dataclass, replace
from typing import Any

import ray

from rollflow.cluster.calls import map_ray_error
from rollflow.data.prompts import EncodedPrompt
from rollflow.data.sample import Sample, SampleStatus
from rollflow.data.seeds import derive_seed
from rollflow.engines.base import Completion, GenerationRequest, SamplingParams
from rollflow.errors import StalledError
from rollflow.rewards.combine import PendingGroup

# (completion text, row) -> (total reward, {name: value})
RewardFn = Callable[..., tuple[float, dict[str, float]]]

MISSING = object()  # a model-reward result that has not arrived

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
        seed: the run's seed; with `deterministic`, each request's sampling seed is derived from it.
        deterministic: reproducible rollouts (`rollout.deterministic`): request `i` of a `generate` call
            samples with the seed `derive_seed(seed, *seed_key, i)` (its samples `j` from that seed and
            `j`), and worker `w` gets the requests `i % len(workers) == w` as one batch, in order, so no
            batch composition, and so no float, depends on timing. False: least-loaded routing, per group.
        watchdog_s: a `generate` that sees no group generated or scored for this long raises
            `StalledError` naming the workers it waits on (`cluster.watchdog_s`).
    """

    def __init__(self, workers: list, reward_fn: RewardFn, decode: Callable[[list[int]], str],
                 max_in_flight: int = 64, seed: int = 0, deterministic: bool = False,
                 watchdog_s: float = 900.0):
        self.workers = workers
        self.max_in_flight = max_in_flight
        self.reward_fn = reward_fn
        self.decode = decode
        self.seed = seed
        self.deterministic = deterministic
        self.watchdog_s = watchdog_s
        # A `CombinedReward` scores whole groups and may wait on reward workers or its reward pool; a plain
        # function is called per sample on the driver.
        self.batched = hasattr(reward_fn, "submit_group")
        self._ids = itertools.count()
        self._groups = itertools.count()

    def generate(self, prompts: list[EncodedPrompt], params: SamplingParams,
                 seed_key: tuple[int | str, ...] = ()) -> RolloutResult:
        """Sample `params.n` completions for every prompt, score them, return all samples (in prompt order,
        each group's samples in sample order).

        Args:
            seed_key: what distinguishes this call's sampling from every other call's in deterministic mode,
                e.g. `("train", step)`.
        """
        started = time.perf_counter()
        load = [0] * len(self.workers)  # samples in flight per worker
        requests = [0] * len(self.workers)  # requests in flight per worker (capped)
        waiting = collections.deque(self._requests(prompts, params, seed_key))
        in_flight: dict[ray.ObjectRef, tuple[int, list[tuple[EncodedPrompt, int]]]] = {}  # ref -> (worker, groups)

        def dispatch() -> None:
            """Send waiting groups to the least-loaded workers that are under their in-flight cap."""
            while waiting:
                open_workers = [w for w in range(len(self.workers)) if requests[w] < self.max_in_flight]
                if not open_workers:
                    return
                worker = min(open_workers, key=load.__getitem__)
                prompt, group_id, request = waiting.popleft()
                load[worker] += params.n
                requests[worker] += 1
                in_flight[self.workers[worker].generate.remote(request)] = (worker, [(prompt, group_id)])

        if self.deterministic:  # fixed shares, one batch per worker, in prompt order
            for worker in range(len(self.workers)):
                share = list(waiting)[worker::len(self.workers)]
                if share:
                    ref = self.workers[worker].generate_batch.remote([request for _, _, request in share])
                    in_flight[ref] = (worker, [(prompt, group_id) for prompt, group_id, _ in share])
            waiting.clear()
        dispatch()
        scoring: list[GroupScoring] = []  # groups whose model rewards or pooled plain rewards are pending
        samples: list[Sample] = []
        reward_seconds = 0.0
        first_done = generation_done = None
        last_progress = time.monotonic()
        while in_flight or scoring:
            model_refs = {ref: (group, i) for group in scoring for i, ref in enumerate(group.pending.futures)
                          if group.results[i] is MISSING}
            pending = [*in_flight, *model_refs]
            polling = any(group.pending.plain_pending for group in scoring)  # thread futures: poll them
            wait_s = 0.005 if polling else max(0.0, self.watchdog_s - (time.monotonic() - last_progress))
            done = ray.wait(pending, num_returns=1, timeout=wait_s)[0] if pending else []
            if not pending and polling:  # only pool futures left: poll them (with none, the groups finish below)
                time.sleep(wait_s)
            elif done:  # take every other finished one too
                done, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
            generated = [ref for ref in done if ref in in_flight]
            first_done = first_done or (time.perf_counter() - started if generated else None)
            for ref in generated:
                worker, groups = in_flight.pop(ref)
                try:
                    completions = ray.get(ref)
                except Exception as err:  # the engine failed or its worker died: the run cannot go on
                    raise map_ray_error(err, "actor_infer", worker, "generate") from None
                completions = completions if isinstance(completions, list) else [completions]
                load[worker] -= params.n * len(groups)
                requests[worker] -= len(groups)
                reward_started = time.perf_counter()
                for (prompt, group_id), completion in zip(groups, completions):
                    group_samples = self.unscored_samples(prompt, completion, group_id)
                    if self.batched:  # model rewards go to reward workers, plain ones to the reward pool
                        scoring.append(self.submit_scoring(prompt, group_samples))
                    else:
                        samples.extend(self.score_now(prompt, group_samples))
                reward_seconds += time.perf_counter() - reward_started
            dispatch()  # freed capacity takes the next waiting groups
            if not in_flight and generation_done is None:
                generation_done = time.perf_counter()
            for ref in (ref for ref in done if ref in model_refs):
                group, index = model_refs[ref]
                try:
                    group.results[index] = ray.get(ref)
                except Exception as err:  # the reward worker raised or died: that reward fails the group
                    group.results[index] = err
            finished = [g for g in scoring if MISSING not in g.results and not g.pending.plain_pending]
            if finished:
                reward_started = time.perf_counter()
                for group in finished:
                    scoring.remove(group)
                    samples.extend(self.finish_scoring(group))
                reward_seconds += time.perf_counter() - reward_started
            if done or finished:
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > self.watchdog_s:
                generating = collections.Counter(worker for worker, groups in in_flight.values() for _ in groups)
                raise StalledError(self.stall_message(generating, len(scoring)))
        samples.sort(key=lambda s: (s.group_id, s.metadata.get("slot", 0)))
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

    def _requests(self, prompts: list[EncodedPrompt], params: SamplingParams,
                  seed_key: tuple[int | str, ...]) -> list[tuple[EncodedPrompt, int, GenerationRequest]]:
        """(prompt, group id, request) per prompt, in prompt order; seeded per request when deterministic."""
        out = []
        for i, prompt in enumerate(prompts):
            request_params = replace(params, seed=derive_seed(self.seed, *seed_key, i)) if self.deterministic \
                else params
            out.append((prompt, next(self._groups),
                        GenerationRequest(f"req-{next(self._ids)}", prompt.token_ids, request_params)))
        return out

    def stall_message(self, generating: collections.Counter, scoring: int) -> str:
        """The `StalledError` line: what a rollout without progress waits on (`generating`: worker -> groups)."""
        parts = [f"actor_infer worker {w} ({n} groups generating)" for w, n in sorted(generating.items())]
        if scoring:
            parts.append(f"rewards of {scoring} groups")
        return (f"no progress for {self.watchdog_s:g} s in phase rollout: waiting on {', '.join(parts)} "
                "(cluster.watchdog_s)")

    def unscored_samples(self, prompt: EncodedPrompt, completion: Completion, group_id: int) -> list[Sample]:
        """The group's samples, not yet scored."""
        samples = []
        for slot, output in enumerate(completion.outputs):
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
                metadata={"request_id": completion.request_id, "slot": slot, **completion.metadata},
            ))
        return samples

    def score_now(self, prompt: EncodedPrompt, samples: list[Sample]) -> list[Sample]:
        """Score a group sample by sample on the driver (a plain `(completion, **row)` reward function)."""
        for sample in samples:
            try:
                sample.reward, sample.rewards = self.reward_fn(sample.response_text, **prompt.row)
            except Exception as err:  # a broken reward fails its sample, never the step
                _fail(sample, err)
        return samples

    def submit_scoring(self, prompt: EncodedPrompt, samples: list[Sample]) -> GroupScoring:
        """Send the group to the model rewards and start its plain rewards (`CombinedReward.submit_group`);
        `finish_scoring` completes it once its futures are done.

        An error starting a reward worker propagates: the run cannot score anything without it.
        """
        pending = self.reward_fn.submit_group([s.response_text for s in samples], [prompt.row] * len(samples))
        return GroupScoring(samples, pending, [MISSING] * len(pending.futures))

    @staticmethod
    def finish_scoring(group: GroupScoring) -> list[Sample]:
        for sample, outcome in zip(group.samples, group.pending.finish(group.results)):
            if isinstance(outcome, Exception):  # a broken reward fails its sample, never the step
                _fail(sample, outcome)
            else:
                sample.reward, sample.rewards = outcome
        return group.samples


@dataclass
class GroupScoring:
    """A group whose model rewards are being scored: its samples and the results that have arrived."""

    samples: list[Sample]
    pending: PendingGroup
    results: list[Any]  # one per model-reward future: its values, the exception getting them raised, or MISSING


def _fail(sample: Sample, err: Exception) -> None:
    sample.status = SampleStatus.FAILED
    sample.metadata["error"] = f"{type(err).__name__}: {err}"
