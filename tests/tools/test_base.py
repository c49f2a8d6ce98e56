"""make_tools (specs, options, names) and check_arguments (the checks every tool call shares)."""

from __future__ import annotations

import pytest

from rollflow.errors import ConfigError
from rollflow.registry import UnknownNameError
from rollflow.tools import TOOLS, Tool, ToolError, check_arguments, make_tools
from rollflow.tools.calculator import Calculator


def test_a_name_or_a_mapping_with_options_makes_a_tool():
    tools = make_tools(["calculator", {"name": "python", "timeout_s": 2}])
    assert [tool.name for tool in tools] == ["calculator", "python"]
    assert all(isinstance(tool, Tool) for tool in tools)
    assert tools[1].timeout_s == 2.0


@pytest.mark.parametrize("name", ["calculator", "python"])
def test_builtin_schemas_are_in_the_function_format(name):
    schema = make_tools([name])[0].schema()
    assert schema["type"] == "function" and set(schema["function"]) == {"name", "description", "parameters"}
    assert schema["function"]["name"] == name
    parameters = schema["function"]["parameters"]
    assert parameters["type"] == "object" and parameters["additionalProperties"] is False
    assert set(parameters["required"]) <= set(parameters["properties"])
    assert len(schema["function"]["description"]) < 60  # it may be rendered into a small model's prompt


def test_an_unknown_name_lists_the_valid_ones():
    with pytest.raises(UnknownNameError, match=r"unknown tool 'calculater'\. Did you mean 'calculator'\?.*mcp"):
        make_tools(["calculater"])


@pytest.mark.parametrize(("spec", "message"), [
    ({"name": "calculator", "max_lenght": 10}, r"tool 'calculator': unknown option 'max_lenght'\. Did you mean "
                                               r"'max_length'\? Valid: max_length, max_exponent, max_magnitude"),
    ({"name": "calculator", "max_length": 0}, r"option 'max_length' must be an integer above 0, got 0"),
    ({"name": "python", "timeout_s": True}, r"option 'timeout_s' must be a number above 0, got True"),
    ({"name": "retrieval"}, r"tool 'retrieval' needs the option 'corpus'"),
    ({"corpus": "docs.jsonl"}, r"a tool spec is a name or a mapping with a 'name' key"),
    (42, r"a tool spec is a name or a mapping with a 'name' key; got 42"),
])
def test_bad_specs_fail_as_one_line(spec, message):
    with pytest.raises(ConfigError, match=message) as error:
        make_tools([spec])
    assert "\n" not in str(error.value)


def test_two_tools_with_one_name_fail_and_the_made_ones_are_closed(monkeypatch):
    closed = []

    class Closing(Calculator):
        def close(self):
            closed.append(self.name)

    monkeypatch.setitem(TOOLS._entries, "closing_pair", lambda: [Closing(), Closing()])
    with pytest.raises(ConfigError, match="two tools are named 'calculator'"):
        make_tools(["closing_pair"])
    assert closed == ["calculator", "calculator"]
    with pytest.raises(ConfigError, match="two tools are named 'calculator'"):
        make_tools(["calculator", "calculator"])


def test_a_factory_may_make_several_tools(monkeypatch):
    monkeypatch.setitem(TOOLS._entries, "pair", lambda: [Calculator(), make_tools(["python"])[0]])
    assert [tool.name for tool in make_tools(["pair"])] == ["calculator", "python"]


SCHEMA = {
    "type": "object",
    "properties": {
        "text": {"type": "string"},
        "count": {"type": "integer"},
        "scale": {"type": "number"},
        "flag": {"type": "boolean"},
        "items": {"type": "array"},
        "options": {"type": "object"},
        "maybe": {"type": ["string", "null"]},
        "anything": {},
    },
    "required": ["text"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("arguments", [
    {"text": "a"},
    {"text": "a", "count": 3, "scale": 0.5, "flag": True, "items": [1], "options": {"k": 1}},
    {"text": "a", "count": 2.0},  # JSON Schema: an integral number is an integer
    {"text": "a", "scale": 2},  # an integer is a number
    {"text": "a", "maybe": None},
    {"text": "a", "anything": [{"x": None}]},
])
def test_arguments_that_match(arguments):
    check_arguments(SCHEMA, arguments)


@pytest.mark.parametrize(("arguments", "message"), [
    (["a"], "arguments must be a JSON object, got array"),
    ("a", "arguments must be a JSON object, got string"),
    (None, "arguments must be a JSON object, got null"),
    ({}, "missing required argument 'text'"),
    ({"text": "a", "extra": 1}, r"unknown argument 'extra' \(expected: text, count, scale"),
    ({"text": 1}, "argument 'text' must be string, got integer"),
    ({"text": "a", "count": True}, "argument 'count' must be integer, got boolean"),  # bool is not an integer
    ({"text": "a", "count": 2.5}, "argument 'count' must be integer, got number"),
    ({"text": "a", "count": "3"}, "argument 'count' must be integer, got string"),
    ({"text": "a", "scale": False}, "argument 'scale' must be number, got boolean"),
    ({"text": "a", "flag": 1}, "argument 'flag' must be boolean, got integer"),
    ({"text": "a", "items": {"a": 1}}, "argument 'items' must be array, got object"),
    ({"text": "a", "options": []}, "argument 'options' must be object, got array"),
    ({"text": "a", "maybe": 3}, "argument 'maybe' must be string or null, got integer"),
])
def test_arguments_that_do_not_match(arguments, message):
    with pytest.raises(ToolError, match=message):
        check_arguments(SCHEMA, arguments)


def test_check_arguments_takes_a_whole_tool_schema_and_open_objects():
    schema = make_tools(["calculator"])[0].schema()
    check_arguments(schema, {"expression": "1"})
    with pytest.raises(ToolError, match="missing required argument 'expression'"):
        check_arguments(schema, {})
    check_arguments({"type": "object", "properties": {}}, {"extra": 1})  # additionalProperties not false
