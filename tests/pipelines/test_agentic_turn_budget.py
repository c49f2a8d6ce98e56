"""The agentic run's checks of the turns' token budget before the first step: a system prompt or a first turn
that cannot fit the context is one line (`ConfigError`), too many full-length turns for the context a warning
with the numbers (`check_system_prompt_fits`, `check_envs`, `check_turn_budget`)."""

from __future__ import annotations

import asyncio
import json

import pytest

from rollflow.config.agentic import AgenticConfig
from rollflow.data.multiturn import TurnEncoder
from rollflow.errors import ConfigError
from rollflow.pipelines.agentic import check_envs, check_system_prompt_fits, check_turn_budget
from rollflow.rollout.env_groups import EpisodeSettings
from rollflow.rollout.episodes import TurnBudget
from tests.rollout.test_env_groups import TOKENIZER, Remote, env_worker


class _EnvGroup:
    """`check_envs`'s view of the env worker group, over one in-process `EnvWorker`."""

    def __init__(self, worker):
        self.handles = [Remote(worker)]

    def get(self, calls, what, indices):
        return [asyncio.run(call) for call in calls]


def _tool_env(tmp_path, prompt: str) -> dict:
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": prompt, "answer": "10063"}) + "\n")
    return {"id": "tool_use", "kwargs": {"tools": ["calculator"],
                                         "env_kwargs": {"path": str(rows), "reward": "exact_match"}}}


def _budget(env: dict, max_turns: int, max_new_tokens: int, context: int = 256):
    config = AgenticConfig.model_validate({"env": env})
    tools, first_observations = check_envs(_EnvGroup(env_worker(env)), config)
    encoder = TurnEncoder(TOKENIZER, None, tools)
    settings = EpisodeSettings(group_size=1, max_turns=max_turns, max_context_tokens=context)
    return check_turn_budget(encoder, first_observations, settings, max_new_tokens)


def test_tool_calls_that_crowd_out_the_later_turns_are_warned_of_with_the_numbers(tmp_path):
    # examples/agentic_tools.yaml on the tiny model: the first prompt is 33 tokens of system line, tools and
    # markers + "347*29" = 39; a later turn is 90 + 34 (the tool results' markers, the end of a full-length turn
    # included). Turn 2: 39 + 124 + 90 = 253 <= 256; turn 3: 39 + 248 + 90 = 377 > 256
    budget, warnings = _budget(_tool_env(tmp_path, "347*29"), max_turns=3, max_new_tokens=90)
    assert budget == TurnBudget(context=256, max_new_tokens=90, max_turns=3, prefix=33)
    assert warnings == [
        "env.max_turns is 3, but only 2 turns surely fit the context of 256 tokens: with env.kwargs, the first "
        "prompt (seed 0) takes 39 tokens and each later turn up to rollout.max_new_tokens = 90 plus 34 for the "
        "tool results' markers; an episode whose turns run that long ends truncated at the context limit, its last "
        "turn unplayed (rollout/context_truncated_frac). Lower rollout.max_new_tokens or env.max_turns, or use a "
        "model with a longer context"]
    assert _budget(_tool_env(tmp_path, "347*29"), max_turns=2, max_new_tokens=90)[1] == []


def test_a_first_turn_that_cannot_fit_the_context_is_one_line(tmp_path):
    # 33 + 140 = 173 tokens of first prompt, + 90 = 263 > 256
    with pytest.raises(ConfigError) as raised:
        _budget(_tool_env(tmp_path, "9" * 140), max_turns=2, max_new_tokens=90)
    assert str(raised.value) == (
        "the first turn does not fit the context: with env.kwargs, the first prompt (seed 0) has 173 tokens (33 of "
        "them the system prompt, tools and chat markers), and with rollout.max_new_tokens = 90 that is over the "
        "context of 256 tokens (rollout.max_context_tokens, default the model's); lower rollout.max_new_tokens, "
        "shorten env.system_prompt or the observations, or use a model with a longer context")


def test_frozenlake_turns_fit_the_tiny_models_context():
    # examples/agentic_frozenlake.yaml: the first prompt is 21 tokens, a later turn 6 + 22 (the board and its
    # markers): turn 8 needs 21 + 7 * 28 + 6 = 223 <= 256. At 30 tokens a turn: 21 + 3 * 52 + 30 = 207 fits,
    # 21 + 4 * 52 + 30 = 259 does not: 4 turns
    _, warnings = _budget({"id": "frozenlake", "kwargs": {"size": 4, "max_turns": 8}}, max_turns=8, max_new_tokens=6)
    assert warnings == []
    _, warnings = _budget({"id": "frozenlake", "kwargs": {"size": 4, "max_turns": 8}}, max_turns=8, max_new_tokens=30)
    assert warnings and warnings[0].startswith("env.max_turns is 8, but only 4 turns surely fit")


def test_a_system_prompt_that_leaves_no_room_for_a_turn_is_one_line():
    settings = EpisodeSettings(group_size=1, max_turns=2, max_context_tokens=256)
    encoder = TurnEncoder(TOKENIZER, "x" * 200)
    with pytest.raises(ConfigError, match=r"^env.system_prompt takes \d+ tokens .* rollout.max_new_tokens = 90 "
                                          r"that is over the context of 256 tokens"):
        check_system_prompt_fits(encoder, settings, 90)
    check_system_prompt_fits(TurnEncoder(TOKENIZER, "x" * 100), settings, 90)
