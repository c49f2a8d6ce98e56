"""`env` role: a Ray actor that holds many environments and runs each one's steps under a time limit.

Every env lives in a slot with a thread of its own (envs need not be thread-safe; one slow env never blocks
another). `reset` and `step` run on that thread and are awaited with `env.step_timeout_s`: a step that
raises or runs past the limit ends the slot (its env is dropped; a hung thread is left behind as a daemon,
it can hold nothing the run needs) and comes back as an error record, never as an exception, so the driver
fails that one trajectory and goes on. Replies are plain tuples and dicts (cheap to send).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from rollflow.cluster.placement import WorkerPlacement
from rollflow.config import RunConfigBase
from rollflow.data.seeds import derive_seed
from rollflow.envs.base import Env, make_env
from rollflow.workers.base import PlacedWorker


class InjectedFault(RuntimeError):
    """The error an `env.fault_injection` hook raises."""


class HookedEnv:
    """An env whose every step first runs the test hooks: a simulated delay (`env.simulated_latency`), an
    injected fault (`env.fault_injection`)."""

    def __init__(self, env: Env, hooks: list[Callable[[], None]]):
        self.env, self.hooks = env, hooks

    def reset(self, seed: int | None = None):
        return self.env.reset(seed)

    def step(self, action: str):
        for hook in self.hooks:
            hook()
        return self.env.step(action)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)


def simulated_delay(median_s: float, sigma: float, rng: random.Random) -> Callable[[], None]:
    """A hook that sleeps a log-normal delay."""
    return lambda: time.sleep(median_s * math.exp(sigma * rng.gauss(0.0, 1.0)))


def injected_fault(raise_fraction: float, hang_fraction: float, hang_s: float,
                   rng: random.Random) -> Callable[[], None]:
    """A hook that raises on `raise_fraction` of steps and sleeps `hang_s` on `hang_fraction` of them."""

    def hook() -> None:
        draw = rng.random()
        if draw < raise_fraction:
            raise InjectedFault("injected fault: the env raised")
        if draw < raise_fraction + hang_fraction:
            time.sleep(hang_s)

    return hook


class _SlotThread:
    """One daemon thread that runs an env's calls in order (a hung call strands only this thread)."""

    def __init__(self, name: str):
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.calls.put((fn, future))
        return future

    def stop(self) -> None:
        self.calls.put(None)

    def _serve(self) -> None:
        while (item := self.calls.get()) is not None:
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as err:  # noqa: BLE001  (every env error goes back as a record)
                future.set_exception(err)


class EnvWorker(PlacedWorker):
    """Holds the run's envs in slots named by the driver (one slot per trajectory).

    Args:
        placement: where this worker runs (a CPU role).
        config: the run config (`env.*`).
    """

    def __init__(self, placement: WorkerPlacement, config: RunConfigBase):
        super().__init__(placement, config.cluster.device)
        self.env_config = config.env
        self.seed = config.seed
        self.index = placement.index
        self.slots: dict[str, tuple[Env, _SlotThread]] = {}
        self.stranded = 0  # slots whose thread hung past the limit (left behind)
        self.created = 0

    async def reset(self, slot: str, seed: int, eval_mode: bool = False) -> dict[str, Any]:
        """Make a fresh env in `slot` and reset it with `seed`.

        Returns:
            {"observation", "info", "seconds"}, or {"error": one line} when making or resetting it failed or
            ran past the time limit (the slot is gone then).
        """
        self.close_slot(slot)
        config = self.env_config
        kwargs = config.eval_kwargs if eval_mode and config.eval_kwargs is not None else config.kwargs
        thread = _SlotThread(f"env-{slot}")
        self.created += 1

        def make_and_reset():
            env = make_env(config.id, **kwargs)
            hooks = []
            latency, faults = config.simulated_latency, config.fault_injection
            if latency is not None:
                rng = random.Random(derive_seed(self.seed, "latency", self.index, self.created))
                hooks.append(simulated_delay(latency.median_s, latency.sigma, rng))
            if faults is not None and not eval_mode:
                rng = random.Random(derive_seed(self.seed, "faults", self.index, self.created))
                hooks.append(injected_fault(faults.raise_fraction, faults.hang_fraction, faults.hang_s, rng))
            if hooks:
                env = HookedEnv(env, hooks)
            observation, info = env.reset(seed=seed)
            return env, observation, info

        outcome = await self._run(slot, thread, make_and_reset, "reset")
        if "error" in outcome:
            return outcome
        env, observation, info = outcome["value"]
        self.slots[slot] = (env, thread)
        return {"observation": str(observation), "info": _plain(info), "seconds": outcome["seconds"]}

    async def step(self, slot: str, action: str) -> dict[str, Any]:
        """Step the env of `slot` with the model's text.

        Returns:
            {"observation", "reward", "terminated", "truncated", "info", "seconds"}, or {"error": one line}
            (an exception, a time-out, a non-finite reward, an unknown slot); the slot is gone after an error.
        """
        if slot not in self.slots:
            return {"error": f"env slot {slot!r} is not open (reset it first)"}
        env, thread = self.slots[slot]
        outcome = await self._run(slot, thread, lambda: env.step(action), "step")
        if "error" in outcome:
            return outcome
        try:
            observation, reward, terminated, truncated, info = outcome["value"]
            reward = float(reward)
        except (TypeError, ValueError) as err:
            self.close_slot(slot)
            return {"error": f"env step returned {_short(outcome['value'])}, not (observation, reward, "
                             f"terminated, truncated, info): {err}"}
        if not math.isfinite(reward):
            self.close_slot(slot)
            return {"error": f"env step returned a non-finite reward {reward}"}
        return {"observation": str(observation), "reward": reward, "terminated": bool(terminated),
                "truncated": bool(truncated), "info": _plain(info), "seconds": outcome["seconds"]}

    def close_slot(self, slot: str) -> None:
        """Drop the env of `slot` (its `close()` runs on its thread, not awaited)."""
        held = self.slots.pop(slot, None)
        if held is None:
            return
        env, thread = held
        close = getattr(env, "close", None)
        if callable(close):
            thread.submit(close)
        thread.stop()

    def close_slots(self, slots: list[str]) -> None:
        for slot in slots:
            self.close_slot(slot)

    def stats(self) -> dict[str, int]:
        """Open slots, envs made and threads left behind by hung steps."""
        return {"open": len(self.slots), "created": self.created, "stranded": self.stranded}

    async def _run(self, slot: str, thread: _SlotThread, fn: Callable[[], Any], what: str) -> dict[str, Any]:
        limit = self.env_config.step_timeout_s
        started = time.perf_counter()
        future = thread.submit(fn)
        try:
            value = await asyncio.wait_for(asyncio.wrap_future(future), timeout=limit)
        except asyncio.TimeoutError:
            self.stranded += 1
            self.slots.pop(slot, None)
            thread.stop()
            return {"error": f"env {what} ran past env.step_timeout_s = {limit:g} s"}
        except Exception as err:  # noqa: BLE001  (the env's own error fails its trajectory, not the run)
            self.close_slot(slot)
            thread.stop()
            lines = str(err).strip().splitlines()
            return {"error": f"env {what} raised {type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")}
        return {"value": value, "seconds": time.perf_counter() - started}

    def close(self) -> None:
        for slot in list(self.slots):
            self.close_slot(slot)


def _plain(info: Any) -> dict[str, Any]:
    """An env's info dict with what pickles cheaply (numbers, strings, bools, small lists); the rest as str."""
    if not isinstance(info, dict):
        return {}
    out = {}
    for key, value in info.items():
        out[str(key)] = value if isinstance(value, (int, float, str, bool, type(None))) else _short(value)
    return out


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
