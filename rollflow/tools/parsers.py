"""Tool calls parsed from what the model wrote, in its template family's format (`TOOL_PARSERS`).

A parser maps a model turn's text to a `ParsedTurn`: the text outside the calls, the calls, and, when the
turn tried to call a tool but the call cannot be read, the error in one line. A malformed call is never an
exception: the tool-use env (`rollflow.envs.tool_use`) makes it a penalized turn whose observation is the
error, so the model learns the format from the error as it would from any other observation.

Formats:
    qwen (also `hermes`): Qwen2.5 / Qwen3 and Hermes models, `<tool_call>\\n{"name": "calculator",
        "arguments": {"expression": "2+2"}}\\n</tool_call>`, several per turn; what Qwen's chat template
        renders a structured tool call as, and what the bundled tiny model's template writes too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollflow.registry import Registry

MAX_SHOWN_CHARS = 40  # of a malformed call, in its error


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    """A model turn read by a tool-call parser.

    Attributes:
        content: the text outside the calls, stripped (the answer, when there are no calls).
        calls: the calls, in the order written.
        error: why a call could not be read (one line), or None; `calls` holds the calls before it.
    """

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    error: str | None = None

    @property
    def is_call(self) -> bool:
        """The turn called a tool (or tried to): it is answered with tool results, not passed to the env."""
        return bool(self.calls) or self.error is not None


ToolCallParser = Callable[[str], ParsedTurn]
TOOL_PARSERS: Registry[ToolCallParser] = Registry("tool-call parser")

_QWEN_OPEN, _QWEN_CLOSE = "<tool_call>", "</tool_call>"
_QWEN_BLOCK = re.compile(re.escape(_QWEN_OPEN) + r"(.*?)(" + re.escape(_QWEN_CLOSE) + r"|$)", re.DOTALL)


@TOOL_PARSERS.register("qwen")
@TOOL_PARSERS.register("hermes")
def parse_qwen_tool_calls(text: str) -> ParsedTurn:
    """Qwen / Hermes calls: each `<tool_call>` JSON `</tool_call>` block, the JSON `{"name": str, "arguments":
    object}` (arguments given as a JSON string holding an object are accepted, as some models write them).

    Args:
        text: the model's turn.

    Returns:
        The `ParsedTurn`; `error` says which call is malformed and why: not closed, not JSON (with the JSON
        error), no `name`, `arguments` not an object, a stray `</tool_call>`.
    """
    calls: list[ToolCall] = []
    outside: list[str] = []
    position = 0
    for number, match in enumerate(_QWEN_BLOCK.finditer(text), start=1):
        outside.append(text[position:match.start()])
        position = match.end()
        if not match.group(2):
            return ParsedTurn(_joined(outside), calls, f"tool call {number} has no closing {_QWEN_CLOSE}")
        call = _json_call(match.group(1), number)
        if isinstance(call, str):
            return ParsedTurn(_joined(outside), calls, call)
        calls.append(call)
    outside.append(text[position:])
    if not calls and _QWEN_CLOSE in text:
        return ParsedTurn(_joined(outside), calls, f"a {_QWEN_CLOSE} without its {_QWEN_OPEN}")
    return ParsedTurn(_joined(outside), calls)


def _json_call(body: str, number: int) -> ToolCall | str:
    """The call a block's JSON holds, or the one-line error of a malformed one."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as err:
        return f"tool call {number} is not valid JSON ({err.msg} at character {err.pos}): {_shown(body)}"
    if not isinstance(value, dict):
        return f"tool call {number} is a JSON {type(value).__name__}, not an object with name and arguments"
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return f"tool call {number} has no \"name\" string: {_shown(body)}"
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # '{"expression": "2+2"}' as a string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return f"tool call {number} ({name}): \"arguments\" must be a JSON object, not {_shown(json.dumps(arguments))}"
    return ToolCall(name, arguments)


def _joined(parts: list[str]) -> str:
    return "".join(parts).strip()


def _shown(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 3] + "..."
