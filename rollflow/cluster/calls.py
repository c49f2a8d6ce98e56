"""Waiting on worker calls: bounded by a watchdog, and every failure turned into one line that names the role,
the worker and the method.

The driver never calls `ray.get` on a worker's result without a bound. `get` waits on the refs of one call
(`method` on some workers of `role`) and raises, as soon as one of them fails or none of them returns for
`timeout_s` (`cluster.watchdog_s`):

- `StalledError` "no progress for 900 s: actor_train worker 0 has not returned from train";
- `WorkerDiedError` "actor_infer worker 0 died during generate (killed, or out of memory?); ..." when
  Ray reports the actor dead or unreachable;
- the worker's own error when it is a `RollflowError` (it already says what went wrong, in one line);
- `WorkerError` "actor_train worker 0 failed in train: ValueError: <first line>" for anything else, with
  the worker's full traceback in its `details`.

A caller that awaits worker calls itself (the rollout core's router) maps what it catches with `map_ray_error` and
builds its timeout error with `stalled_error`, so every wait reports the same way.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import NodeDiedError, OutOfMemoryError, RayActorError, RayTaskError, WorkerCrashedError

from rollflow.errors import RollflowError, StalledError, WorkerDiedError, WorkerError

DEFAULT_WATCHDOG_S = 900.0  # `cluster.watchdog_s`'s default
# What Ray raises when the process running a call is gone: the actor died (killed, OOM, crashed) or cannot
# be reached, its worker process crashed, or its node died.
DEATH_ERRORS = (RayActorError, WorkerCrashedError, NodeDiedError, OutOfMemoryError)


def get(refs: Sequence[ray.ObjectRef], role: str, method: str, indices: Sequence[int] | None = None,
        timeout_s: float = DEFAULT_WATCHDOG_S) -> list[Any]:
    """The results of `refs`, in order: the calls of `method` on workers `indices` of `role`.

    Results are fetched as they arrive, so the first failure raises at once, without waiting for the other
    workers; the watchdog restarts whenever one returns.

    Args:
        refs: one result ref per call.
        role, method: for messages.
        indices: the worker index each ref belongs to; None: ref `i` is worker `i`.
        timeout_s: most seconds without any of the calls returning.

    Returns:
        The results, in the order of `refs`.

    Raises:
        StalledError, WorkerDiedError, the worker's RollflowError or WorkerError (see the module docstring).
    """
    indices = list(range(len(refs))) if indices is None else list(indices)
    position = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
        if not ready:
            raise stalled_error(timeout_s, role, [indices[position[ref]] for ref in pending], method)
        more, pending = ray.wait(pending, num_returns=len(pending), timeout=0) if pending else ([], [])
        for ref in [*ready, *more]:
            index = indices[position[ref]]
            try:
                results[position[ref]] = ray.get(ref, timeout=timeout_s)  # ready: returns at once
            except ray.exceptions.GetTimeoutError:
                raise stalled_error(timeout_s, role, [index], method) from None
            except Exception as err:
                raise map_ray_error(err, role, index, method) from None
    return results


def map_ray_error(err: BaseException, role: str, index: int, method: str) -> RollflowError:
    """What a failed call of `method` on worker `index` of `role` raises, from the error `ray.get` gave.

    Returns:
        The worker's own RollflowError (unwrapped from Ray's RayTaskError); WorkerDiedError when the worker
        is gone; otherwise WorkerError whose `details` is the worker's full traceback.
    """
    if isinstance(err, RayTaskError):
        cause = err.cause
        if isinstance(cause, RollflowError):
            return cause
        # `ray.get` raises a subclass of both RayTaskError and the cause's class, whose text is the worker's
        # traceback under a header naming the process
        details = re.sub(r"\x1b\[[0-9;]*m", "", str(err))  # without Ray's terminal colours
        return WorkerError(f"{role} worker {index} failed in {method}: {one_line(cause)}", details=details)
    if isinstance(err, DEATH_ERRORS):
        return WorkerDiedError(f"{role} worker {index} died during {method} (killed, or out of memory?)",
                               details=str(err))
    if isinstance(err, RollflowError):
        return err
    details = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    return WorkerError(f"{role} worker {index} failed in {method}: {one_line(err)}", details=details)


def stalled_error(timeout_s: float, role: str, indices: Sequence[int], method: str) -> StalledError:
    """The error of a wait on `method` of workers `indices` of `role` that saw nothing return for `timeout_s`."""
    indices = sorted(indices)
    workers = (f"{role} worker {indices[0]} has" if len(indices) == 1
               else f"{role} workers {', '.join(map(str, indices))} have")
    return StalledError(f"no progress for {timeout_s:.0f} s: {workers} not returned from {method}")


def one_line(err: BaseException) -> str:
    """`Type: first line of the message` (just the type for an empty message)."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
