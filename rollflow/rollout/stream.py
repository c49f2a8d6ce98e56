"""Streaming rollout: each step's batch is filled from a stream of prompt groups, optionally ahead of the trainer.

`RolloutStream` owns the flow of prompt groups for training. It draws prompts from the sampler itself,
keeps the engine workers fed (through the `RolloutScheduler`'s routing, scoring and seeding), scores each
group as it completes and hands the pipeline a batch once `prompts_per_step` usable groups are ready. A
group's life:

    queued -> generating -> scoring -> ready -> consumed
                  |            |          `--> stale     (older than max_staleness when handed out)
                  |            `--> filtered | failed    (dynamic sampling; every sample failed)
                  `--> aborted                           (over-provisioning cut it; its prompt waits for
                                                          a long round)

Three things sit on top of that flow:

* **Dynamic sampling that refills** (DAPO): a group the difficulty mask drops, or whose samples all failed,
  or that went stale, is replaced by a new prompt, at most `max_refill_prompts` per step; when the bound is
  hit the step trains on what it has (`rollout/refill_bound_hit`).
* **Over-provisioning and tail batching** (RollPacker): with `overprovision` = eta > 1 a synchronous step
  launches ceil(eta * P) groups, keeps the first P that finish and aborts the rest; aborted prompts wait in a
  long queue and run together in a long round (every `long_round_every`-th step, or once the queue holds P),
  so ordinary steps stop waiting for the longest responses.
* **Asynchronous training** (ROLL Flash, `max_staleness` = K > 0): a producer thread keeps generating while
  the trainer trains. Admission control lets at most (steps requested + K) x ceil(eta * P) groups (plus
  refills) into the stream, so rollout runs at most K steps ahead; a group whose oldest token was sampled
  more than K policy versions before the trainer's is dropped when handed out (`stale`, counted), so the
  bound holds whatever the timings. Weight updates reach the engines between tokens and in-flight groups
  continue with the new weights (partial rollout, `continue`); each token carries its version. With
  `resubmit`, a weight update aborts what is generating and each unfinished sample is sent again as its
  prompt plus the tokens it has, to continue under the new weights (for engines that cannot change weights
  under a running request); its tokens, logprobs and versions are kept and joined.

With `max_staleness: 0`, `overprovision: 1` and a deterministic scheduler, groups are sent in rounds (each
engine worker gets its share of a round as one batch, in stream order) and a step holds exactly the groups
the same run always gets: runs stay reproducible. Asynchronous and over-provisioned rollouts depend on
timing by nature (which group finishes first); their seeds are still fixed per prompt.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import ray

from rollflow.cluster.calls import map_ray_error
from rollflow.data.prompts import EncodedPrompt
from rollflow.data.sample import Sample, SampleStatus
from rollflow.data.seeds import derive_seed
from rollflow.engines.base import Completion, CompletionOutput, GenerationRequest, SamplingParams
from rollflow.errors import StalledError
from rollflow.rollout.filters import filter_by_difficulty, usable
from rollflow.rollout.scheduler import MISSING, RolloutResult, RolloutScheduler


class GroupState(str, enum.Enum):
    QUEUED = "queued"
    GENERATING = "generating"
    SCORING = "scoring"
    READY = "ready"
    CONSUMED = "consumed"
    FILTERED = "filtered"
    FAILED = "failed"
    ABORTED = "aborted"
    STALE = "stale"


# States a group leaves the stream in; each step logs how many groups reached each since the last step.
ENDED = (GroupState.CONSUMED, GroupState.FILTERED, GroupState.FAILED, GroupState.ABORTED, GroupState.STALE)
# States a group is in while the stream still holds it; each step logs how many are in each.
HELD = (GroupState.QUEUED, GroupState.GENERATING, GroupState.SCORING, GroupState.READY)
STALENESS_FRACTIONS = 8  # staleness/frac_k is logged for k = 0 .. min(max_staleness, this); staleness/max says more


class Sampler(Protocol):
    """Where prompts come from (`rollflow.data.prompts.PromptSampler` or a multi-domain sampler)."""

    def take(self, count: int) -> list[EncodedPrompt]: ...

    def state(self) -> dict: ...

    def load_state(self, state: dict) -> None: ...


@dataclass(frozen=True)
class StreamSettings:
    """The knobs of `RolloutStream` (from `rollout.*` and `algorithm.difficulty_mask`)."""

    prompts_per_step: int
    max_staleness: int = 0
    max_refill_prompts: int = 0
    overprovision: float = 1.0
    long_round_every: int = 0
    difficulty_mask: tuple[float, float] | None = None
    partial_rollout: str = "continue"  # or "resubmit" (asynchronous mode)

    @property
    def launched_per_step(self) -> int:
        return math.ceil(self.overprovision * self.prompts_per_step - 1e-9)

    @property
    def tail_batching(self) -> bool:
        """Over-provisioned synchronous steps: abort the slowest groups and run them in long rounds."""
        return self.overprovision > 1 and self.max_staleness == 0


@dataclass(eq=False)
class PromptGroup:
    """One prompt's group of samples on its way through the stream."""

    prompt: EncodedPrompt
    index: int  # position in the stream of prompts drawn (its seed key and its order)
    group_id: int
    long: bool = False  # aborted once: runs in a long round
    state: GroupState = GroupState.QUEUED
    request_id: str = ""
    samples: list[Sample] = field(default_factory=list)
    scoring: Any = None  # the scheduler's pending scoring of the group
    outputs: list[CompletionOutput] = field(default_factory=list)  # resubmit mode: the samples so far
    open_slots: int = 0  # resubmit mode: samples still continuing

    def oldest_version(self) -> int | None:
        """The policy version of the group's oldest sampled token (None: no tokens)."""
        versions = [v for v in map(oldest_version, self.samples) if v is not None]
        return min(versions) if versions else None

    def tokens(self) -> int:
        return sum(len(s.response_ids) for s in self.samples)


class RolloutStream:
    """The training batches of a run, drawn from a stream of prompt groups (see the module docstring).

    Args:
        scheduler: routes requests to the engine workers and scores completions (its workers, reward,
            in-flight cap, seed, deterministic flag and watchdog are used).
        sampler: the training prompts (`take(count)`, `state()`, `load_state()`).
        params: the sampling parameters of every group (`n` = samples per prompt).
        settings: batch size, staleness bound, refill bound, over-provisioning, long rounds, filter.
        params_for: per-prompt sampling parameters (e.g. a domain's own lengths); default `params`.
    """

    def __init__(self, scheduler: RolloutScheduler, sampler: Sampler, params: SamplingParams,
                 settings: StreamSettings,
                 params_for: Callable[[EncodedPrompt, SamplingParams], SamplingParams] | None = None):
        self.scheduler, self.sampler, self.params, self.settings = scheduler, sampler, params, settings
        self.params_for = params_for or (lambda prompt, params: params)
        self.workers = scheduler.workers
        # Groups go out in rounds (one batch per worker) only where the batch must not depend on timing.
        self.rounds = scheduler.deterministic and settings.max_staleness == 0 and settings.overprovision == 1
        self._cond = threading.Condition()
        self._rewards_done = threading.Event()  # set when a plain reward ends (see `_pump`)
        self._queue: collections.deque[PromptGroup] = collections.deque()
        self._long_queue: collections.deque[PromptGroup] = collections.deque()
        self._in_flight: dict[ray.ObjectRef, tuple[int, list[PromptGroup]]] = {}  # ref -> (worker, groups)
        # resubmit mode: ref -> (worker, group, slot, request id) of a sample continuing from its tokens
        self._continuing: dict[ray.ObjectRef, tuple[int, PromptGroup, int, str]] = {}
        self._resubmitted = 0
        self._load = [0] * len(self.workers)  # samples in flight per worker
        self._requests = [0] * len(self.workers)  # requests in flight per worker
        self._scoring: list[PromptGroup] = []
        self._ready: list[PromptGroup] = []
        self._quota = 0  # prompts the stream may still draw
        self._next_index = 0
        self._group_ids = itertools.count()
        self._request_ids = itertools.count()
        self._requested = 0  # batches asked for so far
        self._refills = 0  # prompts drawn to replace dropped groups since the last batch
        self._bound_hit = False
        self._ended: collections.Counter = collections.Counter()  # group state -> groups since the last batch
        self._dropped: list[Sample] = []  # samples of filtered / failed groups since the last batch
        self._wasted_tokens = 0
        self._generated_tokens = 0
        self._reward_seconds = 0.0  # scoring on the stream's thread
        self._reward_wait = 0.0  # waiting for scores with nothing left generating
        self._error: BaseException | None = None
        self._closed = False
        self._last_progress = time.monotonic()
        self._last_handout = time.perf_counter()
        self._thread: threading.Thread | None = None

    # ---- the pipeline's side ---------------------------------------------------------------------------
    def next_batch(self, step: int, policy_version: int) -> RolloutResult:
        """Block until `prompts_per_step` usable groups are ready (or the refill bound is hit with fewer), and
        hand them out.

        Args:
            step: the training step the batch is for (long rounds fall on `long_round_every` multiples).
            policy_version: the version of the weights the trainer will update with this batch; groups
                whose oldest token is more than `max_staleness` versions older are dropped (`stale`).

        Returns:
            The consumed groups' samples (and those of groups filtered or failed since the last batch, marked
            so: `usable()` leaves them out), with the stream's metrics.
        """
        started = time.perf_counter()
        with self._cond:
            long_round = self._plan_batch(step)
        if self.settings.max_staleness and self._thread is None:  # asynchronous: generation never pauses
            self._thread = threading.Thread(target=self._produce, name="rollflow-rollout", daemon=True)
            self._thread.start()
        batch = None
        while batch is None:
            with self._cond:
                self._raise_producer_error()
                self._drop_stale(policy_version)
                batch = self._take_batch(long_round)
                if batch is None and self._thread is not None:
                    self._cond.wait(0.05)  # the producer moves the stream
            if batch is None and self._thread is None:
                self._pump(self.scheduler.watchdog_s)
        if self._thread is None:  # synchronous: nothing of this step may run into the trainer's turn
            self._settle()
        with self._cond:
            return self._result(batch, policy_version, long_round, time.perf_counter() - started)

    def state(self) -> dict:
        """What a checkpoint keeps: the sampler's position and every prompt drawn but not yet handed out
        (queued, generating, scoring, ready or waiting for a long round), to be generated again on resume."""
        with self._cond:
            held = sorted([*self._held(), *self._long_queue], key=lambda g: g.index)
            return {"sampler": self.sampler.state(), "next_index": self._next_index,
                    "pending": [{"prompt": dataclasses.asdict(g.prompt), "index": g.index, "long": g.long}
                                for g in held]}

    def load_state(self, state: dict) -> int:
        """Resume: the sampler's position, and the prompts that were in flight are queued again first (their
        samples are generated anew: what was generated of them before the checkpoint is lost). Returns how
        many prompts that is."""
        self.sampler.load_state(state["sampler"])
        self._next_index = state["next_index"]
        for entry in state["pending"]:
            group = self._new_group(EncodedPrompt(**entry["prompt"]), entry["index"], entry["long"])
            (self._long_queue if group.long else self._queue).append(group)
        return len(state["pending"])

    def close(self) -> None:
        """Stop the producer thread and abort what is still generating (the engines stay usable)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            aborts = [(worker, [g.request_id for g in groups]) for worker, groups in self._in_flight.values()]
            aborts += [(worker, [request_id]) for worker, _, _, request_id in self._continuing.values()]
        if self._thread is not None:
            self._thread.join(timeout=5)
        for worker, request_ids in aborts:
            self.workers[worker].abort.remote(request_ids)

    def weights_updated(self) -> None:
        """New weights reached the engines. `resubmit` mode: abort what is generating; each unfinished sample
        continues from its tokens under the new weights (`continue` mode: nothing to do, the engines switch
        between tokens)."""
        if self.settings.partial_rollout != "resubmit":
            return
        with self._cond:
            for worker, groups in self._in_flight.values():
                self.workers[worker].abort.remote([g.request_id for g in groups])
            for worker, _, _, request_id in self._continuing.values():
                self.workers[worker].abort.remote([request_id])

    # ---- batch assembly (under the lock) ---------------------------------------------------------------
    def _plan_batch(self, step: int) -> bool:
        """Open the quota of prompts the coming batch may draw; returns whether it is a long round."""
        settings = self.settings
        self._requested += 1
        self._refills, self._bound_hit = 0, False
        long_round = settings.tail_batching and bool(self._long_queue) and (
            (settings.long_round_every > 0 and step % settings.long_round_every == 0)
            or len(self._long_queue) >= settings.prompts_per_step)
        if long_round:  # the long queue first, fresh prompts for the rest, nothing over-provisioned
            while self._long_queue and len(self._queue) < settings.prompts_per_step:
                self._queue.appendleft(self._long_queue.pop())
            self._quota = max(0, settings.prompts_per_step - len(self._queue))
        elif settings.max_staleness:  # run up to K steps ahead
            ahead = settings.max_staleness if self._requested == 1 else 0
            self._quota += (1 + ahead) * settings.launched_per_step
        else:
            self._quota = max(0, settings.launched_per_step - len(self._queue))
        self._cond.notify_all()
        return long_round

    def _take_batch(self, long_round: bool) -> list[PromptGroup] | None:
        """The batch if it can be handed out now: P ready groups, or fewer once nothing more can come."""
        wanted = self.settings.prompts_per_step
        if len(self._ready) < wanted:
            exhausted = not (self._quota or self._queue or self._in_flight or self._continuing or self._scoring)
            if not exhausted:
                return None
            self._bound_hit = True  # nothing more can come: the step trains on fewer groups
        # stalest first in asynchronous mode (they would be dropped next), otherwise in stream order
        self._ready.sort(key=lambda g: ((g.oldest_version() or 0) if self.settings.max_staleness else 0,
                                        g.index))
        batch, self._ready = self._ready[:wanted], self._ready[wanted:]
        for group in batch:
            self._end(group, GroupState.CONSUMED)
        if self.settings.tail_batching and not long_round:  # the slowest groups of this step give way
            for worker, groups in self._in_flight.values():
                self.workers[worker].abort.remote([g.request_id for g in groups])
        return batch

    def _settle(self) -> None:
        """Synchronous steps: wait for aborted and still-scoring groups, and put back what this step did not
        use (its prompts run again next step, generated by the new weights)."""
        while True:
            with self._cond:
                if not (self._in_flight or self._scoring):
                    leftovers, self._ready = self._ready, []
                    for group in sorted(leftovers, key=lambda g: g.index, reverse=True):
                        self._wasted_tokens += group.tokens()
                        self._ended[GroupState.ABORTED] += 1
                        self._queue.appendleft(self._new_group(group.prompt, group.index, group.long))
                    return
            self._pump(self.scheduler.watchdog_s)

    def _drop_stale(self, policy_version: int) -> None:
        """Asynchronous mode: drop the ready groups whose oldest token is more than `max_staleness` versions
        behind `policy_version` (synchronous steps have no staleness bound to keep)."""
        bound = self.settings.max_staleness
        if not bound:
            return
        oldest = {id(g): g.oldest_version() for g in self._ready}  # None: no tokens (0 is a version)
        for group in [g for g in self._ready if oldest[id(g)] is not None and policy_version - oldest[id(g)] > bound]:
            self._ready.remove(group)
            self._wasted_tokens += group.tokens()
            self._end(group, GroupState.STALE)
            self._refill()

    def _result(self, batch: list[PromptGroup], policy_version: int, long_round: bool,
                waited: float) -> RolloutResult:
        samples = [s for g in batch for s in g.samples]
        staleness = [policy_version - v for v in map(oldest_version, usable(samples)) if v is not None]
        now = time.perf_counter()
        since_last, self._last_handout = now - self._last_handout, now
        metrics = {f"rollout/groups/{state.value}": float(self._ended[state]) for state in ENDED}
        held = collections.Counter(g.state for g in self._held())
        metrics.update({f"rollout/groups/{state.value}": float(held[state]) for state in HELD})
        kept, dropped = self._ended[GroupState.CONSUMED], self._ended[GroupState.FILTERED]
        metrics.update({
            "time/rollout": waited,
            "time/reward": self._reward_seconds,
            "time/reward_wait": self._reward_wait,
            "rollout/refill_prompts": float(self._refills),
            "rollout/refill_bound_hit": float(self._bound_hit),
            "rollout/wasted_tokens": float(self._wasted_tokens),
            "rollout/long_round": float(long_round),
            "rollout/long_queue": float(len(self._long_queue)),
            "rollout/resubmitted_samples": float(self._resubmitted),
            "rollout/tokens_per_second": self._generated_tokens / max(since_last, 1e-9),
        })
        if self.settings.difficulty_mask is not None:
            metrics["difficulty_mask/kept_samples"] = float(len(usable(samples)))
            metrics["difficulty_mask/kept_group_frac"] = kept / max(kept + dropped, 1)
        if staleness:
            metrics["staleness/mean"] = statistics.fmean(staleness)
            metrics["staleness/max"] = float(max(staleness))
            for k in range(min(self.settings.max_staleness, STALENESS_FRACTIONS) + 1):
                metrics[f"staleness/frac_{k}"] = sum(s == k for s in staleness) / len(staleness)
        samples = samples + self._dropped
        self._ended.clear()
        self._dropped, self._wasted_tokens, self._generated_tokens, self._resubmitted = [], 0, 0, 0
        self._reward_seconds = self._reward_wait = 0.0
        return RolloutResult(samples, metrics)

    # ---- the flow of groups ----------------------------------------------------------------------------
    def _produce(self) -> None:
        """The producer thread of asynchronous mode: keep the stream moving until closed."""
        try:
            while True:
                with self._cond:
                    if self._closed:
                        return
                    idle = not (self._quota or self._queue or self._in_flight or self._continuing
                                or self._scoring)
                    if idle:
                        self._cond.wait(0.05)
                        self._last_progress = time.monotonic()
                        continue
                self._pump(0.05)
        except BaseException as err:  # noqa: BLE001 - it reaches the pipeline at its next batch
            with self._cond:
                self._error = err
                self._cond.notify_all()

    def _raise_producer_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _pump(self, wait_s: float) -> None:
        """One turn: draw and send what the quota allows, wait (at most `wait_s`) for completions and scores,
        and move the groups they finish along."""
        with self._cond:
            self._draw()
            self._dispatch()
            model_refs = {ref: (g, i) for g in self._scoring for i, ref in enumerate(g.scoring.pending.futures)
                          if g.scoring.results[i] is MISSING}
            pending = [*self._in_flight, *self._continuing, *model_refs]
            polling = any(g.scoring.pending.plain_pending for g in self._scoring)
            only_scoring = bool(self._scoring) and not (self._in_flight or self._continuing)
        if polling:
            wait_s = 0.005
        waited = time.perf_counter()
        done = ray.wait(pending, num_returns=1, timeout=wait_s)[0] if pending else []
        if done:
            done, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
        elif not pending and polling:  # only plain rewards running: woken as soon as one ends
            if self._rewards_done.wait(wait_s):
                self._rewards_done.clear()
        if only_scoring:  # what model rewards (and slow plain ones) add to a step
            self._reward_wait += time.perf_counter() - waited
        with self._cond:
            scoring_started = time.perf_counter()
            progressed = self._collect([ref for ref in done if ref in self._in_flight])
            progressed = self._collect_continuations([ref for ref in done if ref in self._continuing]) or progressed
            for ref in (ref for ref in done if ref in model_refs):
                group, index = model_refs[ref]
                try:
                    group.scoring.results[index] = ray.get(ref)
                except Exception as err:  # the reward worker raised or died: that reward fails the group
                    group.scoring.results[index] = err
            finished = [g for g in self._scoring
                        if MISSING not in g.scoring.results and not g.scoring.pending.plain_pending]
            for group in finished:
                self._scoring.remove(group)
                group.samples = self.scheduler.finish_scoring(group.scoring)
                self._scored(group)
            self._reward_seconds += time.perf_counter() - scoring_started
            if progressed or finished or done:
                self._last_progress = time.monotonic()
                self._cond.notify_all()
            elif (self._in_flight or self._continuing or self._scoring) and \
                    time.monotonic() - self._last_progress > self.scheduler.watchdog_s:
                generating = collections.Counter()
                for worker, groups in self._in_flight.values():
                    generating[worker] += len(groups)
                raise StalledError(self.scheduler.stall_message(generating, len(self._scoring)))

    def _reward_done(self, _future) -> None:
        """A plain reward call ended (on a reward-pool thread): wake a `_pump` waiting for scores."""
        self._rewards_done.set()

    def _draw(self) -> None:
        """Queue as many new prompts as the quota allows, at most one step's launch ahead of the engines: a
        quota of many steps (asynchronous mode, a large `max_staleness`) is drawn as the queue empties, never
        all at once (a million steps' prompts held in memory, and in every checkpoint)."""
        count = min(self._quota, self.settings.launched_per_step - len(self._queue))
        if count <= 0:
            return
        prompts = self.sampler.take(count)
        self._quota -= count
        for prompt in prompts:
            self._queue.append(self._new_group(prompt, self._next_index))
            self._next_index += 1

    def _new_group(self, prompt: EncodedPrompt, index: int, long: bool = False) -> PromptGroup:
        return PromptGroup(prompt, index, next(self._group_ids), long)

    def _request(self, group: PromptGroup) -> GenerationRequest:
        params = self.params_for(group.prompt, self.params)
        if self.scheduler.deterministic:
            params = replace(params, seed=derive_seed(self.scheduler.seed, "train", group.index))
        group.request_id = f"train-{next(self._request_ids)}"
        group.state = GroupState.GENERATING
        return GenerationRequest(group.request_id, group.prompt.token_ids, params)

    def _dispatch(self) -> None:
        """Send queued groups: a round of per-worker batches when nothing is out (reproducible mode), else
        each group to the least-loaded worker under its in-flight cap."""
        workers = len(self.workers)
        if self.rounds:
            if self._in_flight or self._scoring or not self._queue:
                return
            groups = list(self._queue)
            self._queue.clear()
            for worker in range(workers):
                share = groups[worker::workers]
                if share:
                    ref = self.workers[worker].generate_batch.remote([self._request(g) for g in share])
                    self._in_flight[ref] = (worker, share)
            return
        while self._queue:
            open_workers = [w for w in range(workers) if self._requests[w] < self.scheduler.max_in_flight]
            if not open_workers:
                return
            worker = min(open_workers, key=self._load.__getitem__)
            group = self._queue.popleft()
            self._load[worker] += self.params.n
            self._requests[worker] += 1
            self._in_flight[self.workers[worker].generate.remote(self._request(group))] = (worker, [group])

    def _collect(self, refs: list[ray.ObjectRef]) -> bool:
        """Completions that arrived: aborted groups wait for a long round, the rest get scored."""
        for ref in refs:
            worker, groups = self._in_flight.pop(ref)
            try:
                completions = ray.get(ref)
            except Exception as err:  # the engine failed or its worker died: the run cannot go on
                raise map_ray_error(err, "actor_infer", worker, "generate") from None
            completions = completions if isinstance(completions, list) else [completions]
            if not self.rounds:
                self._load[worker] -= self.params.n * len(groups)
                self._requests[worker] -= len(groups)
            for group, completion in zip(groups, completions):
                aborted = any(o.finish_reason == "abort" for o in completion.outputs)
                if aborted and self.settings.partial_rollout == "resubmit" and not self._closed:
                    group.outputs = completion.outputs
                    self._generated_tokens += sum(len(o.token_ids) for o in group.outputs)
                    for slot, output in enumerate(group.outputs):
                        if output.finish_reason == "abort":
                            group.open_slots += 1
                            self._continue(worker, group, slot)
                    continue
                self._completed(group, completion)
        return bool(refs)

    def _completed(self, group: PromptGroup, completion: Completion) -> None:
        """A group's generation ended: aborted groups wait for a long round, the rest get scored."""
        group.samples = self.scheduler.unscored_samples(group.prompt, completion, group.group_id)
        if not group.outputs:  # resubmit mode counted its tokens as they came
            self._generated_tokens += group.tokens()
        if any(s.status == SampleStatus.ABORTED for s in group.samples):
            self._wasted_tokens += group.tokens()
            self._end(group, GroupState.ABORTED)
            self._long_queue.append(self._new_group(group.prompt, group.index, long=True))
        elif self.scheduler.batched:
            group.scoring = self.scheduler.submit_scoring(group.prompt, group.samples)
            for future in group.scoring.pending.plain_futures():
                future.add_done_callback(self._reward_done)
            group.state = GroupState.SCORING
            self._scoring.append(group)
        else:  # a plain function, called on this thread
            self.scheduler.score_now(group.prompt, group.samples)
            self._scored(group)

    def _continue(self, worker: int, group: PromptGroup, slot: int) -> None:
        """Resubmit mode: send sample `slot` again as its prompt plus its tokens so far, for the rest of its
        length (to the group's worker, whose prefix cache knows the prompt)."""
        prefix = group.outputs[slot]
        params = self.params_for(group.prompt, self.params)
        remaining = params.max_new_tokens - len(prefix.token_ids)
        if remaining <= 0:  # it was aborted on its last token
            prefix.finish_reason = "length"
            self._slot_done(group)
            return
        params = replace(params, n=1, max_new_tokens=remaining,
                         min_new_tokens=max(0, params.min_new_tokens - len(prefix.token_ids)))
        if self.scheduler.deterministic:
            params = replace(params, seed=derive_seed(self.scheduler.seed, "train", group.index, slot,
                                                      len(prefix.token_ids)))
        request_id = f"train-{next(self._request_ids)}"
        request = GenerationRequest(request_id, group.prompt.token_ids + prefix.token_ids, params)
        self._resubmitted += 1
        self._continuing[self.workers[worker].generate.remote(request)] = (worker, group, slot, request_id)

    def _collect_continuations(self, refs: list[ray.ObjectRef]) -> bool:
        """Continued samples that arrived: join their tokens to what they had; aborted again, continue again."""
        for ref in refs:
            worker, group, slot, _ = self._continuing.pop(ref)
            try:
                completion = ray.get(ref)
            except Exception as err:  # the engine failed or its worker died: the run cannot go on
                raise map_ray_error(err, "actor_infer", worker, "generate") from None
            prefix, more = group.outputs[slot], completion.outputs[0]
            group.outputs[slot] = CompletionOutput(prefix.token_ids + more.token_ids, prefix.logprobs + more.logprobs,
                                                   prefix.policy_versions + more.policy_versions,
                                                   more.finish_reason)
            self._generated_tokens += len(more.token_ids)
            if more.finish_reason == "abort" and not self._closed:
                self._continue(worker, group, slot)
            else:
                self._slot_done(group)
        return bool(refs)

    def _slot_done(self, group: PromptGroup) -> None:
        group.open_slots -= 1
        if group.open_slots == 0:
            self._completed(group, Completion(group.request_id, group.outputs, {}))

    def _scored(self, group: PromptGroup) -> None:
        """A scored group is ready, or dropped (and replaced) when no sample of it can be trained on."""
        if all(s.status == SampleStatus.FAILED for s in group.samples):
            self._drop(group, GroupState.FAILED)
            return
        filter_by_difficulty(group.samples, self.settings.difficulty_mask)
        if not usable(group.samples):
            self._drop(group, GroupState.FILTERED)
            return
        group.state = GroupState.READY
        self._ready.append(group)

    def _drop(self, group: PromptGroup, state: GroupState) -> None:
        self._end(group, state)
        self._dropped.extend(group.samples)
        self._refill()

    def _refill(self) -> None:
        """One more prompt for a dropped group, within `max_refill_prompts` per step."""
        if self._refills < self.settings.max_refill_prompts:
            self._refills += 1
            self._quota += 1
        else:
            self._bound_hit = True

    def _end(self, group: PromptGroup, state: GroupState) -> None:
        group.state = state
        self._ended[state] += 1

    def _held(self) -> list[PromptGroup]:
        continuing = list({id(g): g for _, g, _, _ in self._continuing.values()}.values())
        return [*self._queue, *(g for _, gs in self._in_flight.values() for g in gs), *continuing,
                *self._scoring, *self._ready]


def oldest_version(sample: Sample) -> int | None:
    """The policy version of a sample's oldest model token (None: no model tokens)."""
    versions = [v for v in sample.policy_versions if v >= 0]
    return min(versions) if versions else None
