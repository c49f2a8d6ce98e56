"""The rollout core: one event loop that plays groups on the engine workers, for training and for eval.

`RolloutCore` owns the flow of groups and the policy every kind of group gets; what one group *is* is a
plug-in `GroupProgram`: a prompt group (RLVR: sample, score, filter; rollflow/rollout/prompt_groups.py) or an
env group (agentic: episodes of turns against env workers; rollflow/rollout/env_groups.py). Only the core's
`EngineRouter` (rollflow/rollout/router.py) calls engine workers. A group's life:

    queued -> generating -> scoring -> ready -> consumed
                  |            |          `--> stale     (`staleness_control: drop` only: older than
                  |            |                          max_staleness when handed out)
                  |            `--> filtered | failed    (the program dropped it: difficulty mask, failures)
                  `--> aborted                           (over-provisioning cut it; it waits for a long round)

The policy, the same for every program:

* **quota and refill** (DAPO dynamic sampling): a step draws `groups_per_step` keys (prompts, env seeds) from
  its source; a group the program drops (filtered, failed) or that went stale is replaced by a new key, at
  most `max_refill_groups` per step; at the bound the step trains on what it has (`rollout/refill_bound_hit`).
* **over-provisioning and tail batching** (RollPacker): with `overprovision` = eta > 1 a synchronous step
  launches ceil(eta * P) groups, keeps the first P that finish and cuts the rest (their requests are aborted);
  cut keys wait in a long queue and run together in a long round (every `long_round_every`-th step, or once
  the queue holds P).
* **asynchronous training** (ROLL Flash, `max_staleness` = K > 0): groups keep playing while the trainer
  trains, drawn at most K steps ahead. With `staleness_control: admission` (the default) the staleness is
  bounded where a group is admitted: groups are handed out in the order they were drawn, so a group drawn for
  step s (by weights at most K versions older) trains at step s; a slow group holds its step back while the
  next steps' groups keep generating, and no finished group is ever dropped, so no response length is
  favoured. With `staleness_control: drop` the first groups to finish are handed out (the stalest first) and a
  group whose oldest token is more than K versions older than the trainer's is dropped (`stale`): faster, but
  the long responses are the ones dropped. New weights reach the engines between tokens (`continue`); with
  `resubmit` a weight update aborts what is generating and each unfinished sample continues from its tokens.
* **rounds**: with `deterministic` (and K = 0, eta = 1) or `lockstep`, a step's groups go out as one round:
  every request of the round is released together, each worker's share as one batch, so the same run gets
  the same batches (see `router.Round`).
* **one watchdog**: nothing generated, scored or stepped for `watchdog_s` while groups play raises
  `StalledError` naming what it waits on; every worker error is mapped to one line by the router.
* **resume**: `state()` holds the source's position and every key drawn but not handed out; `load_state`
  queues them again.

Eval is the same core over a fixed key list, without filters, quota or staleness (`evaluate`).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import math
import statistics
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from rollflow.data.sample import Sample, SampleStatus
from rollflow.data.seeds import derive_seed
from rollflow.engines.base import Completion, CompletionOutput, SamplingParams
from rollflow.errors import StalledError
from rollflow.rollout.filters import usable
from rollflow.rollout.router import EngineRouter, Round
from rollflow.rollout.settings import CoreSettings


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
# States a group is in while the core still holds it; each step logs how many are in each.
HELD = (GroupState.QUEUED, GroupState.GENERATING, GroupState.SCORING, GroupState.READY)
STALENESS_FRACTIONS = 8  # staleness/frac_k is logged for k = 0 .. min(max_staleness, this); staleness/max says more


@dataclass
class RolloutResult:
    """What a step trains on: the consumed groups' samples (and the samples of groups dropped since the last
    step, marked so: `usable()` leaves them out), with the step's rollout metrics."""

    samples: list[Sample]
    metrics: dict[str, float]


class Source(Protocol):
    """Where a training run's group keys come from (`PromptSampler`, a multi-domain sampler, `SeedSource`)."""

    def take(self, count: int) -> list[Any]: ...

    def state(self) -> dict: ...

    def load_state(self, state: dict) -> None: ...


@dataclass(eq=False)
class Group:
    """One key's group of samples on its way through the core."""

    key: Any  # what the program plays: an EncodedPrompt, an env seed
    index: int  # position in the stream of keys drawn (its seed key and its order)
    group_id: int
    long: bool = False  # cut once: runs in a long round
    state: GroupState = GroupState.QUEUED
    samples: list[Sample] = field(default_factory=list)
    cut: bool = False  # over-provisioning ended it: its requests were aborted
    ready_at: float = 0.0  # perf_counter when it became ready

    def oldest_version(self) -> int | None:
        """The policy version of the group's oldest sampled token (None: no tokens)."""
        versions = [v for v in map(oldest_version, self.samples) if v is not None]
        return min(versions) if versions else None

    def tokens(self) -> int:
        return sum(len(s.response_ids) for s in self.samples)


class GroupProgram(Protocol):
    """What one group is. `play` fills `group.samples` and returns the state it ends in: READY, FILTERED or
    FAILED (dropped and refilled) or ABORTED (cut; `group.cut`). An eval program (`RolloutCore.evaluate`) is
    one built not to filter; its groups' samples are returned whatever the state."""

    tag: str  # request ids are `<tag>-<n>`

    def participants(self, group: Group) -> int:
        """Round members of one group (callers that send requests concurrently: 1, or its episodes)."""
        ...

    async def play(self, group: Group, play: Play) -> GroupState: ...

    def key_state(self, key: Any) -> Any:
        """The key as JSON for a checkpoint (`load_key` reads it back)."""
        ...

    def load_key(self, state: Any) -> Any: ...

    def batch_metrics(self, samples: list[Sample], ended: collections.Counter) -> dict[str, float]:
        """The program's own metrics of a batch (`samples`: the consumed groups'; `ended`: state -> groups that
        ended since the last batch), and its counters since the last batch (`rollout/failed`, ...)."""
        ...


class Play:
    """What a program may do while playing one group: generate through the router (with the run's seeding,
    rounds and partial-rollout mode), lease a worker, report progress and state."""

    def __init__(self, core: RolloutCore, group: Group, round: Round | None, seed_key: tuple, evaluating: bool,
                 tag: str):
        self.core, self.group, self.round, self.seed_key = core, group, round, seed_key
        self.evaluating, self.tag = evaluating, tag

    @property
    def seed(self) -> int:
        return self.core.settings.seed

    @property
    def deterministic(self) -> bool:
        return self.core.settings.deterministic

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, worker: int | None = None,
                       order: tuple = (), seed_key: tuple | None = None,
                       vision: Any = None) -> tuple[Completion, int]:
        """`params.n` completions of `prompt_ids` (with its images, `vision`). With `seed_key`, the request samples with
        `derive_seed(run seed, *seed_key)`. In `resubmit` mode an unfinished sample that a weight update
        aborted continues from its tokens (same worker, seeded by `seed_key` + its slot and length) and comes
        back joined."""
        if seed_key is not None:
            params = replace(params, seed=derive_seed(self.seed, *seed_key))
        completion, worker = await self.core.router.generate(
            self.tag, prompt_ids, params, worker=worker, owner=self.group,
            round=self.round, order=order, on_dispatch=self._dispatched, vision=vision)
        self.core.count_tokens(completion.outputs)
        if self.core.settings.partial_rollout != "resubmit" or self.evaluating:
            return completion, worker
        outputs = list(completion.outputs)
        await asyncio.gather(*(self._continue(outputs, slot, prompt_ids, params, worker, seed_key, vision)
                               for slot, output in enumerate(outputs) if output.finish_reason == "abort"))
        return Completion(completion.request_id, outputs, completion.metadata), worker

    async def _continue(self, outputs: list[CompletionOutput], slot: int, prompt_ids: list[int],
                        params: SamplingParams, worker: int, seed_key: tuple | None, vision: Any = None) -> None:
        """Resubmit sample `slot` as its prompt plus its tokens so far until it ends (or the group is cut or the
        core closes)."""
        while outputs[slot].finish_reason == "abort" and not (self.group.cut or self.core.closing):
            prefix = outputs[slot]
            remaining = params.max_new_tokens - len(prefix.token_ids)
            if remaining <= 0:  # it was aborted on its last token
                prefix.finish_reason = "length"
                return
            more_params = replace(params, n=1, max_new_tokens=remaining,
                                  min_new_tokens=max(0, params.min_new_tokens - len(prefix.token_ids)))
            if seed_key is not None:
                more_params = replace(more_params, seed=derive_seed(self.seed, *seed_key, slot, len(prefix.token_ids)))
            self.core.resubmitted += 1
            completion, _ = await self.core.router.generate(
                self.tag, prompt_ids + prefix.token_ids, more_params, worker=worker,
                owner=self.group, vision=vision)
            more = completion.outputs[0]
            self.core.count_tokens([more])
            outputs[slot] = CompletionOutput(prefix.token_ids + more.token_ids, prefix.logprobs + more.logprobs,
                                             prefix.policy_versions + more.policy_versions, more.finish_reason)

    def lease(self) -> int:
        return self.core.router.lease()

    def release(self, worker: int) -> None:
        self.core.router.release(worker)

    def leave(self) -> None:
        """A round member of this group is done (programs call it once per `participants`)."""
        if self.round is not None:
            self.core.router.leave_round(self.round)

    def progress(self) -> None:
        """Something other than generation came back (a score, an env step)."""
        self.core.router.progress()

    def scoring(self) -> None:
        self.group.state = GroupState.SCORING

    def _dispatched(self) -> None:
        if self.group.state == GroupState.QUEUED:
            self.group.state = GroupState.GENERATING
            self.core.dispatched(self.group)


class RolloutCore:
    """Plays groups of `program` drawn from `source` on `workers` (see the module docstring).

    Args:
        workers: `RolloutWorker` handles (the only ones any program generates on).
        program: what one group is.
        source: the training keys (`take(count)`, `state()`, `load_state()`); None: eval only.
        settings: the policy's knobs.
    """

    def __init__(self, workers: list, program: GroupProgram, source: Source | None, settings: CoreSettings):
        self.program, self.source, self.settings = program, source, settings
        self.router = EngineRouter(workers, settings.max_in_flight)
        self.closing = False
        self.resubmitted = 0
        self._queue: collections.deque[Group] = collections.deque()  # drawn, not started
        self._long_queue: collections.deque[Group] = collections.deque()
        self._live: dict[Group, asyncio.Task] = {}
        self._undispatched: set[Group] = set()  # playing, but no request sent yet (`_launch` counts them)
        self._ready: list[Group] = []
        self._quota = 0
        self._next_index = 0
        self._group_ids = iter(range(1 << 62))
        self._eval_group_ids = iter(range(1 << 62))
        self._requested = 0
        self._refills = 0
        self._bound_hit = False
        self._ended: collections.Counter = collections.Counter()
        self._dropped: list[Sample] = []
        self._wasted_tokens = 0
        self._generated_tokens = 0
        self._generated_lengths: list[int] = []  # response lengths of the samples finished since the last step
        self._reward_wait = 0.0  # waiting for scores with nothing left generating
        self._error: BaseException | None = None
        self._last_handout = time.perf_counter()
        self._changed: asyncio.Event | None = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollflow-rollout", daemon=True)
        self._thread.start()

    # ---- the driver's side (any thread) --------------------------------------------------------------------

    def next_batch(self, step: int, policy_version: int) -> RolloutResult:
        """Block until `groups_per_step` ready groups can be handed out (or fewer, once the refill bound is hit
        and nothing more can come), and hand them out.

        Args:
            step: the training step the batch is for (long rounds fall on `long_round_every` multiples).
            policy_version: the version of the weights the trainer updates with this batch; with
                `staleness_control: drop`, groups whose oldest token is more than `max_staleness` versions older
                are dropped (`stale`).
        """
        return self._run(self._next_batch(step, policy_version))

    def evaluate(self, keys: list[Any], program: GroupProgram, seed_key: tuple = ()) -> list[Sample]:
        """Play one group per key with `program` (an eval program: greedy, no filters; no quota, no
        staleness), every sample in key order. `seed_key` distinguishes this eval's seeds, e.g. `("eval", step)`."""
        return self._run(self._evaluate(keys, program, seed_key))

    def weights_updated(self) -> None:
        """New weights reached the engines. `resubmit`: abort what is generating; each unfinished sample
        continues from its tokens (`continue`: nothing to do, the engines switch between tokens)."""
        if self.settings.partial_rollout == "resubmit":
            self._run(self._abort_live())

    def state(self) -> dict:
        """What a checkpoint keeps: the source's position and every key drawn but not yet handed out (queued,
        playing, ready or waiting for a long round), to be played again on resume."""
        return self._run(self._state())

    def load_state(self, state: dict) -> int:
        """Resume: the source's position; the keys that were in flight are queued again first (what was
        generated of them before the checkpoint is lost). Returns how many keys that is."""
        return self._run(self._load_state(state))

    def close(self) -> None:
        """Cancel every group (aborting its requests on the engines) and stop the loop."""
        if not self.loop.is_running():
            return
        try:
            self._run(self._cancel_all(), timeout_s=30)
        except Exception:  # noqa: BLE001  (closing: nothing left to report to)
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    def _run(self, coroutine: Coroutine, timeout_s: float | None = None) -> Any:
        if not self.loop.is_running():  # closed: a coroutine sent to the stopped loop would wait forever
            coroutine.close()
            raise RuntimeError("the rollout core is closed: nothing can play on it any more")
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    # ---- what the program's `Play` reports --------------------------------------------------------------------

    def count_tokens(self, outputs: list[CompletionOutput]) -> None:
        self._generated_tokens += sum(len(o.token_ids) for o in outputs)

    def dispatched(self, group: Group) -> None:
        """A queued group sent its first request: the source may refill the queue."""
        self._undispatched.discard(group)
        self._launch()

    # ---- a training step (on the loop) ------------------------------------------------------------------------

    async def _next_batch(self, step: int, policy_version: int) -> RolloutResult:
        started = time.perf_counter()
        long_round = self._plan_batch(step)
        while True:
            self._raise_error()
            self._launch()
            if not self.settings.in_draw_order:
                self._drop_stale(policy_version)
            batch = self._take_batch(long_round)
            if batch is not None:
                break
            await self._wait_for_change()
        if not self.settings.max_staleness:  # synchronous: nothing of this step runs into the trainer's turn
            await self._settle()
        return self._result(batch, policy_version, long_round, time.perf_counter() - started)

    def _plan_batch(self, step: int) -> bool:
        """Open the quota of keys the coming batch may draw; returns whether it is a long round."""
        settings = self.settings
        self._requested += 1
        self._refills, self._bound_hit = 0, False
        long_round = settings.tail_batching and bool(self._long_queue) and (
            (settings.long_round_every > 0 and step % settings.long_round_every == 0)
            or len(self._long_queue) >= settings.groups_per_step)
        if long_round:  # the long queue first, fresh keys for the rest, nothing over-provisioned
            while self._long_queue and len(self._queue) < settings.groups_per_step:
                self._queue.appendleft(self._long_queue.pop())
            self._quota = max(0, settings.groups_per_step - len(self._queue))
        elif settings.max_staleness:  # run up to K steps ahead
            ahead = settings.max_staleness if self._requested == 1 else 0
            self._quota += (1 + ahead) * settings.launched_per_step
        else:
            self._quota = max(0, settings.launched_per_step - len(self._queue))
        return long_round

    def _launch(self) -> None:
        """Draw what the quota allows (at most one step's launch waiting to be sent: a quota of many steps is
        drawn as the queue empties), and start the queued groups: in rounds, a whole round at once when
        nothing plays."""
        if self.closing or self.source is None:
            return
        # a set, not a scan of `_live`: this runs at every group's first request (16k samples a step: 2k groups)
        waiting = len(self._queue) + len(self._undispatched)
        count = min(self._quota, self.settings.launched_per_step - waiting)
        if count > 0:
            self._quota -= count
            for key in self.source.take(count):
                self._queue.append(self._new_group(key, self._next_index))
                self._next_index += 1
        if not self._queue or (self.settings.rounds and self._live):
            return
        round = Round() if self.settings.rounds else None
        groups = list(self._queue)
        self._queue.clear()
        for group in groups:
            if round is not None:
                round.join(self.program.participants(group))
        for group in groups:
            play = Play(self, group, round, ("train",), False, self.program.tag)
            self._undispatched.add(group)
            self._live[group] = self.loop.create_task(self._play(group, play))

    async def _play(self, group: Group, play: Play) -> None:
        try:
            state = await self.program.play(group, play)
        except asyncio.CancelledError:
            return
        except BaseException as err:  # noqa: BLE001 - it reaches the driver at its next batch
            self._error = self._error or err
            self._live.pop(group, None)
            self._notify()
            return
        finally:  # however it ended, it no longer waits to send its first request
            self._undispatched.discard(group)
        self._live.pop(group, None)
        self._ended_playing(group, state)
        self._notify()
        self._launch()

    def _ended_playing(self, group: Group, state: GroupState) -> None:
        if state == GroupState.ABORTED:
            self._wasted_tokens += group.tokens()
            self._end(group, GroupState.ABORTED)
            self._long_queue.append(self._new_group(group.key, group.index, long=True))
            return
        self._generated_lengths += [len(s.response_ids) for s in group.samples]
        if state == GroupState.READY:
            group.state, group.ready_at = GroupState.READY, time.perf_counter()
            self._ready.append(group)
        else:  # filtered, failed: replaced within the refill bound
            self._end(group, state)
            for sample in usable(group.samples):  # a dropped group trains nothing (`usable()` leaves it out)
                sample.status = SampleStatus.FILTERED
            self._dropped.extend(group.samples)
            self._refill()

    def _take_batch(self, long_round: bool) -> list[Group] | None:
        """The batch if it can be handed out now: P ready groups, or fewer once nothing more can come.

        In draw order (staleness bounded at admission) only the ready groups drawn before every group still queued
        or playing may go: a slow group holds the batch back while the groups after it keep generating. Otherwise
        the stalest first in asynchronous mode (they would be dropped next), else in stream order."""
        settings, wanted = self.settings, self.settings.groups_per_step
        if settings.in_draw_order:
            self._ready.sort(key=lambda g: g.index)
            pending = min((g.index for g in (*self._queue, *self._live)), default=math.inf)
            takeable = sum(g.index < pending for g in self._ready)  # a prefix of the sorted list
        else:
            self._ready.sort(key=lambda g: ((g.oldest_version() or 0) if settings.max_staleness else 0, g.index))
            takeable = len(self._ready)
        if takeable < wanted:
            if self._quota or self._queue or self._live:
                return None
            self._bound_hit = True  # nothing more can come: the step trains on fewer groups
        count = min(takeable, wanted)
        batch, self._ready = self._ready[:count], self._ready[count:]
        for group in batch:
            self._end(group, GroupState.CONSUMED)
        if settings.tail_batching and not long_round:  # the slowest groups of this step give way
            for group in self._live:
                group.cut = True
                self.router.abort_owner(group)
        return batch

    async def _settle(self) -> None:
        """Synchronous steps: wait for cut and still-playing groups, and put back what this step did not use
        (its keys are played again next step, by the new weights)."""
        while self._live:
            self._raise_error()
            await self._wait_for_change()
        self._raise_error()
        leftovers, self._ready = self._ready, []
        for group in sorted(leftovers, key=lambda g: g.index, reverse=True):
            self._wasted_tokens += group.tokens()
            self._ended[GroupState.ABORTED] += 1
            self._queue.appendleft(self._new_group(group.key, group.index, group.long))

    def _drop_stale(self, policy_version: int) -> None:
        """Asynchronous mode: drop the ready groups whose oldest token is more than `max_staleness` versions
        behind `policy_version`."""
        bound = self.settings.max_staleness
        if not bound:
            return
        for group in list(self._ready):
            oldest = group.oldest_version()  # None: no tokens (0 is a version)
            if oldest is not None and policy_version - oldest > bound:
                self._ready.remove(group)
                self._wasted_tokens += group.tokens()
                self._end(group, GroupState.STALE)
                self._refill()

    def _refill(self) -> None:
        """One more key for a dropped group, within `max_refill_groups` per step."""
        if self._refills < self.settings.max_refill_groups:
            self._refills += 1
            self._quota += 1
        else:
            self._bound_hit = True

    def _result(self, batch: list[Group], policy_version: int, long_round: bool, waited: float) -> RolloutResult:
        samples = [s for g in batch for s in g.samples]
        trained = usable(samples)
        staleness = [policy_version - v for v in map(oldest_version, trained) if v is not None]
        now = time.perf_counter()
        since_last, self._last_handout = now - self._last_handout, now
        ready = sorted(max(g.ready_at, now - waited) for g in batch)  # now - waited: when the driver asked
        metrics = {f"rollout/groups/{state.value}": float(self._ended[state]) for state in ENDED}
        held = collections.Counter(g.state for g in [*self._queue, *self._live, *self._ready])
        metrics.update({f"rollout/groups/{state.value}": float(held[state]) for state in HELD})
        metrics.update({
            "time/rollout": waited,
            "rollout/refill_groups": float(self._refills),
            "rollout/refill_bound_hit": float(self._bound_hit),
            "rollout/wasted_tokens": float(self._wasted_tokens),
            "rollout/long_round": float(long_round),
            # the wait for the batch's last tenth of groups, once the rest were ready (the long tail)
            "rollout/tail_wait_seconds": tail_wait(ready),
            "rollout/long_queue": float(len(self._long_queue)),
            "rollout/resubmitted_samples": float(self.resubmitted),
            "rollout/tokens_per_second": self._generated_tokens / max(since_last, 1e-9),
            "time/reward_wait": self._reward_wait,
            **self.program.batch_metrics(samples, self._ended),
        })
        if trained:
            metrics["rollout/trained_response_len_mean"] = statistics.fmean(len(s.response_ids) for s in trained)
            # sampled by more than one policy version: new weights reached it mid-response (partial rollout)
            metrics["rollout/mixed_version_frac"] = statistics.fmean(len(set(s.policy_versions)) > 1 for s in trained)
        if self._generated_lengths:
            metrics["rollout/generated_response_len_mean"] = statistics.fmean(self._generated_lengths)
        metrics["rollout/stale_dropped"] = float(self._ended[GroupState.STALE])
        if staleness:
            metrics["staleness/mean"] = statistics.fmean(staleness)
            metrics["staleness/max"] = float(max(staleness))
            for k in range(min(self.settings.max_staleness, STALENESS_FRACTIONS) + 1):
                metrics[f"staleness/frac_{k}"] = sum(s == k for s in staleness) / len(staleness)
        samples = samples + self._dropped
        self._ended.clear()
        self._dropped, self._wasted_tokens, self._generated_tokens, self.resubmitted = [], 0, 0, 0
        self._generated_lengths = []
        self._reward_wait = 0.0
        return RolloutResult(samples, metrics)

    # ---- eval, state, closing (on the loop) --------------------------------------------------------------------

    async def _evaluate(self, keys: list[Any], program: GroupProgram, seed_key: tuple) -> list[Sample]:
        groups = [Group(key, index, next(self._eval_group_ids)) for index, key in enumerate(keys)]
        round = Round() if self.settings.deterministic or self.settings.lockstep else None
        for group in groups:
            if round is not None:
                round.join(program.participants(group))
        tasks = [asyncio.ensure_future(program.play(group, Play(self, group, round, seed_key, True, program.tag)))
                 for group in groups]
        try:
            await self._watched(asyncio.gather(*tasks))
        except BaseException:
            await _cancel_all(tasks)
            raise
        return [sample for group in groups for sample in group.samples]

    async def _watched(self, awaitable) -> Any:
        """`awaitable`, under the watchdog."""
        task = asyncio.ensure_future(awaitable)
        while True:
            done, _ = await asyncio.wait({task}, timeout=1.0)
            if done:
                return task.result()
            self._check_watchdog()

    async def _abort_live(self) -> None:
        for group in self._live:
            self.router.abort_owner(group)

    async def _state(self) -> dict:
        held = sorted([*self._queue, *self._live, *self._ready, *self._long_queue], key=lambda g: g.index)
        return {"sampler": self.source.state(), "next_index": self._next_index,
                "pending": [{"prompt": self.program.key_state(g.key), "index": g.index, "long": g.long}
                            for g in held]}

    async def _load_state(self, state: dict) -> int:
        self.source.load_state(state["sampler"])
        self._next_index = state["next_index"]
        for entry in state["pending"]:
            group = self._new_group(self.program.load_key(entry["prompt"]), entry["index"], entry["long"])
            (self._long_queue if group.long else self._queue).append(group)
        if self.settings.max_staleness:  # they were drawn ahead of the steps to come: part of the K steps' quota
            self._quota -= len(self._queue)
        return len(state["pending"])

    async def _cancel_all(self) -> None:
        self.closing = True
        await _cancel_all(list(self._live.values()))

    # ---- waiting ----------------------------------------------------------------------------------------------

    async def _wait_for_change(self) -> None:
        """Until a group ends (or a second passes: the watchdog looks then)."""
        event = self._changed_event()
        event.clear()
        only_scoring = not self.router.outstanding and any(g.state == GroupState.SCORING for g in self._live)
        waited = time.perf_counter()
        try:
            await asyncio.wait_for(event.wait(), timeout=1.0)
        except asyncio.TimeoutError:
            self._check_watchdog()
        if only_scoring:  # what model rewards (and slow plain ones) add to a step
            self._reward_wait += time.perf_counter() - waited

    def _check_watchdog(self) -> None:
        if time.monotonic() - self.router.last_progress <= self.settings.watchdog_s:
            return
        generating = self.router.generating()
        parts = [f"actor_infer worker {w} ({n} requests generating)" for w, n in sorted(generating.items())]
        scoring = sum(g.state == GroupState.SCORING for g in self._live)
        if scoring:
            parts.append(f"rewards of {scoring} groups")
        if not parts:
            parts.append(f"{len(self._live)} groups between requests (env steps, rewards)")
        raise StalledError(f"no progress for {self.settings.watchdog_s:g} s in phase rollout: waiting on "
                           f"{', '.join(parts)} (cluster.watchdog_s)")

    def _notify(self) -> None:
        self.router.progress()
        self._changed_event().set()

    def _changed_event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _new_group(self, key: Any, index: int, long: bool = False) -> Group:
        return Group(key, index, next(self._group_ids), long)

    def _end(self, group: Group, state: GroupState) -> None:
        group.state = state
        self._ended[state] += 1


async def _cancel_all(tasks) -> None:
    """Cancel `tasks` and wait until each has ended (none is left pending, whose `finally` would then call a
    worker after Ray has shut down)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def tail_wait(ready: list[float]) -> float:
    """From the sorted times a batch's groups were ready: how long the last tenth of them (at least one) took
    once the rest were ready; 0 for a batch of one group."""
    last = max(1, round(0.1 * len(ready)))
    return ready[-1] - ready[-1 - last] if len(ready) > last else 0.0


def oldest_version(sample: Sample) -> int | None:
    """The policy version of a sample's oldest model token (None: no model tokens)."""
    versions = [v for v in sample.policy_versions if v >= 0]
    return min(versions) if versions else None

