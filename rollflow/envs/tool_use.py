"""The tool-use env (`tool_use`): any text env, or a prompt dataset (`prompts`, the default), made into a
multi-turn episode in which the model may call tools before it acts.

Each turn the model's text is read by a tool-call parser in its template family's format (`parser`: `qwen`,
see `rollflow.tools.parsers`):
- calls: each is checked against its tool's schema and run (within the tool's time limit; its output cut at
  `max_output_chars`); the results are the next observation, as `tool` role messages
  (`info["tool_results"]`, which the rollout renders with the chat template's tool turn, token-exactly).
- a malformed call (unreadable, an unknown tool, arguments the schema refuses, past `max_calls`): a
  penalized turn (`invalid_penalty`, `info["invalid_action"]`) whose observation is the error, as a tool
  message: never an exception.
- no call: the text is the action of the inner env (or the answer the prompt's reward scores).

The tools' schemas are the env's `tools()`: the rollout renders them into the first prompt with the chat
template (`apply_chat_template(..., tools=...)`). Every step's info counts `tool_calls` (malformed ones too),
`tool_errors` (at most `tool_calls`) and `tool_seconds` (the `rollout/tool_*` metrics).
"""

from __future__ import annotations

import time
from typing import Any

from rollflow.envs.base import Env, StepResult
from rollflow.errors import ConfigError
from rollflow.tools.base import Tool, ToolError, check_arguments, make_tools
from rollflow.tools.parsers import TOOL_PARSERS, ParsedTurn, ToolCall

TRUNCATED_MARK = " ... (cut at {} characters)"


class ToolUseEnv:
    """An env whose model may call tools (see the module docstring). Made from an id by the `tool_use` env
    (`rollflow.envs.make.make_tool_use_env`, which makes the inner env).

    Args:
        inner: the env the model acts in when it does not call a tool (a `prompts` env: its answer is scored).
        tools: tool specs (`rollflow.tools.base.make_tools`): `calculator`, `python`, `{"name": "retrieval",
            "corpus": ...}`, `{"name": "mcp", "command": [...]}` / `{"name": "mcp", "url": ...}`.
        parser: the tool-call format (`TOOL_PARSERS`: `qwen`, `hermes`).
        max_calls: tool calls allowed in an episode; a call past them is an error turn.
        max_output_chars: a tool's output is cut to this many characters.
        invalid_penalty: the reward of a turn with a malformed call.
        tool_reward: the reward of a turn whose calls all ran without error (0: only the answer pays).
    """

    def __init__(self, inner: Env, tools: list[str | dict[str, Any]], parser: str = "qwen", max_calls: int = 4,
                 max_output_chars: int = 500, invalid_penalty: float = -0.1, tool_reward: float = 0.0):
        if not tools:
            raise ConfigError("env 'tool_use' needs at least one tool (tools: [calculator], ...)")
        if max_calls < 1 or max_output_chars < 1:
            raise ConfigError("env 'tool_use': max_calls and max_output_chars must be >= 1")
        self.parse = TOOL_PARSERS.get(parser)
        self.tool_list: list[Tool] = make_tools(tools)
        self.by_name = {tool.name: tool for tool in self.tool_list}
        self.inner = inner
        self.max_calls, self.max_output_chars = max_calls, max_output_chars
        self.invalid_penalty, self.tool_reward = invalid_penalty, tool_reward
        self.calls = 0

    def tools(self) -> list[dict[str, Any]]:
        """The tools' JSON-schema specs, for the chat template's tool block."""
        return [tool.schema() for tool in self.tool_list]

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """Reset the inner env; the episode's tool budget starts full."""
        self.calls = 0
        return self.inner.reset(seed)

    def step(self, action: str) -> StepResult:
        """Run the turn's tool calls, or pass the text to the inner env (see the module docstring)."""
        parsed = self.parse(action)
        if not parsed.is_call:
            observation, reward, terminated, truncated, info = self.inner.step(action)
            return observation, reward, terminated, truncated, {**info, **_counts(0, 0, 0.0)}
        return self._tool_turn(parsed)

    def _tool_turn(self, parsed: ParsedTurn) -> StepResult:
        results, errors, invalid, seconds = [], 0, False, 0.0
        for call in parsed.calls:
            if self.calls >= self.max_calls:
                results.append(f"error: no tool calls left ({self.max_calls} per episode); answer now")
                errors, invalid = errors + 1, True
                break
            self.calls += 1
            started = time.perf_counter()
            text, failed, malformed = self._call(call)
            seconds += time.perf_counter() - started
            results.append(text)
            errors += failed
            invalid = invalid or malformed
        if parsed.error is not None:
            results.append(f"error: {parsed.error}")
            errors, invalid = errors + 1, True
        reward = self.invalid_penalty if invalid else (self.tool_reward if errors == 0 else 0.0)
        # an unreadable call is a call too (a failed one), so `tool_errors` never exceeds `tool_calls`
        calls = len(parsed.calls) + (parsed.error is not None)
        info = {"success": False, "invalid_action": invalid, "anchor": "\n".join(results), "tool_results": results,
                **_counts(calls, errors, seconds)}
        return "\n".join(results), reward, False, False, info

    def _call(self, call: ToolCall) -> tuple[str, bool, bool]:
        """(the result text, whether the call failed, whether it was malformed) of one call."""
        tool = self.by_name.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r}; the tools: {', '.join(self.by_name)}", True, True
        try:
            check_arguments(tool.schema(), call.arguments)
        except ToolError as err:
            return f"error: {err}", True, True
        try:
            output = tool.call(call.arguments)
        except ToolError as err:
            return f"error: {err}", True, False
        if len(output) > self.max_output_chars:
            output = output[: self.max_output_chars] + TRUNCATED_MARK.format(self.max_output_chars)
        return output, False, False

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if callable(close):
            close()
        for tool in self.tool_list:
            tool.close()

    def play_help(self) -> str:
        """The tools and the call format, for a person playing (`rollflow env play`)."""
        names = ", ".join(self.by_name)
        inner = getattr(self.inner, "play_help", None)
        return (f"tools: {names}; call one as <tool_call>{{\"name\": \"{next(iter(self.by_name))}\", "
                "\"arguments\": {...}}</tool_call>, or answer" + (f" ({inner()})" if callable(inner) else ""))


def _counts(calls: int, errors: int, seconds: float) -> dict[str, Any]:
    return {"tool_calls": calls, "tool_errors": errors, "tool_seconds": seconds}
