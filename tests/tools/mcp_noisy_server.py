"""An MCP server for the tests that writes what is not the protocol: over stdio,

    python mcp_noisy_server.py garbage         # 50 lines of garbage on stdout, then exits
    python mcp_noisy_server.py garbage-serve   # 50 lines of garbage on stdout, then serves
    python mcp_noisy_server.py crash           # a deep traceback on stderr at start, exit status 1
    python mcp_noisy_server.py serve           # serves `raises` (a deep traceback in the server's log) and
                                               # `dies` (prints a deep traceback on stderr, exits 3)
"""

from __future__ import annotations

import os
import sys
import traceback

GARBAGE = "garbage line {}: a print() that should have gone to stderr"


def deep(depth: int) -> str:
    if depth == 0:
        raise RuntimeError("the tool's dependency is broken")
    return deep(depth - 1)


def serve() -> None:
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("noisy")

    @server.tool()
    def raises() -> str:
        """Raises deep down."""
        return deep(40)

    @server.tool()
    def dies() -> str:
        """Prints a deep traceback on stderr and exits."""
        try:
            deep(40)
        except RuntimeError:
            traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)

    server.run()


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode.startswith("garbage"):
        for number in range(50):
            print(GARBAGE.format(number), flush=True)
    if mode == "crash":
        deep(40)
    if mode in ("garbage-serve", "serve"):
        serve()
