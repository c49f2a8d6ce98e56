"""Tool-use episodes through the env-group program: the model's call, the tool's answer as a tool turn and the
model's answer are one trajectory whose tokens are exactly `apply_chat_template(messages, tools=...)`, trained
only on the model's tokens; the tool metrics count the calls."""

from __future__ import annotations

import asyncio
import json

from rollflow.data.multiturn import TurnEncoder
from rollflow.engines.base import Completion, CompletionOutput, SamplingParams
from rollflow.rollout.core import RolloutCore
from rollflow.rollout.env_groups import EnvGroups, EpisodeSettings, SeedSource
from rollflow.rollout.episodes import episode_metrics
from rollflow.rollout.settings import CoreSettings
from tests.rollout.test_env_groups import EOS, TOKENIZER, Remote, env_worker, played

CALL = "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": "347*29"}}) + "\n</tool_call>"


class ToolCallingEngine:
    """Writes `call` (the calculator's, by default) on a prompt with no tool result yet, answers `answer` after
    one."""

    def __init__(self, answer: str, call: str = CALL):
        self.answer, self.call = answer, call

    async def generate(self, request):
        await asyncio.sleep(0)
        text = self.answer if "<tool_response>" in TOKENIZER.decode(request.prompt_ids) else self.call
        ids = TOKENIZER(text, add_special_tokens=False)["input_ids"] + [EOS]
        return Completion(request.request_id, [CompletionOutput(ids, [-0.5] * len(ids), [0] * len(ids))])

    async def generate_batch(self, requests):
        return [await self.generate(request) for request in requests]

    def abort(self, request_ids):
        pass


def _play(tmp_path, answer: str, tools: list | None = None, call: str = CALL, context_tokens: int = 256):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "347*29", "answer": "10063"}) + "\n")
    env = {"id": "tool_use", "kwargs": {"tools": tools or ["calculator"],
                                        "env_kwargs": {"path": str(rows), "reward": "exact_match"}}}
    worker = env_worker(env)
    tools = asyncio.run(worker.check())["tools"]
    encoder = TurnEncoder(TOKENIZER, None, tools)
    settings = EpisodeSettings(group_size=2, max_turns=3, max_context_tokens=context_tokens, step_timeout_s=5.0)
    program = EnvGroups([Remote(worker)], encoder, settings, SamplingParams(90))
    core = RolloutCore([Remote(ToolCallingEngine(answer, call))], program, SeedSource(0, 1_000_000),
                       CoreSettings(groups_per_step=1, watchdog_s=60.0))
    try:
        return played(core.next_batch(1, 0)), tools
    finally:
        core.close()


def test_a_tool_episode_is_the_chat_template_rendering_of_its_messages(tmp_path):
    samples, tools = _play(tmp_path, "10063")
    assert len(samples) == 2
    messages = [{"role": "user", "content": "347*29"}, {"role": "assistant", "content": CALL},
                {"role": "tool", "content": "10063"}, {"role": "assistant", "content": "10063"}]
    reference = TOKENIZER.apply_chat_template(messages, tools=tools, tokenize=False)
    for sample in samples:
        assert TOKENIZER.decode(sample.prompt_ids + sample.response_ids) == reference
        trained = [t for t, m in zip(sample.response_ids, sample.loss_mask) if m]
        assert TOKENIZER.decode(trained) == CALL + "<eos>" + "10063" + "<eos>"  # the tool's answer is not trained on
        assert sample.reward == 1.0 and sample.metadata["success"]
    metrics = episode_metrics(samples, "rollout")
    assert metrics["rollout/tool_calls_per_episode"] == 1.0
    assert metrics["rollout/tool_error_frac"] == 0.0 and metrics["rollout/success"] == 1.0


def test_a_wrong_answer_after_the_tool_scores_zero(tmp_path):
    samples, _ = _play(tmp_path, "10064")
    assert [s.reward for s in samples] == [0.0, 0.0]
    assert episode_metrics(samples, "rollout")["rollout/success"] == 0.0


def test_malformed_calls_count_as_failed_calls_so_the_error_fraction_stays_a_fraction(tmp_path):
    """An unreadable call every turn: 3 calls, 3 errors per episode (once counted as 0 calls: a fraction of 3.0).
    The scripted engine has no context limit of its own: the episodes may run all 3 turns."""
    unreadable = "<tool_call>{not json}</tool_call>"
    samples, _ = _play(tmp_path, unreadable, call=unreadable, context_tokens=4096)  # max_turns 3
    assert [s.metadata["counters"]["tool_calls"] for s in samples] == [3.0, 3.0]
    metrics = episode_metrics(samples, "rollout")
    assert metrics["rollout/tool_error_frac"] == 1.0 and metrics["rollout/tool_calls_per_episode"] == 3.0
    assert episode_metrics(samples, "eval")["eval/tool_error_frac"] == 1.0
    for sample in samples:  # an env of the user's own that counts failed calls as errors only
        sample.metadata["counters"] = {"tool_calls": 1.0, "tool_errors": 2.0}
    assert episode_metrics(samples, "rollout")["rollout/tool_error_frac"] == 1.0


USER_TOOL = """
CALLS = []


class Times:
    \"\"\"A tool of the user's own: it is only the Tool protocol, nothing of rollflow.\"\"\"

    name = "times"

    def schema(self):
        numbers = {"type": "integer"}
        return {"type": "function", "function": {"name": "times", "description": "Multiply a by b.", "parameters": {
            "type": "object", "properties": {"a": numbers, "b": numbers}, "required": ["a", "b"]}}}

    def call(self, arguments):
        CALLS.append(arguments)
        return str(arguments["a"] * arguments["b"])

    def close(self):
        pass
"""


def test_a_tool_of_the_user_s_own_by_dotted_path_is_called_in_the_episode(tmp_path, monkeypatch):
    (tmp_path / "user_times_tool.py").write_text(USER_TOOL)
    monkeypatch.syspath_prepend(str(tmp_path))
    call = "<tool_call>\n" + json.dumps({"name": "times", "arguments": {"a": 347, "b": 29}}) + "\n</tool_call>"
    samples, tools = _play(tmp_path, "10063", tools=["user_times_tool:Times"], call=call)
    assert [tool["function"]["name"] for tool in tools] == ["times"]
    import user_times_tool

    assert user_times_tool.CALLS == [{"a": 347, "b": 29}] * 2  # one call per episode, two episodes
    for sample in samples:
        assert "<tool_response>10063</tool_response>" in TOKENIZER.decode(sample.response_ids)
        assert sample.reward == 1.0
    assert episode_metrics(samples, "rollout")["rollout/tool_error_frac"] == 0.0
