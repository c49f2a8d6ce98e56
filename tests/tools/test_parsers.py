"""The Qwen / Hermes tool-call parser: calls read from the model's text, and every malformed call an error
line, never an exception."""

import pytest

from rollflow.registry import UnknownNameError
from rollflow.tools.parsers import TOOL_PARSERS, ToolCall, parse_qwen_tool_calls


def test_one_call_and_the_text_around_it():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
    parsed = parse_qwen_tool_calls(text)
    assert parsed.calls == [ToolCall("calculator", {"expression": "2+2"})]
    assert parsed.content == "Let me compute." and parsed.error is None and parsed.is_call


def test_several_calls_in_order_and_arguments_given_as_a_json_string():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": "{\\"q\\": 1}"}</tool_call>')
    assert parse_qwen_tool_calls(text).calls == [ToolCall("a", {}), ToolCall("b", {"q": 1})]


def test_no_call_is_the_answer():
    parsed = parse_qwen_tool_calls("  10063 ")
    assert parsed.calls == [] and parsed.error is None and not parsed.is_call and parsed.content == "10063"


@pytest.mark.parametrize("text, error", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}', "tool call 1 has no closing </tool_call>"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": 2+2}}</tool_call>',
     "tool call 1 is not valid JSON (Expecting ',' delimiter at character 52)"),
    ("<tool_call>[1, 2]</tool_call>", "tool call 1 is a JSON list, not an object with name and arguments"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'tool call 1 has no "name" string'),
    ('<tool_call>{"name": "c", "arguments": [1]}</tool_call>', 'tool call 1 (c): "arguments" must be a JSON object'),
    ('{"name": "c"}</tool_call>', "a </tool_call> without its <tool_call>"),
])
def test_malformed_calls_are_an_error_line(text, error):
    parsed = parse_qwen_tool_calls(text)
    assert parsed.error is not None and parsed.error.startswith(error)
    assert "\n" not in parsed.error and parsed.is_call


def test_calls_before_a_malformed_one_are_kept():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>'
    parsed = parse_qwen_tool_calls(text)
    assert parsed.calls == [ToolCall("a", {})] and parsed.error.startswith("tool call 2 is not valid JSON")


def test_parsers_are_chosen_by_name():
    assert TOOL_PARSERS.get("qwen") is TOOL_PARSERS.get("hermes") is parse_qwen_tool_calls
    with pytest.raises(UnknownNameError, match="hermes, qwen"):
        TOOL_PARSERS.get("llama")
