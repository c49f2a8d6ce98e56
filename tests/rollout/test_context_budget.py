"""Episodes cut at the context limit: how many turns surely fit (`turns_that_fit`), the episodes whose answer a
long tool call and its result crowd out (counted in `rollout/context_truncated_frac`, warned of once a run with
the token budget of the turns)."""

from __future__ import annotations

import asyncio
import json

from rollflow.data.multiturn import TurnEncoder
from rollflow.data.sample import SampleStatus
from rollflow.engines.base import SamplingParams
from rollflow.rollout.core import RolloutCore
from rollflow.rollout.env_groups import EnvGroups, EpisodeSettings, SeedSource, turns_that_fit
from rollflow.rollout.episodes import ContextLimitWarning, TurnBudget, episode_metrics
from rollflow.rollout.settings import CoreSettings
from tests.rollout.test_env_groups import (
    CORRIDOR,
    TOKENIZER,
    Remote,
    ScriptedEngine,
    env_worker,
    played,
    rollout,
)
from tests.rollout.test_tool_episodes import ToolCallingEngine


def test_turns_that_fit_counts_full_length_turns():
    settings = EpisodeSettings(group_size=1, max_turns=3, max_context_tokens=256)
    # turn 1: 39 + 90 = 129 <= 256; turn 2: 39 + (90 + 34) + 90 = 253 <= 256; turn 3: 39 + 2 * 124 + 90 = 377 > 256
    assert turns_that_fit(39, 34, settings, 90) == 2
    # turn 2 at a context of 250: 253 > 250
    assert turns_that_fit(39, 34, EpisodeSettings(group_size=1, max_turns=3, max_context_tokens=250), 90) == 1
    assert turns_that_fit(170, 34, settings, 90) == 0  # 170 + 90 = 260 > 256: not even the first
    # FrozenLake 4x4 on the tiny model: 21 + 7 * (6 + 22) + 6 = 223 <= 256: all 8 turns fit
    assert turns_that_fit(21, 22, EpisodeSettings(group_size=1, max_turns=8, max_context_tokens=256), 6) == 8
    # step-wise samples keep `history_turns` earlier turns: 39 + 1 * 124 + 90 = 253 for every turn
    step = EpisodeSettings(group_size=1, samples="step", history_turns=1, max_turns=5, max_context_tokens=256)
    assert turns_that_fit(39, 34, step, 90) == 5


def _play_tool_episodes(tmp_path, context: int):
    """Two episodes of `347*29` with the calculator: a call of 87 tokens (with its end), the tool's answer,
    then the answer; rollout.max_new_tokens 90, at most 3 turns, in `context` tokens."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "347*29", "answer": "10063"}) + "\n")
    env = {"id": "tool_use", "kwargs": {"tools": ["calculator"], "env_kwargs": {"path": str(rows),
                                                                                "reward": "exact_match"}}}
    worker = env_worker(env)
    encoder = TurnEncoder(TOKENIZER, None, asyncio.run(worker.check())["tools"])
    settings = EpisodeSettings(group_size=2, max_turns=3, max_context_tokens=context, step_timeout_s=5.0)
    program = EnvGroups([Remote(worker)], encoder, settings, SamplingParams(90))
    core = RolloutCore([Remote(ToolCallingEngine("10063"))], program, SeedSource(0, 1_000_000),
                       CoreSettings(groups_per_step=1, watchdog_s=60.0))
    try:
        return played(core.next_batch(1, 0)), len(encoder.first_prompt(""))
    finally:
        core.close()


def test_an_answer_crowded_out_by_the_tool_result_is_counted_and_warned_of_once(tmp_path):
    # the first prompt: 33 tokens of system line, tools and markers + "347*29" = 39; the call: 87 tokens (its end
    # included); the tool turn: 33 tokens of markers + "10063" = 38. The answer's prompt: 39 + 87 + 38 = 164,
    # and 164 + 90 = 254 tokens do not fit a context of 250
    samples, prefix = _play_tool_episodes(tmp_path, context=250)
    assert prefix == 33
    assert [s.status for s in samples] == [SampleStatus.TRUNCATED] * 2
    assert all(s.metadata["context_full"] == 164 and s.metadata["turns"] == 1 for s in samples)
    assert all(s.metadata["first_prompt_tokens"] == 39 and s.reward == 0.0 for s in samples)
    metrics = episode_metrics(samples, "rollout")
    assert metrics["rollout/context_truncated_frac"] == 1.0 and metrics["rollout/truncated_frac"] == 1.0
    warning = ContextLimitWarning(TurnBudget(context=250, max_new_tokens=90, max_turns=3, prefix=prefix))
    assert warning.lines("step 1", samples) == [
        "step 1: 2 of 2 episodes ended truncated at the context limit, before their last turn or answer: the "
        "context holds 250 tokens (rollout.max_context_tokens, default the model's), so with "
        "rollout.max_new_tokens = 90 a turn's prompt must stay within 160 tokens; one episode's reached 164 after "
        "1 of env.max_turns = 3 turns (its first prompt: 39 tokens, 33 of them the system prompt, tools and chat "
        "markers). Lower rollout.max_new_tokens or env.max_turns, shorten the system prompt or the observations "
        "(tool results), or use a model with a longer context; rollout/context_truncated_frac counts these "
        "episodes"]
    assert warning.lines("step 2", samples) == []  # once a run
    in_eval = ContextLimitWarning(TurnBudget(250, 90, 3, prefix)).lines("eval at step 0", samples, "eval")
    assert in_eval[0].startswith("eval at step 0: 2 of 2 episodes") and in_eval[0].endswith(
        "; eval/context_truncated_frac counts these episodes")


def test_episodes_that_fit_are_not_counted_or_warned_of(tmp_path):
    samples, prefix = _play_tool_episodes(tmp_path, context=256)  # 254 tokens fit: the answer is played
    assert all(s.status == SampleStatus.FINISHED and s.reward == 1.0 for s in samples)
    assert episode_metrics(samples, "rollout")["rollout/context_truncated_frac"] == 0.0
    assert ContextLimitWarning(TurnBudget(256, 90, 3, prefix)).lines("step 1", samples) == []


def test_the_turn_limit_is_not_the_context_limit():
    env = {"id": "frozenlake", "kwargs": {"fixed_map": CORRIDOR, "max_turns": 10}}  # no hole on the way Right
    core = rollout(ScriptedEngine("Right"), env, max_turns=2)
    try:
        samples = played(core.next_batch(1, 0))
    finally:
        core.close()
    assert samples and all(s.status == SampleStatus.TRUNCATED and s.metadata["context_full"] == 0 for s in samples)
    metrics = episode_metrics(samples, "rollout")
    assert metrics["rollout/truncated_frac"] == 1.0 and metrics["rollout/context_truncated_frac"] == 0.0
