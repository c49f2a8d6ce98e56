"""`env` role: a Ray actor that holds many environments and runs each one's steps under a time limit.

Every env lives in a slot with a thread of its own (envs need not be thread-safe; one slow env never blocks
another). `reset` and `step` run on that thread and are awaited with `env.step_timeout_s`: a step that
raises or runs past the limit ends the slot (its env is dropped; a hung thread is left behind as a daemon,
it can hold nothing the run needs) and comes back as an error record, never as an exception, so the driver
fails that one trajectory and goes on. Replies are plain tuples and dicts (cheap to send).
"""

from __future__ import annotations

import asyncio
import math
import numbers
import random
import time
import traceback
from collections.abc import Callable
from typing import Any

from rollflow.cluster.placement import WorkerPlacement
from rollflow.data.seeds import derive_seed
from rollflow.envs.base import Env
from rollflow.envs.images import IMAGES_KEY, image_bytes
from rollflow.envs.make import make_env
from rollflow.envs.threads import EnvThread
from rollflow.workers.base import PlacedWorker
from rollflow.workers.specs import EnvSpec

MAKE_TIMEOUT_S = 120.0  # the least time limit of making an env (its package's import may come first)


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


class EnvWorker(PlacedWorker):
    """Holds the run's envs in slots named by the driver (one slot per trajectory).

    Args:
        placement: where this worker runs (a CPU role).
        spec: the `env` section and the run's seed (`rollflow.workers.specs.env_spec`).
    """

    def __init__(self, placement: WorkerPlacement, spec: EnvSpec):
        super().__init__(placement, spec.device)
        self.env_config = spec.env
        self.seed = spec.seed
        self.index = placement.index
        self.slots: dict[str, tuple[Env, EnvThread]] = {}
        self.stranded = 0  # slots whose thread hung past the limit (left behind)
        self.created = 0

    async def reset(self, slot: str, seed: int, eval_mode: bool = False) -> dict[str, Any]:
        """Make a fresh env in `slot` and reset it with `seed`.

        Returns:
            {"observation", "info", "seconds"}, or {"error": one line} when making or resetting it failed,
            ran past the time limit or returned something other than (observation text, info) (the slot is gone
            then); an exception's record also has its "traceback".
        """
        self.close_slot(slot)
        config = self.env_config
        kwargs = config.eval_kwargs if eval_mode and config.eval_kwargs is not None else config.kwargs
        thread = EnvThread(f"env-{slot}")
        self.created += 1

        def make():
            env = make_env(config.id, **kwargs)
            hooks = []
            latency, faults = config.simulated_latency, config.fault_injection
            if latency is not None:
                rng = random.Random(derive_seed(self.seed, "latency", self.index, self.created))
                hooks.append(simulated_delay(latency.median_s, latency.sigma, rng))
            if faults is not None and not eval_mode:
                rng = random.Random(derive_seed(self.seed, "faults", self.index, self.created))
                hooks.append(injected_fault(faults.raise_fraction, faults.hang_fraction, faults.hang_s, rng))
            return HookedEnv(env, hooks) if hooks else env

        # the first env of a worker may import its package (GEM: seconds), which is not a reset
        made = await self._run(slot, thread, make, "constructor", max(config.step_timeout_s, MAKE_TIMEOUT_S))
        if "error" in made:
            return made
        env = made["value"]
        outcome = await self._run(slot, thread, lambda: env.reset(seed=seed), "reset")
        if "error" in outcome:
            return outcome
        try:
            observation, info = _reset_result(outcome["value"])
        except EnvResultError as err:
            thread.submit(getattr(env, "close", lambda: None))
            thread.stop()
            return {"error": str(err)}
        self.slots[slot] = (env, thread)
        return {"observation": observation, "info": info, "seconds": made["seconds"] + outcome["seconds"]}

    async def step(self, slot: str, action: str) -> dict[str, Any]:
        """Step the env of `slot` with the model's text.

        Returns:
            {"observation", "reward", "terminated", "truncated", "info", "seconds"}, or {"error": one line}
            (an exception, a time-out, an unknown slot, or a result that is not (observation text, finite
            number, terminated, truncated, info)); the slot is gone after an error.
        """
        if slot not in self.slots:
            return {"error": f"env slot {slot!r} is not open (reset it first)"}
        env, thread = self.slots[slot]
        outcome = await self._run(slot, thread, lambda: env.step(action), "step")
        if "error" in outcome:
            return outcome
        try:
            reply = _step_result(outcome["value"])
        except EnvResultError as err:
            self.close_slot(slot)
            return {"error": str(err)}
        return {**reply, "seconds": outcome["seconds"]}

    async def check(self, eval_mode: bool = False) -> dict[str, Any]:
        """Make one env (train or eval kwargs) and reset it with seed 0, then drop it: what the driver asks
        before the first episode, so an env that cannot even be made (a constructor that refuses its kwargs)
        or reset stops the run with one line instead of failing every episode.

        Returns:
            {"tools": the env's tool specs (its `tools()`, JSON-schema dicts; [] when it has none), "observation":
            its first observation, "images": that observation's images (None: none)} when the env was made and
            reset (the driver checks that the first turn fits the context), else `reset`'s error record.
        """
        reply = await self.reset("check", 0, eval_mode)
        if "error" in reply:
            self.close_slot("check")
            return {key: value for key, value in reply.items() if key in ("error", "traceback")}
        env, thread = self.slots["check"]
        tools_of = getattr(env, "tools", None)
        outcome = await self._run("check", thread, tools_of if callable(tools_of) else list, "tools()")
        self.close_slot("check")
        if "error" in outcome:
            return outcome
        tools = outcome["value"]
        if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
            return {"error": f"env tools() returned {_short(tools)}, not a list of JSON-schema dicts"}
        return {"tools": tools, "observation": reply["observation"], "images": reply["info"].get(IMAGES_KEY)}

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

    async def _run(self, slot: str, thread: EnvThread, fn: Callable[[], Any], what: str,
                   limit: float | None = None) -> dict[str, Any]:
        """`fn` on the slot's thread within `limit` (default `env.step_timeout_s`): {"value", "seconds"}, or an
        error record naming `what` (the slot is gone then)."""
        limit = self.env_config.step_timeout_s if limit is None else limit
        started = time.perf_counter()
        future = thread.submit(fn)
        try:
            value = await asyncio.wait_for(asyncio.wrap_future(future), timeout=limit)
        except asyncio.TimeoutError:
            self.stranded += 1
            self.slots.pop(slot, None)
            thread.stop()
            bound = "env.step_timeout_s" if limit == self.env_config.step_timeout_s else "its time limit"
            return {"error": f"env {what} ran past {bound} = {limit:g} s"}
        except Exception as err:  # noqa: BLE001  (the env's own error fails its trajectory, not the run)
            self.close_slot(slot)
            thread.stop()
            lines = str(err).strip().splitlines()
            return {"error": f"env {what} raised {type(err).__name__}: {lines[0] if lines else ''}".rstrip(": "),
                    "traceback": "".join(traceback.format_exception(type(err), err, err.__traceback__))}
        return {"value": value, "seconds": time.perf_counter() - started}

    def close(self) -> None:
        for slot in list(self.slots):
            self.close_slot(slot)


class EnvResultError(ValueError):
    """An env's reset or step returned something the protocol does not allow (the message says what)."""


def _reset_result(value: Any) -> tuple[str, dict[str, Any]]:
    """(observation, info) from what `reset` returned, checked: the observation is text, never `str()` of an
    object the model would then be trained on."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise EnvResultError(f"env reset returned {_short(value)}, not (observation, info)")
    observation, info = value
    return _observation(observation, "reset"), _plain(info)


def _step_result(value: Any) -> dict[str, Any]:
    """The reply of a step from what `step` returned, checked (see `EnvWorker.step`)."""
    if not isinstance(value, (tuple, list)) or len(value) != 5:
        raise EnvResultError(f"env step returned {_short(value)}, not (observation, reward, terminated, "
                             "truncated, info)")
    observation, reward, terminated, truncated, info = value
    # a number, not text that happens to parse as one: a reward of "1" is an env bug
    if isinstance(reward, (str, bytes)) or not isinstance(reward, numbers.Real) and not hasattr(reward, "__float__"):
        raise EnvResultError(f"env step returned a reward of type {type(reward).__name__} ({_short(reward)}), "
                             "expected a number")
    try:
        reward = float(reward)
    except (TypeError, ValueError) as err:
        raise EnvResultError(f"env step returned a reward that is not a number ({_short(reward)}: {err})") from None
    if not math.isfinite(reward):
        raise EnvResultError(f"env step returned a non-finite reward {reward}")
    return {"observation": _observation(observation, "step"), "reward": reward, "terminated": bool(terminated),
            "truncated": bool(truncated), "info": _plain(info)}


def _observation(observation: Any, what: str) -> str:
    if not isinstance(observation, str):
        raise EnvResultError(f"env {what} returned an observation of type {type(observation).__name__} "
                             f"({_short(observation)}), expected text (str): render it as the text the model "
                             "should read")
    return observation


def _plain(info: Any) -> dict[str, Any]:
    """An env's info dict with what pickles cheaply (numbers, strings, bools, lists of strings); the rest as str."""
    if not isinstance(info, dict):
        return {}
    out = {}
    for key, value in info.items():
        if key == IMAGES_KEY and value is not None:  # an image observation's (`rollflow.envs.images`)
            try:
                out[key] = image_bytes(value)
            except ValueError as err:
                raise EnvResultError(str(err)) from None
            continue
        if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)):
            value = value.item()  # a numpy / torch scalar: its Python value (str() of np.False_ would be truthy)
        if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
            out[str(key)] = list(value)  # texts, such as a tool-use env's `tool_results`
        else:
            out[str(key)] = value if isinstance(value, (int, float, str, bool, type(None))) else _short(value)
    return out


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
