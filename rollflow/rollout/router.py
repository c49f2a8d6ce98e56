"""The one place that calls engine workers: routing, rounds, aborts, and what a failed worker call becomes.

`EngineRouter` lives on the rollout core's event loop (rollflow/rollout/core.py). Every request of every group
program (a prompt group, an episode's turns, an eval prompt) goes through `generate`:

* **least loaded under a cap**: a request goes to the worker with the fewest samples in flight among those
  holding fewer than `max_in_flight` requests; the rest wait for a worker to free up;
* **sticky**: a caller that names a worker (an episode keeps its engine, whose prefix cache holds its turns;
  a resubmitted sample returns to the worker that has its prompt) waits for that worker's capacity;
* **rounds**: callers that share a `Round` are released together once every member has arrived, sorted by
  their `order`, and each worker gets its share as one `generate_batch` call (request `i` of the round goes
  to worker `i % W`, or to the worker it names), so no batch composition, and so no float, depends on
  timing. A round is also the lockstep barrier of the synchronous batch-of-envs baseline;
* **cancel = abort**: a caller cancelled while its request runs aborts the request on its engine.

`await_worker` maps what a worker call raises to one line naming the role, the worker and the method; env
calls go through it too.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollflow.cluster.calls import map_ray_error
from rollflow.engines.base import Completion, GenerationRequest, SamplingParams


async def await_worker(ref: Any, role: str, index: int, method: str, timeout_s: float | None = None) -> Any:
    """The result of a worker call (a Ray ObjectRef, or a coroutine of an in-process stand-in).

    Raises:
        asyncio.TimeoutError: nothing came back within `timeout_s` (None: no limit); the caller decides.
        RollflowError: the worker died (`WorkerDiedError`), raised (`WorkerError`, its traceback in
            `details`) or raised a `RollflowError` of its own.
    """
    try:
        return await asyncio.wait_for(_awaited(ref), timeout_s) if timeout_s else await _awaited(ref)
    except (asyncio.CancelledError, asyncio.TimeoutError):
        raise
    except Exception as err:
        raise map_ray_error(err, role, index, method) from None


async def _awaited(ref: Any) -> Any:
    return await ref if hasattr(ref, "__await__") else ref


def fire(call: Any) -> None:
    """Send a call whose answer nobody waits for (an abort): a coroutine of an in-process stand-in is
    scheduled; a Ray ObjectRef is already on its way."""
    if asyncio.iscoroutine(call):
        asyncio.ensure_future(call)


@dataclass(eq=False)
class Round:
    """Callers whose requests go out together: released when every active member waits with one."""

    active: int = 0
    waiting: list[_Waiting] = field(default_factory=list)

    def join(self, count: int = 1) -> None:
        self.active += count


@dataclass(eq=False)
class _Waiting:
    tag: str
    order: tuple
    prompt_ids: list[int]
    params: SamplingParams
    worker: int | None
    owner: Any
    future: asyncio.Future
    request_id: str = ""
    vision: Any = None  # the prompt's images (`rollflow.data.vision.VisionInputs`)


class EngineRouter:
    """Routes generation requests to engine workers (see the module docstring).

    Args:
        workers: `RolloutWorker` handles (`generate`, `generate_batch`, `abort`).
        max_in_flight: most requests one worker holds outside rounds (`roles.actor_infer.max_in_flight_requests`).
    """

    def __init__(self, workers: list, max_in_flight: int = 64):
        self.workers, self.max_in_flight = workers, max_in_flight
        self.load = [0] * len(workers)  # samples in flight per worker
        self.requests = [0] * len(workers)  # requests in flight per worker (capped)
        self.leases = [0] * len(workers)  # callers holding a worker (episodes)
        self.outstanding: dict[str, tuple[int, Any]] = {}  # request id -> (worker, owner)
        self.last_progress = time.monotonic()
        self._ids: dict[str, itertools.count] = {}
        self._freed: asyncio.Event | None = None

    # ---- routing -------------------------------------------------------------------------------------------

    def lease(self) -> int:
        """A worker for a caller that will send it many requests (an episode): the one held by the fewest."""
        worker = min(range(len(self.workers)), key=lambda w: (self.leases[w], self.load[w]))
        self.leases[worker] += 1
        return worker

    def release(self, worker: int) -> None:
        self.leases[worker] -= 1

    async def generate(self, tag: str, prompt_ids: list[int], params: SamplingParams, *, worker: int | None = None,
                       owner: Any = None, round: Round | None = None, order: tuple = (),
                       on_dispatch: Callable[[], None] | None = None, vision: Any = None) -> tuple[Completion, int]:
        """Generate `params.n` completions of `prompt_ids`. Returns (the completion, the worker that made it).

        Args:
            tag: the request id's prefix (`train`, `eval`, `env`).
            worker: the worker to use (sticky); None: the least loaded under the cap (in a round: by order).
            owner: what the request belongs to (a group), for `abort_owner`.
            round: send with the other members of this round (see `Round`).
            order: the request's place in its round.
            on_dispatch: called when the request leaves for its worker.
            vision: the prompt's images (`VisionInputs`), for a vision-language model.
        """
        if round is not None:
            return await self._in_round(round, _Waiting(tag, order, prompt_ids, params, worker, owner,
                                                        asyncio.get_running_loop().create_future(),
                                                        vision=vision), on_dispatch)
        while True:
            open_workers = [w for w in range(len(self.workers)) if self.requests[w] < self.max_in_flight]
            if worker is None and open_workers:
                worker = min(open_workers, key=self.load.__getitem__)
                break
            if worker is not None and worker in open_workers:
                break
            await self._capacity()
        request = GenerationRequest(self._new_id(tag), prompt_ids, params, vision)
        self.load[worker] += params.n
        self.requests[worker] += 1
        self.outstanding[request.request_id] = (worker, owner)
        if on_dispatch:
            on_dispatch()
        try:
            completion = await await_worker(self.workers[worker].generate.remote(request), "actor_infer", worker,
                                            "generate")
        except asyncio.CancelledError:
            self.abort([request.request_id])
            raise
        finally:
            self.load[worker] -= params.n
            self.requests[worker] -= 1
            self.outstanding.pop(request.request_id, None)
            self.progress()
            self._freed_event().set()
        return completion, worker

    async def _in_round(self, round: Round, waiting: _Waiting, on_dispatch) -> tuple[Completion, int]:
        round.waiting.append(waiting)
        self.release_round(round)
        try:
            completion, worker = await waiting.future
        except asyncio.CancelledError:
            if waiting.request_id:  # sent: abort it on its engine
                self.abort([waiting.request_id])
            elif waiting in round.waiting:
                round.waiting.remove(waiting)
            raise
        if on_dispatch:
            on_dispatch()
        return completion, worker

    def leave_round(self, round: Round) -> None:
        """A member of `round` is done: the others may no longer wait for it."""
        round.active -= 1
        self.release_round(round)

    def release_round(self, round: Round) -> None:
        """Send the round's requests once every active member waits: one `generate_batch` per worker."""
        if not round.waiting or len(round.waiting) < round.active:
            return
        members = sorted(round.waiting, key=lambda w: w.order)
        round.waiting = []
        shares: dict[int, list[_Waiting]] = {}
        for position, member in enumerate(members):
            shares.setdefault(position % len(self.workers) if member.worker is None else member.worker,
                              []).append(member)
        for worker in sorted(shares):
            batch = shares[worker]
            requests = []
            for member in batch:
                member.request_id = self._new_id(member.tag)
                self.outstanding[member.request_id] = (worker, member.owner)
                requests.append(GenerationRequest(member.request_id, member.prompt_ids, member.params, member.vision))
            asyncio.ensure_future(self._send_batch(worker, batch, requests))

    async def _send_batch(self, worker: int, batch: list[_Waiting], requests: list[GenerationRequest]) -> None:
        try:
            completions = await await_worker(self.workers[worker].generate_batch.remote(requests), "actor_infer",
                                             worker, "generate")
        except Exception as err:  # noqa: BLE001 - every member of the batch gets the error
            for member in batch:
                if not member.future.done():
                    member.future.set_exception(err)
            return
        finally:
            for request in requests:
                self.outstanding.pop(request.request_id, None)
            self.progress()
        for member, completion in zip(batch, completions):
            if not member.future.done():
                member.future.set_result((completion, worker))

    # ---- aborts and progress ---------------------------------------------------------------------------------

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests on their engines (they answer with what they generated, `finish_reason="abort"`)."""
        by_worker: dict[int, list[str]] = {}
        for request_id in request_ids:
            if request_id in self.outstanding:
                by_worker.setdefault(self.outstanding[request_id][0], []).append(request_id)
        for worker, ids in sorted(by_worker.items()):
            fire(self.workers[worker].abort.remote(ids))

    def abort_owner(self, owner: Any) -> None:
        """Abort every request `owner` has running."""
        self.abort([rid for rid, (_, held_by) in self.outstanding.items() if held_by is owner])

    def progress(self) -> None:
        """Something came back: the watchdog's clock starts again."""
        self.last_progress = time.monotonic()

    def generating(self) -> Counter:
        """Worker -> requests it is generating now (for the stall message)."""
        return Counter(worker for worker, _ in self.outstanding.values())

    def _new_id(self, tag: str) -> str:
        return f"{tag}-{next(self._ids.setdefault(tag, itertools.count()))}"

    async def _capacity(self) -> None:
        event = self._freed_event()
        event.clear()
        await event.wait()

    def _freed_event(self) -> asyncio.Event:
        if self._freed is None:
            self._freed = asyncio.Event()
        return self._freed
