"""Tool-use episodes through the env-group program: the model's call, the tool's answer as a tool turn and the
model's answer are one trajectory whose tokens are exactly `apply_chat_template(messages, tools=...)`, trained
only on the model's tokens; the tool metrics count the calls."""

from __future__ import annotations

import asyncio
import json

from rollflow.data.multiturn import TurnEncoder
from rollflow.engines.base import Completion, CompletionOutput, SamplingParams
from rollflow.rollout.core import CoreSettings, RolloutCore
from rollflow.rollout.env_groups import EnvGroups, EpisodeSettings, SeedSource
from rollflow.rollout.episodes import episode_metrics
from tests.rollout.test_env_groups import EOS, TOKENIZER, Remote, env_worker, played

CALL = "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": "347*29"}}) + "\n</tool_call>"


class ToolCallingEngine:
    """Calls the calculator on a prompt with no tool result yet, answers `answer` after one."""

    def __init__(self, answer: str):
        self.answer = answer

    async def generate(self, request):
        await asyncio.sleep(0)
        text = self.answer if "<tool_response>" in TOKENIZER.decode(request.prompt_ids) else CALL
        ids = TOKENIZER(text, add_special_tokens=False)["input_ids"] + [EOS]
        return Completion(request.request_id, [CompletionOutput(ids, [-0.5] * len(ids), [0] * len(ids))])

    async def generate_batch(self, requests):
        return [await self.generate(request) for request in requests]

    def abort(self, request_ids):
        pass


def _play(tmp_path, answer: str):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "347*29", "answer": "10063"}) + "\n")
    env = {"id": "tool_use", "kwargs": {"tools": ["calculator"], "env_kwargs": {"path": str(rows),
                                                                                "reward": "exact_match"}}}
    worker = env_worker(env)
    tools = asyncio.run(worker.check())["tools"]
    encoder = TurnEncoder(TOKENIZER, None, tools)
    settings = EpisodeSettings(group_size=2, max_turns=3, max_context_tokens=256, step_timeout_s=5.0)
    program = EnvGroups([Remote(worker)], encoder, settings, SamplingParams(90))
    core = RolloutCore([Remote(ToolCallingEngine(answer))], program, SeedSource(0, 1_000_000),
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
