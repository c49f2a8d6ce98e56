"""The `mcp` tool spec: the tools of a Model Context Protocol server, through the official `mcp` SDK (2.x).

    {"name": "mcp", "command": ["python", "server.py"]}         # a stdio server, started as a subprocess
    {"name": "mcp", "url": "http://127.0.0.1:8000/mcp"}         # a streamable HTTP endpoint

One spec makes one `Tool` per tool the server lists (or the ones named in `tools`), each with the server's
input schema as its parameters. The connection is made once per process per server (command and env, or url) and shared by every tool made from it, on any thread: `MCPConnection` runs the SDK's client on
an asyncio loop in a daemon thread of its own, and a tool's synchronous `call` submits the request to that
loop and waits at most `timeout_s`. A connection that died fails its calls (`ToolError`) and is made again
by the next `make_tools`. `close_shared_tools()` closes every connection (stopping stdio servers).

A stdio server's command runs as the absolute path it resolves to (`python` / `python3`: this process's own
interpreter, `sys.executable`; any other name: the first on the server's PATH), and every error names it.
What the server writes besides the protocol never reaches the console (`ServerOutput`): its stderr is kept,
its last lines only, and lines on its stdout that are not MCP messages are counted (the SDK's log of each is
silenced); both are quoted, briefly, in the error of a server that failed.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import json
import logging
import os
import shlex
import shutil
import sys
import threading
from typing import Any

from rollflow.errors import ConfigError
from rollflow.tools.base import TOOLS, ToolError, check_arguments, on_close_shared, one_line, positive_number

MAX_LIST_PAGES = 100  # tools/list pages read at most: a server that paginates forever cannot hang a make
CLOSE_WAIT_S = 10.0  # closing waits this long for the SDK's bounded shutdown (stdio: 2 s + 2 s + 2 s)
DEAD_ERRORS = ("ClosedResourceError", "BrokenResourceError", "EndOfStream")  # anyio's, by name: no import
STDERR_LINES = 20  # a stdio server's last stderr lines kept
MAX_LINE_CHARS = 200  # of each kept line (stderr, or the first line of stdout that is not a message)
QUOTED_LINES = 3  # the last stderr lines an error quotes
QUOTED_CHARS = 120  # of each
OUTPUT_WAIT_S = 1.0  # how long an error waits for the last of a dead server's stderr
PYTHON_NAMES = ("python", "python3")  # a command that runs this process's own interpreter


class ServerOutput:
    """What a stdio server writes besides the protocol, kept bounded whatever it writes: its stderr (a pipe
    read by a thread of its own; the last `STDERR_LINES` lines, each cut at `MAX_LINE_CHARS`) and the lines
    of its stdout that are not MCP messages (counted; the first kept). `note()` quotes them for an error.

    `errlog` is the pipe's write end, the server's stderr; `close_errlog()` once the server was started (or
    failed to start) lets the reader see the end of the output when the server exits.
    """

    def __init__(self):
        read_end, write_end = os.pipe()  # neither end is inherited by other processes (PEP 446)
        self.errlog = os.fdopen(write_end, "w")
        self.stdout_garbage = 0
        self.first_garbage = ""
        self._lines: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self._reader = threading.Thread(target=self._read, args=(os.fdopen(read_end, "rb"),),
                                        name="rollflow-mcp-stderr", daemon=True)
        self._reader.start()

    def _read(self, pipe: Any) -> None:
        with pipe:
            partial = False  # inside a line longer than MAX_LINE_CHARS: its rest is dropped
            while chunk := pipe.readline(MAX_LINE_CHARS):
                if not partial:
                    self._lines.append(chunk.decode(errors="replace").rstrip())
                partial = not chunk.endswith(b"\n")

    def garbage(self, error: Exception) -> None:
        """Count a stdout line the SDK could not read as a message (`error`: its parse error)."""
        self.stdout_garbage += 1
        if self.stdout_garbage == 1:
            errors = getattr(error, "errors", None)
            line = errors()[0].get("input") if callable(errors) and errors() else None
            self.first_garbage = one_line(line if isinstance(line, str) else str(error), MAX_LINE_CHARS)

    def close_errlog(self) -> None:
        self.errlog.close()

    def note(self, wait_s: float = 0.0) -> str:
        """"; it wrote N lines to stdout that are not MCP messages (the first: ...); its stderr ended: ..."
        (empty when it wrote neither), after waiting up to `wait_s` for the rest of its stderr."""
        self._reader.join(wait_s)
        parts = []
        if self.stdout_garbage:
            parts.append(f"it wrote {self.stdout_garbage} line(s) to stdout that are not MCP messages (the first: "
                         f"{self.first_garbage!r}); a stdio server writes only MCP messages to stdout, and logs to "
                         "stderr")
        lines = [one_line(line, QUOTED_CHARS) for line in self._lines if line.strip()][-QUOTED_LINES:]
        if lines:
            parts.append(f"its stderr ended: {' | '.join(lines)}")
        return "".join(f"; {part}" for part in parts)


def _not_a_parse_failure(record: logging.LogRecord) -> bool:
    """Drops the SDK's log of a stdout line that is not a message (a traceback per line): `ServerOutput`
    counts them and the connection's errors say so."""
    return record.funcName != "_parse_line"


class MCPConnection:
    """One connection to an MCP server, on its own event loop thread; connected (and listed) on creation.

    Args:
        label: names the server in errors ("mcp server /usr/bin/python3 server.py").
        server: what `mcp.Client` connects to: `StdioServerParameters` (its output kept in `output`) or a URL.
        startup_timeout_s: how long connecting and listing the tools may take.

    Raises:
        ConfigError: the server cannot start, connect or list its tools in time (one line naming it, quoting
            the end of its stderr).
    """

    def __init__(self, label: str, server: Any, startup_timeout_s: float):
        self.label = label
        self.dead: str | None = None  # why calls can no longer succeed
        self.tools: list[Any] = []  # the server's `mcp.types.Tool`s
        self._client: Any = None
        self._server = server
        self.output = None if isinstance(server, str) else ServerOutput()
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._loop = asyncio.new_event_loop()
        self._task = self._loop.create_task(self._serve())
        self._thread = threading.Thread(target=self._run, name="rollflow-mcp", daemon=True)
        self._thread.start()
        try:
            self.tools = self._ready.result(timeout=startup_timeout_s)
        except concurrent.futures.TimeoutError:
            self.close()
            raise ConfigError(f"{label} did not start and list its tools within {startup_timeout_s:g} s"
                              f"{self.output_note()}") from None
        except Exception as error:  # whatever the SDK raised becomes one line
            self.close()
            raise ConfigError(f"{label} cannot start or connect: {describe(error)}{self.output_note()}") from None

    def output_note(self) -> str:
        """What the server wrote besides the protocol, for an error (`ServerOutput.note`); "" for a URL."""
        return "" if self.output is None else self.output.note(OUTPUT_WAIT_S)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._task)
        except BaseException:  # the task records its own failure in `dead`
            pass
        finally:
            try:
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            finally:
                self._loop.close()

    async def _serve(self) -> None:
        """Connect, list the tools, then hold the connection open until cancelled (by `close`)."""
        from mcp import Client
        from mcp.client.stdio import stdio_client

        server, output = self._server, self.output
        try:
            if output is not None:
                logging.getLogger("mcp.client.stdio").addFilter(_not_a_parse_failure)  # added once (a duplicate is skipped)
                server = stdio_client(server, errlog=output.errlog)
            async with Client(server, message_handler=self._on_message) as client:
                tools: list[Any] = []
                cursor = None
                for _ in range(MAX_LIST_PAGES):
                    page = await client.list_tools(cursor=cursor)
                    tools += page.tools
                    cursor = page.next_cursor
                    if cursor is None:
                        break
                self._client = client
                self._ready.set_result(tools)
                await asyncio.Event().wait()  # until cancelled
        except BaseException as error:
            self.dead = self.dead or describe(error)
            if not self._ready.done():
                self._ready.set_exception(error if isinstance(error, Exception) else RuntimeError("cancelled"))
            if not isinstance(error, Exception):
                raise
        finally:
            self.dead = self.dead or "closed"
            if output is not None:  # the server was started, or failed to: the reader may see its output end
                output.close_errlog()

    async def _on_message(self, message: Any) -> None:
        """The SDK's message handler: a stdout line that is not a message arrives as its parse error."""
        if isinstance(message, Exception) and self.output is not None:
            self.output.garbage(message)
        await asyncio.sleep(0)

    def call_tool(self, name: str, arguments: dict[str, Any], timeout_s: float) -> str:
        """Call tool `name` on the server, waiting at most `timeout_s`.

        Returns:
            The result's text contents, joined by newlines.

        Raises:
            ToolError: the server reported an error (its text), the call timed out, or the connection died.
        """
        if self.dead is not None or self._client is None:
            raise ToolError(f"{self.label} is not connected ({self.dead or 'not started'})")
        request = self._client.call_tool(name, arguments, read_timeout_seconds=timeout_s)
        try:
            future = asyncio.run_coroutine_threadsafe(request, self._loop)
        except RuntimeError:  # the loop is closed
            request.close()
            raise ToolError(f"{self.label} is not connected ({self.dead or 'closed'})") from None
        timed_out = ToolError(f"mcp tool {name!r} timed out after {timeout_s:g} s")
        try:
            result = future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise timed_out from None
        except Exception as error:  # a failed call is one line for the model
            code = getattr(error, "code", None)
            if code == -32001:  # mcp_types.REQUEST_TIMEOUT: the SDK's own read time-out
                raise timed_out from None
            if code == -32000 or type(error).__name__ in DEAD_ERRORS or isinstance(error, OSError):
                self.dead = describe(error)  # mcp_types.CONNECTION_CLOSED or a broken stream
                raise ToolError(one_line(f"{self.label} connection lost: {self.dead}{self.output_note()}")) from None
            raise ToolError(f"mcp tool {name!r} failed: {describe(error)}") from None
        return result_text(name, result)

    def close(self) -> None:
        """Disconnect (a stdio server is stopped) and end the loop thread, waiting at most `CLOSE_WAIT_S`."""
        self.dead = self.dead or "closed"
        try:
            self._loop.call_soon_threadsafe(self._task.cancel)
        except RuntimeError:  # the loop is closed already
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(CLOSE_WAIT_S)
            if self.output is not None and not self._thread.is_alive():  # a loop that never ran `_serve`
                self.output.close_errlog()


def result_text(name: str, result: Any) -> str:
    """The text of a `CallToolResult`: its text contents joined (other contents as `[image]`, ...), or its
    structured content as JSON when it has no content. Raises ToolError (one line) for an error result."""
    parts = [item.text if item.type == "text" else f"[{item.type}]" for item in result.content or []]
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    text = "\n".join(parts)
    if result.is_error:
        raise ToolError(one_line(text) or f"mcp tool {name!r} failed")
    return text


def describe(error: BaseException) -> str:
    """One line for an exception, looking inside exception groups (the SDK's task groups raise them)."""
    while getattr(error, "exceptions", None):  # an ExceptionGroup (a builtin from Python 3.11 only)
        error = error.exceptions[0]
    message = getattr(error, "message", None) or str(error)
    if isinstance(error, OSError) and error.strerror:
        message = f"{error.strerror}: {error.filename}" if error.filename else error.strerror
    return one_line(f"{type(error).__name__}: {message}" if message else type(error).__name__)


class MCPTool:
    """One tool of an MCP server. Its `close()` leaves the shared connection open.

    Args:
        connection: the server's shared connection.
        info: the server's description of the tool (`mcp.types.Tool`).
        timeout_s: how long one call may take.
    """

    def __init__(self, connection: MCPConnection, info: Any, timeout_s: float):
        self.name = info.name
        self.connection = connection
        self.timeout_s = timeout_s
        description = info.description or info.title or info.name
        self._schema = {
            "type": "function",
            "function": {"name": info.name, "description": description, "parameters": parameters(info.input_schema)},
        }

    def schema(self) -> dict[str, Any]:
        return copy.deepcopy(self._schema)

    def call(self, arguments: dict[str, Any]) -> str:
        """Call the tool on its server. Returns its text; raises ToolError (one line)."""
        check_arguments(self._schema, arguments)
        return self.connection.call_tool(self.name, arguments, self.timeout_s)

    def close(self) -> None:
        """Nothing to release (the connection is shared)."""


def parameters(input_schema: dict[str, Any] | None) -> dict[str, Any]:
    """An MCP input schema as function parameters: an object schema, less the `title`s that pydantic adds to
    it and to each property (tokens in a small model's prompt, saying nothing)."""
    schema = {key: value for key, value in (input_schema or {}).items() if key != "title"}
    schema.setdefault("type", "object")
    properties = schema.get("properties")
    if isinstance(properties, dict):
        schema["properties"] = {
            key: {k: v for k, v in value.items() if k != "title"} if isinstance(value, dict) else value
            for key, value in properties.items()
        }
    else:
        schema["properties"] = {}
    return schema


_connections: dict[str, MCPConnection] = {}
_connecting: dict[str, threading.Lock] = {}
_connections_lock = threading.Lock()


def shared_connection(key: str, label: str, server: Any, startup_timeout_s: float) -> MCPConnection:
    """The process's connection for `key`, connecting (once, even across threads) when there is none or the
    last one died."""
    with _connections_lock:
        lock = _connecting.setdefault(key, threading.Lock())
    with lock:
        with _connections_lock:
            connection = _connections.get(key)
        if connection is not None and connection.dead is None:
            return connection
        if connection is not None:
            connection.close()
        connection = MCPConnection(label, server, startup_timeout_s)
        with _connections_lock:
            _connections[key] = connection
        return connection


def close_connections() -> None:
    """Close every shared MCP connection (the next make connects again)."""
    with _connections_lock:
        connections = list(_connections.values())
        _connections.clear()
    for connection in connections:
        connection.close()


on_close_shared(close_connections)


def check_mcp_options(command: list[str] | None = None, url: str | None = None, env: dict[str, str] | None = None,
                      timeout_s: float = 10.0, startup_timeout_s: float = 30.0, tools: list[str] | None = None) -> None:
    """Check an `mcp` spec's options without starting or connecting to the server (`check_tools`, at config
    load): the SDK is installed, the options' types, and a stdio server's command is found."""
    _options(command, url, env, timeout_s, startup_timeout_s, tools)


@TOOLS.register("mcp")
def make_mcp_tools(
    command: list[str] | None = None,
    url: str | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 10.0,
    startup_timeout_s: float = 30.0,
    tools: list[str] | None = None,
) -> list[MCPTool]:
    """The tools of one MCP server.

    Args:
        command: a stdio server's argv, e.g. `["python", "server.py"]`; started in the working directory,
            with the SDK's default environment (HOME, PATH, USER, ...) plus `env`. Its first element runs as
            the absolute path it resolves to: `python` or `python3` is this process's own interpreter
            (`sys.executable`), any other name the first executable of that name on the server's PATH.
        url: a streamable HTTP endpoint instead, e.g. `"http://127.0.0.1:8000/mcp"`.
        env: more environment variables for a stdio server.
        timeout_s: how long one call may take.
        startup_timeout_s: how long connecting and listing the tools may take.
        tools: keep only these of the server's tools (default: all).

    Returns:
        One tool per server tool kept, in the server's order.

    Raises:
        ConfigError: bad options, a command that is not found, a server that cannot start or connect, or a
            name in `tools` it lacks.
    """
    timeout_s, startup_timeout_s, (key, label, server) = _options(command, url, env, timeout_s, startup_timeout_s,
                                                                  tools)
    connection = shared_connection(key, label, server, startup_timeout_s)
    listed = {info.name: info for info in connection.tools}
    missing = [name for name in tools or [] if name not in listed]
    if missing:
        raise ConfigError(f"{label} has no tool {missing[0]!r}; it has: {', '.join(listed) or 'none'}")
    return [MCPTool(connection, info, timeout_s) for name, info in listed.items() if tools is None or name in tools]


make_mcp_tools.check_options = check_mcp_options  # what `check_tools` runs instead of making the tools


def _options(command: Any, url: Any, env: Any, timeout_s: Any, startup_timeout_s: Any,
             tools: Any) -> tuple[float, float, tuple[str, str, Any]]:
    """The checked options: (timeout_s, startup_timeout_s, `_server`'s (key, label, server))."""
    try:
        import mcp  # noqa: F401  (the SDK is an extra)
    except ImportError:
        raise ConfigError("tool 'mcp' needs the MCP SDK: pip install 'rollflow[mcp]'") from None
    timeout_s = positive_number("mcp", "timeout_s", timeout_s)
    startup_timeout_s = positive_number("mcp", "startup_timeout_s", startup_timeout_s)
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, str) for t in tools)):
        raise ConfigError(f"tool 'mcp': option 'tools' must be a list of tool names, got {tools!r}")
    return timeout_s, startup_timeout_s, _server(command, url, _environment(env))


def _environment(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ConfigError(f"tool 'mcp': option 'env' must map variable names to strings, got {value!r}")
    return dict(value)


def _server(command: Any, url: Any, env: dict[str, str] | None) -> tuple[str, str, Any]:
    """(cache key, label, what `mcp.Client` connects to) of the server a spec names."""
    if (command is None) == (url is None):
        raise ConfigError(
            "tool 'mcp' needs exactly one of 'command' (a stdio server's argv) or 'url' (a streamable HTTP endpoint)"
        )
    if command is not None:
        if not isinstance(command, list) or not command or not all(isinstance(a, str) and a for a in command):
            raise ConfigError(f"tool 'mcp': option 'command' must be a list of strings (argv), got {command!r}")
        from mcp import StdioServerParameters

        argv = [executable(command[0], env), *command[1:]]
        key = json.dumps({"command": argv, "env": env}, sort_keys=True)
        label = f"mcp server {one_line(shlex.join(argv), 300)}"  # one line, whatever a `-c` program holds
        return key, label, StdioServerParameters(command=argv[0], args=argv[1:], env=env)
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigError(f"tool 'mcp': option 'url' must be an http:// or https:// URL, got {url!r}")
    if env is not None:
        raise ConfigError("tool 'mcp': option 'env' is for a 'command' server")
    return json.dumps({"url": url}), f"mcp server {url}", url


def executable(name: str, env: dict[str, str] | None) -> str:
    """The absolute path a stdio server's command runs: this process's interpreter for `python` / `python3`
    (the run's own, with its packages, whatever else PATH holds), else the first `name` on the server's PATH
    (`env`'s, or this process's), or `name` itself made absolute when it is a path.

    Raises:
        ConfigError: no executable file is found (one line naming the PATH searched).
    """
    if name in PYTHON_NAMES and sys.executable:
        return sys.executable
    path = (env or {}).get("PATH", os.environ.get("PATH", os.defpath))
    found = shutil.which(name, path=path)
    if found is None:
        where = "is not an executable file" if os.sep in name else f"is not found on PATH ({one_line(path, 200)})"
        raise ConfigError(f"tool 'mcp': the command {name!r} {where}")
    return os.path.abspath(found)
