"""RLVR prompts as a one-turn env (`prompts`): the episode of seed `s` is row `s % len(rows)` of a prompt
dataset, the model's answer is scored by a reward function, and the episode ends.

Alone it is single-turn RLVR through the agentic pipeline; wrapped by the tool-use env (`tool_use`, its default
inner env) the model may call tools before it answers, so RLVR prompts are trained with tools.
"""

from __future__ import annotations

import threading
from typing import Any

from rollflow.data.prompts import load_rows
from rollflow.envs.base import ENVS, StepResult
from rollflow.errors import ConfigError
from rollflow.rewards.registry import ModelReward, resolve_reward

_ROWS: dict[tuple, list[dict[str, Any]]] = {}  # a process's datasets, loaded once (an env is made per episode)
_ROWS_LOCK = threading.Lock()


@ENVS.register("prompts")
class PromptEnv:
    """A prompt dataset's rows as one-turn episodes.

    Args:
        path: a JSONL / parquet file or dataset (as `data.train.path`); or
        task: a built-in synthetic task (`add2`, `sum3`), with `split`.
        split: the task's or dataset's split (`train`, `eval`).
        prompt_key: the prompt column (the observation).
        answer_key: the answer column (aliased as `answer`, which rewards read).
        reward: the reward function scoring the answer (a registered name or a dotted / file path); a reward
            that needs a worker (an LLM judge, a reward model) is not possible here.
        reward_kwargs: the reward's options.
        success_threshold: a reward at or above it is a success (`info["success"]`).
    """

    def __init__(self, path: str | None = None, task: str | None = None, split: str = "train",
                 prompt_key: str = "prompt", answer_key: str = "answer", reward: str = "math_answer",
                 reward_kwargs: dict[str, Any] | None = None, success_threshold: float = 1.0):
        if (path is None) == (task is None):
            raise ConfigError("env 'prompts' needs exactly one of path (a prompt dataset) and task (add2, sum3)")
        key = (path, task, split, prompt_key, answer_key)
        with _ROWS_LOCK:
            if key not in _ROWS:
                _ROWS[key] = load_rows(task, path, split, prompt_key=prompt_key, answer_key=answer_key)
        self.rows = _ROWS[key]
        self.prompt_key = prompt_key
        self.score = resolve_reward(reward, reward_kwargs or {})
        if isinstance(self.score, ModelReward):
            raise ConfigError(f"env 'prompts': reward {reward!r} needs a reward worker; give a reward function "
                              "(math_answer, exact_match, a dotted path)")
        self.reward_name = reward
        self.success_threshold = success_threshold
        self.row: dict[str, Any] = {}
        self.done = False

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """The row of `seed` (`seed % len(rows)`; None: the first) as the observation."""
        self.row = self.rows[(seed or 0) % len(self.rows)]
        self.done = False
        prompt = str(self.row[self.prompt_key])
        return prompt, {"success": False, "anchor": prompt}

    def step(self, action: str) -> StepResult:
        """Score the answer; the episode ends."""
        if self.done:
            return "", 0.0, True, False, {"success": False, "invalid_action": True}
        self.done = True
        reward = _value(self.score(action, **self.row))
        success = reward >= self.success_threshold
        outcome = "right answer" if success else f"reward {reward:g}; the answer: {self.row.get('answer', '?')}"
        return "", float(reward), True, False, {"success": success, "invalid_action": False, "outcome": outcome}

    def play_help(self) -> str:
        return f"answer the prompt; {self.reward_name} scores it"


def _value(score: Any) -> float:
    """A reward function's value: its float, or a dict's `reward` entry (else the sum of its entries), as the
    RLVR pipeline combines one reward (`rollflow.rewards.combine`)."""
    if isinstance(score, dict):
        return float(score["reward"]) if "reward" in score else float(sum(score.values()))
    return float(score)
