"""Tools an agent can call: the protocol and registry (`base`), the built-ins, and MCP servers' tools.

    from rollflow.tools import make_tools
    tools = make_tools(["calculator", {"name": "retrieval", "corpus": "data/docs.jsonl"}, "my_tools:make_search"])

Importing the package registers the built-ins (`calculator`, `python`, `retrieval`, `mcp`); the heavy
libraries (`bm25s`, `mcp`) are imported only when their tool is made.
"""

from rollflow.tools import calculator, mcp_client, python_tool, retrieval  # noqa: F401  (they register)
from rollflow.tools.base import (
    TOOLS,
    Tool,
    ToolError,
    check_arguments,
    check_tools,
    close_shared_tools,
    make_tools,
)

__all__ = ["TOOLS", "Tool", "ToolError", "check_arguments", "check_tools", "close_shared_tools", "make_tools"]
