"""A tiny MCP server for the tests: `add`, `fail` and `slow`, over stdio (default) or streamable HTTP.

    python mcp_echo_server.py              # stdio
    python mcp_echo_server.py --http PORT  # streamable HTTP at http://127.0.0.1:PORT/mcp
"""

from __future__ import annotations

import os
import sys
import time

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("echo", log_level="WARNING")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def fail() -> str:
    """Always fails."""
    raise ToolError("this tool always fails")  # a ToolError's message reaches the client; others are hidden


@server.tool()
def slow(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "done"


@server.tool()
def crash() -> str:
    """Kill the server process (the client sees its connection die)."""
    os._exit(1)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
