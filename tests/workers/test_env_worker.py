"""`EnvWorker` (called in-process) against envs that break the protocol: each breach fails its episode with a
one-line error that says what the env returned, and an env that cannot be made says it was its constructor."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import numpy as np
import pytest

from rollflow.cluster.placement import WorkerPlacement
from rollflow.config.agentic import AgenticConfig
from rollflow.workers.env import EnvWorker
from rollflow.workers.specs import env_spec

RESET_RELEASE = threading.Event()  # a "slow_reset" returns once this is set (or after a minute)


class BrokenEnv:
    """An env whose reset or step returns `bad` (a `mode` names what it breaks)."""

    def __init__(self, mode: str = "ok"):
        self.mode = mode
        if mode == "slow_constructor":
            time.sleep(0.6)  # as a first `import gem` in a worker

    def reset(self, seed=None):
        if self.mode == "slow_reset":  # slower than any limit, whatever the machine's speed
            RESET_RELEASE.wait(60)
        return {"reset_dict": ({"board": [1, 2]}, {}), "reset_none": (None, {}),
                "reset_bare": "just text"}.get(self.mode, ("start", {}))

    def step(self, action):
        return {"step_dict": ({"board": 1}, 1.0, True, False, {}),
                "four": ("x", 1.0, False, {}),
                "str_reward": ("x", "1.0", True, False, {}),
                "none_reward": ("x", None, True, False, {}),
                "nan": ("x", math.nan, True, False, {}),
                "numpy_reward": ("x", np.float32(0.5), True, False, {"success": np.bool_(False), "moves": np.int64(3)}),
                }.get(self.mode, ("done", 1.0, True, False, {"success": True}))


def make_broken(mode: str = "ok") -> BrokenEnv:
    return BrokenEnv(mode)


def worker(step_timeout_s: float = 30.0, **kwargs) -> EnvWorker:
    config = AgenticConfig.model_validate({"env": {"id": "tests.workers.test_env_worker:make_broken",
                                                   "kwargs": kwargs, "step_timeout_s": step_timeout_s}})
    return EnvWorker(WorkerPlacement("env", 0, (), None, (), 1), env_spec(config))


def play(env_worker: EnvWorker) -> tuple[dict, dict | None]:
    async def run():
        reset = await env_worker.reset("a", 0)
        return reset, (None if "error" in reset else await env_worker.step("a", "move"))
    return asyncio.run(run())


@pytest.mark.parametrize(("mode", "error"), [
    ("reset_dict", "env reset returned an observation of type dict ({'board': [1, 2]}), expected text (str): "
                   "render it as the text the model should read"),
    ("reset_none", "env reset returned an observation of type NoneType (None), expected text (str): render it as "
                   "the text the model should read"),
    ("reset_bare", "env reset returned 'just text', not (observation, info)"),
])
def test_a_reset_that_breaks_the_protocol_fails_the_episode(mode, error):
    reset, _ = play(worker(mode=mode))
    assert reset == {"error": error}


@pytest.mark.parametrize(("mode", "error"), [
    ("step_dict", "env step returned an observation of type dict ({'board': 1}), expected text (str): render it "
                  "as the text the model should read"),
    ("four", "env step returned ('x', 1.0, False, {}), not (observation, reward, terminated, truncated, info)"),
    ("str_reward", "env step returned a reward of type str ('1.0'), expected a number"),
    ("none_reward", "env step returned a reward of type NoneType (None), expected a number"),
    ("nan", "env step returned a non-finite reward nan"),
])
def test_a_step_that_breaks_the_protocol_fails_the_episode_and_closes_its_slot(mode, error):
    env_worker = worker(mode=mode)
    reset, step = play(env_worker)
    assert "observation" in reset and step == {"error": error}
    assert "a" not in env_worker.slots


def test_numpy_numbers_are_rewards_and_info_values():
    _, step = play(worker(mode="numpy_reward"))
    assert step["reward"] == 0.5 and type(step["reward"]) is float
    assert step["info"] == {"success": False, "moves": 3}  # not the text 'np.False_', which would count as success


def test_a_constructor_that_refuses_its_kwargs_is_named_and_its_traceback_kept():
    env_worker = worker(size=3)  # BrokenEnv takes no `size`
    reply = asyncio.run(env_worker.check())
    assert reply["error"] == ("env constructor raised TypeError: make_broken() got an unexpected keyword "
                              "argument 'size'")
    assert "Traceback" in reply["traceback"] and "make_broken" in reply["traceback"]
    # an env without tools(); its first observation, for the driver's check of the first turn against the context
    assert asyncio.run(worker(mode="ok").check()) == {"tools": [], "observation": "start", "images": None}
    assert asyncio.run(worker(mode="reset_none").check())["error"].startswith("env reset returned an observation")


def test_an_env_that_raises_keeps_its_traceback():
    env_worker = EnvWorker(WorkerPlacement("env", 0, (), None, (), 1), env_spec(AgenticConfig.model_validate(
        {"env": {"id": "frozenlake", "fault_injection": {"raise_fraction": 1.0}}})))
    reset, step = play(env_worker)
    assert step["error"] == "env step raised InjectedFault: injected fault: the env raised"
    assert step["traceback"].startswith("Traceback") and "InjectedFault" in step["traceback"]


def test_making_an_env_is_not_bound_by_the_step_limit_but_a_reset_is():
    reset, step = play(worker(step_timeout_s=0.3, mode="slow_constructor"))
    assert reset["observation"] == "start" and step["reward"] == 1.0
    RESET_RELEASE.clear()
    try:
        reset, _ = play(worker(step_timeout_s=0.3, mode="slow_reset"))
    finally:
        RESET_RELEASE.set()
    assert reset == {"error": "env reset ran past env.step_timeout_s = 0.3 s"}


def test_check_returns_the_env_s_tools_for_the_first_prompt(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1", "answer": "2"}\n')
    config = AgenticConfig.model_validate({"env": {"id": "tool_use", "kwargs": {
        "tools": ["calculator"], "env_kwargs": {"path": str(rows), "reward": "exact_match"}}}})
    tools = asyncio.run(EnvWorker(WorkerPlacement("env", 0, (), None, (), 1), env_spec(config)).check())["tools"]
    assert [tool["function"]["name"] for tool in tools] == ["calculator"]
