"""The tool protocol, the registry of tools by name, and the checks every tool call shares.

A tool is something the model may call in the middle of an episode:

    tool.schema()            # {"type": "function", "function": {"name", "description", "parameters"}}
    tool.call({"x": 1})      # the result text, or ToolError (one line, shown to the model as the answer)
    tool.close()

`schema()` is the format `transformers`' `apply_chat_template(tools=[...])` and Qwen's chat template take.
Tools are made from specs by `make_tools`: a name (`"calculator"`) or a mapping with a `name` and the
tool's options (`{"name": "retrieval", "corpus": "data/docs.jsonl", "top_k": 3}`). A name with a colon is a
tool of the user's own, `module:factory`: a class or function that takes the spec's options as keyword
arguments and returns a `Tool` (or a list of them), found as env ids and reward functions are
(`rollflow.registry.import_factory`). `check_tools` checks specs at config load without making anything.

Tools are made once per episode, so a tool that holds a resource (an MCP connection, a BM25 index) keeps it
in a process-wide cache keyed by its spec: making one is cheap, and its `close()` leaves the shared
resource open. `close_shared_tools()` closes them all (it also runs at interpreter exit).
"""

from __future__ import annotations

import atexit
import difflib
import inspect
import threading
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from rollflow.errors import ConfigError, RollflowError
from rollflow.registry import Registry, UnknownNameError, import_factory


class ToolError(RollflowError):
    """A tool call failed: bad arguments, a time-out, the tool's own error. The message is one line, and the
    model reads it as the tool's answer."""


@runtime_checkable
class Tool(Protocol):
    """What an env calls on the model's behalf."""

    name: str

    def schema(self) -> dict[str, Any]:
        """`{"type": "function", "function": {"name", "description", "parameters": <JSON schema>}}`."""
        ...

    def call(self, arguments: dict[str, Any]) -> str:
        """Run the tool. Returns the result text; raises `ToolError` (one line) when the call fails."""
        ...

    def close(self) -> None:
        """Release what this tool alone holds (never a resource shared across episodes)."""
        ...


# Built-in tools: name -> factory(**options) -> Tool | list[Tool]. Built-ins register themselves on import.
TOOLS: Registry[Callable[..., Tool | list[Tool]]] = Registry("tool")

JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (dict,),
    "null": (type(None),),
}
MAX_ERROR_CHARS = 500  # a tool's error text is cut here: it is one line of the model's context


def make_tools(specs: list[str | dict[str, Any]]) -> list[Tool]:
    """Make the tools named by `specs`, in order.

    Args:
        specs: each a tool name (`"calculator"`, or `"my_tools:make_search"` for a tool of your own) or a
            mapping with `name` and the tool's options (`{"name": "mcp", "command": ["python", "server.py"],
            "timeout_s": 10}`). A spec may make several tools (an MCP server's).

    Returns:
        The tools.

    Raises:
        UnknownNameError: a name that is not registered (the message lists the valid ones).
        ConfigError: a malformed spec, an unknown or invalid option, a dotted path that does not import, a
            factory that made something that is not a tool, or two tools with one name.
    """
    tools: list[Tool] = []
    try:
        for spec in specs:
            name, options = _parse_spec(spec)
            factory = tool_factory(name)
            _check_options(name, factory, options)
            made = factory(**options)
            for tool in made if isinstance(made, list) else [made]:
                tools.append(_checked_tool(name, tool))
        seen: set[str] = set()
        for tool in tools:
            if tool.name in seen:
                raise ConfigError(f"two tools are named {tool.name!r}; each tool needs its own name")
            seen.add(tool.name)
    except BaseException:
        for tool in tools:
            tool.close()
        raise
    return tools


def check_tools(specs: Any) -> None:
    """Check tool specs without making the tools, at config load: the spec's form, the name (a built-in, or a
    dotted path that imports to a callable), the options (names, and what the tool's `check_options` checks:
    an MCP server's command is found, a corpus exists). Nothing is started, connected or indexed; a built-in
    without `check_options` is cheap to make, so it is made and closed. A factory of the user's own is not
    called: what it makes is checked when it is made (`make_tools`).

    Raises:
        UnknownNameError, ConfigError: as `make_tools` would, in one line.
    """
    if not isinstance(specs, list) or not specs:
        raise ConfigError(f"tools must be a non-empty list of tool specs (names or mappings with a 'name'), "
                          f"got {specs!r}")
    for spec in specs:
        name, options = _parse_spec(spec)
        factory = tool_factory(name)
        _check_options(name, factory, options)
        check = getattr(factory, "check_options", None)
        if callable(check):
            check(**options)
        elif ":" not in name:
            made = factory(**options)
            for tool in made if isinstance(made, list) else [made]:
                tool.close()
        elif isinstance(factory, type):
            missing = [method for method in ("schema", "call", "close") if not callable(getattr(factory, method, None))]
            if missing:
                raise ConfigError(f"tool {name!r} makes a {factory.__name__} without {', '.join(missing)}; "
                                  f"{TOOL_CONTRACT}")


def tool_factory(name: str) -> Callable[..., Tool | list[Tool]]:
    """The factory of a tool spec's `name`: a built-in's (`TOOLS`), or the callable a dotted path
    `module:factory` names.

    Raises:
        UnknownNameError: an unknown built-in name (the message lists the valid ones).
        ConfigError: a dotted path that is malformed, does not import, or names no callable.
    """
    if ":" in name:
        return import_factory(name, "tool")
    if name not in TOOLS:
        raise UnknownNameError(f"{TOOLS.unknown_message(name)}; or a tool of your own as 'module:factory'")
    return TOOLS.get(name)


TOOL_CONTRACT = ("a tool has a `name` (text), `schema()` (a function-format JSON schema with that name), "
                 "`call(arguments)` and `close()` (docs/tools.md)")


def _checked_tool(spec_name: str, tool: Any) -> Tool:
    """`tool`, checked to be one (what a factory of the user's own made may not be); ConfigError otherwise."""
    missing = [attribute for attribute in ("schema", "call", "close") if not callable(getattr(tool, attribute, None))]
    if not isinstance(getattr(tool, "name", None), str) or not tool.name:
        missing.insert(0, "name")
    if missing:
        raise ConfigError(f"tool {spec_name!r} made a {type(tool).__name__} without {', '.join(missing)}; "
                          f"{TOOL_CONTRACT}")
    schema = tool.schema()
    function = schema.get("function") if isinstance(schema, dict) else None
    if not (isinstance(function, dict) and schema.get("type") == "function" and function.get("name") == tool.name
            and isinstance(function.get("parameters", {}), dict)):
        raise ConfigError(f"tool {spec_name!r} made tool {tool.name!r} whose schema() is not "
                          f"{{'type': 'function', 'function': {{'name': {tool.name!r}, 'description': ..., "
                          f"'parameters': {{...}}}}}}; got {one_line(repr(schema), 120)}")
    return tool


def _parse_spec(spec: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, dict) and isinstance(spec.get("name"), str):
        return spec["name"], {key: value for key, value in spec.items() if key != "name"}
    raise ConfigError(f"a tool spec is a name or a mapping with a 'name' key; got {spec!r}")


def _check_options(name: str, factory: Callable[..., Any], options: dict[str, Any]) -> None:
    """Unknown and missing options fail as one line naming the tool (not as a TypeError)."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a callable without a signature Python can read: it checks its own
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    valid = [p for p in parameters if p != "self"]
    for option in options:
        if option not in parameters:
            near = difflib.get_close_matches(option, valid, n=1)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            raise ConfigError(
                f"tool {name!r}: unknown option {option!r}.{hint} Valid: {', '.join(valid) or 'none'}"
            )
    for parameter in parameters.values():
        if parameter.default is inspect.Parameter.empty and parameter.name not in options:
            raise ConfigError(f"tool {name!r} needs the option {parameter.name!r}")


def function_schema(
    name: str, description: str, properties: dict[str, dict[str, Any]], required: list[str]
) -> dict[str, Any]:
    """A tool schema in the function format, taking no arguments beyond `properties`.

    Args:
        name: the tool's name.
        description: what it does, short (schemas may be rendered into a small model's prompt).
        properties: argument name -> JSON schema (`{"type": "string", "description": "..."}`).
        required: the arguments that must be given.

    Returns:
        `{"type": "function", "function": {"name", "description", "parameters"}}`.
    """
    parameters = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def check_arguments(schema: dict[str, Any], arguments: Any) -> None:
    """Check a call's arguments against a tool's parameters (the top level: keys and JSON types).

    Args:
        schema: the parameters' JSON schema object, or a whole function-format tool schema.
        arguments: what the model passed.

    Raises:
        ToolError: arguments that are not an object, a missing required key, an unknown key (when
            `additionalProperties` is false), or a value of the wrong JSON type (a bool is not a number; an
            integral float such as 2.0 is an integer, as JSON Schema says).
    """
    if schema.get("type") == "function" and isinstance(schema.get("function"), dict):
        schema = schema["function"].get("parameters") or {}
    if not isinstance(arguments, dict):
        raise ToolError(f"arguments must be a JSON object, got {json_type(arguments)}")
    properties = schema.get("properties") or {}
    for key in schema.get("required") or []:
        if key not in arguments:
            raise ToolError(f"missing required argument {key!r}")
    for key, value in arguments.items():
        if key not in properties:
            if schema.get("additionalProperties") is False:
                expected = ", ".join(properties) or "none"
                raise ToolError(f"unknown argument {key!r} (expected: {expected})")
            continue
        expected_types = properties[key].get("type") if isinstance(properties[key], dict) else None
        if isinstance(expected_types, str):
            expected_types = [expected_types]
        if isinstance(expected_types, list) and expected_types:
            known = [t for t in expected_types if t in JSON_TYPES]
            if known and not any(_is_json_type(value, t) for t in known):
                raise ToolError(f"argument {key!r} must be {' or '.join(known)}, got {json_type(value)}")


def _is_json_type(value: Any, type_name: str) -> bool:
    if isinstance(value, bool):
        return type_name == "boolean"
    if type_name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, JSON_TYPES[type_name])


def json_type(value: Any) -> str:
    """The JSON type name of a Python value ("string", "integer", ..., or the Python type's name)."""
    if isinstance(value, bool):
        return "boolean"
    for name in ("string", "integer", "number", "array", "object", "null"):
        if isinstance(value, JSON_TYPES[name]):
            return name
    return type(value).__name__


def one_line(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text` with its whitespace (newlines too) collapsed to single spaces, cut to `limit` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def positive_number(tool: str, option: str, value: Any) -> float:
    """`value` as a float, or a one-line ConfigError when it is not a number above zero."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"tool {tool!r}: option {option!r} must be a number above 0, got {value!r}")
    return float(value)


def positive_int(tool: str, option: str, value: Any) -> int:
    """`value`, or a one-line ConfigError when it is not an integer above zero."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"tool {tool!r}: option {option!r} must be an integer above 0, got {value!r}")
    return value


_shared_closers: list[Callable[[], None]] = []
_shared_lock = threading.Lock()


def on_close_shared(closer: Callable[[], None]) -> None:
    """Register `closer` (no arguments) to run on `close_shared_tools()`: it releases the process-wide
    resources of one kind of tool (MCP connections, BM25 indexes)."""
    with _shared_lock:
        _shared_closers.append(closer)


def close_shared_tools() -> None:
    """Close every resource tools share across episodes in this process; later tools make them afresh.

    Runs at interpreter exit too. Each closer's failure is skipped, so one cannot keep the others open.
    """
    with _shared_lock:
        closers = list(_shared_closers)
    for closer in closers:
        try:
            closer()
        except Exception:  # closing (at exit, say): nothing is left to report to
            pass


atexit.register(close_shared_tools)
