"""MCP servers' tools: listed and converted schemas, round trips over stdio and streamable HTTP, errors,
time-outs, a shared connection per server, a dead connection made again, servers that cannot start; the
command that runs, and a server's stderr and stdout garbage kept off the console and quoted in its errors."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from rollflow.errors import ConfigError  # noqa: E402
from rollflow.tools import ToolError, check_tools, close_shared_tools, make_tools  # noqa: E402

SERVER = str(Path(__file__).with_name("mcp_echo_server.py"))
NOISY = str(Path(__file__).with_name("mcp_noisy_server.py"))
STDIO = {"name": "mcp", "command": [sys.executable, SERVER], "timeout_s": 0.5}
ADD_SCHEMA = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


@pytest.fixture(scope="module", autouse=True)
def _close_connections():
    yield
    close_shared_tools()


def by_name(tools):
    return {tool.name: tool for tool in tools}


def round_trip(spec):
    """The same checks over either transport: calls under a limit no call nears (a call takes milliseconds, a
    loaded machine's too), and one call past a short limit, on the same connection."""
    tools = by_name(make_tools([{**spec, "timeout_s": 30}]))
    limited = by_name(make_tools([{**spec, "timeout_s": 0.5, "tools": ["slow"]}]))
    assert limited["slow"].connection is tools["slow"].connection
    assert list(tools) == ["add", "fail", "slow", "crash"]
    assert tools["add"].schema() == ADD_SCHEMA
    assert tools["slow"].schema()["function"]["parameters"]["properties"] == {"seconds": {"type": "number"}}
    assert tools["add"].call({"a": 2, "b": 3}) == "5"
    with pytest.raises(ToolError, match="^Error executing tool fail: this tool always fails$"):
        tools["fail"].call({})
    with pytest.raises(ToolError, match="argument 'a' must be integer, got string"):  # checked before sending
        tools["add"].call({"a": "2", "b": 3})
    start = time.monotonic()
    with pytest.raises(ToolError, match=r"^mcp tool 'slow' timed out after 0\.5 s$"):
        limited["slow"].call({"seconds": 3.0})  # 6x its limit
    assert time.monotonic() - start < 2.5  # its limit, not the tool's 3 s
    assert tools["slow"].call({"seconds": 0.01}) == "done"
    assert tools["add"].call({"a": -1, "b": 1}) == "0"  # the connection outlives a timed-out call


def test_stdio_round_trip():
    round_trip(STDIO)


def test_one_connection_per_server_shared_by_later_makes():
    first = by_name(make_tools([STDIO]))
    first["add"].close()  # a tool's close leaves the connection open
    second = by_name(make_tools([{**STDIO, "timeout_s": 5, "tools": ["add", "slow"]}]))
    assert list(second) == ["add", "slow"]
    assert second["add"].connection is first["add"].connection
    assert second["add"].call({"a": 20, "b": 22}) == "42"


def test_episodes_on_many_threads_share_one_connection():
    def episode(i):
        tools = by_name(make_tools([{**STDIO, "env": {"ROLLFLOW_TEST_SERVER": "threads"}}]))
        return tools["add"].connection, tools["add"].call({"a": i, "b": 1})

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(episode, range(16)))
    assert len({id(connection) for connection, _ in results}) == 1
    assert [answer for _, answer in results] == [str(i + 1) for i in range(16)]


def test_a_dead_connection_fails_its_calls_and_is_made_again():
    spec = {**STDIO, "env": {"ROLLFLOW_TEST_SERVER": "crash"}}  # its own server, not the shared one
    tools = by_name(make_tools([spec]))
    with pytest.raises(ToolError, match="connection lost"):
        tools["crash"].call({})
    with pytest.raises(ToolError, match="is not connected"):
        tools["add"].call({"a": 1, "b": 1})
    again = by_name(make_tools([spec]))
    assert again["add"].connection is not tools["add"].connection
    assert again["add"].call({"a": 1, "b": 1}) == "2"


def test_a_tool_the_server_lacks_is_a_config_error():
    with pytest.raises(ConfigError, match="has no tool 'multiply'; it has: add, fail, slow, crash"):
        make_tools([{**STDIO, "tools": ["add", "multiply"]}])


@pytest.mark.parametrize(("command", "message"), [
    (["/nonexistent/mcp-server"], r"tool 'mcp': the command '/nonexistent/mcp-server' is not an executable file"),
    (["no-such-mcp-server", "--stdio"], r"tool 'mcp': the command 'no-such-mcp-server' is not found on PATH \(/"),
    ([sys.executable, "-c", "pass"], r"mcp server .* -c pass cannot start or connect: MCPError: Connection closed"),
])
def test_a_server_that_cannot_start_is_a_config_error(command, message):
    with pytest.raises(ConfigError, match=message) as error:
        make_tools([{"name": "mcp", "command": command}])
    assert "\n" not in str(error.value)


def test_a_bare_python_runs_this_interpreter_and_errors_name_the_path_that_ran():
    [add] = make_tools([{"name": "mcp", "command": ["python", SERVER], "tools": ["add"]}])
    assert add.connection.label == f"mcp server {sys.executable} {SERVER}"
    assert add.call({"a": 1, "b": 2}) == "3"
    with pytest.raises(ConfigError, match=rf"^mcp server {re.escape(sys.executable)} -c pass cannot start"):
        make_tools([{"name": "mcp", "command": ["python3", "-c", "pass"]}])


def test_check_tools_finds_the_command_without_starting_the_server(tmp_path):
    started = tmp_path / "started"
    check_tools([{"name": "mcp", "command": ["python", "-c", f"open({str(started)!r}, 'w')"]}])
    with pytest.raises(ConfigError, match="the command 'no-such-mcp-server' is not found on PATH"):
        check_tools([{"name": "mcp", "command": ["no-such-mcp-server"]}])
    assert not started.exists()


def test_garbage_on_stdout_is_one_line_that_quotes_it_not_the_sdk_s_tracebacks(caplog, capfd):
    with pytest.raises(ConfigError) as error:
        make_tools([{"name": "mcp", "command": [sys.executable, NOISY, "garbage"]}])
    assert str(error.value).startswith(f"mcp server {sys.executable} {NOISY} garbage cannot start or connect: ")
    assert ("; it wrote 50 line(s) to stdout that are not MCP messages (the first: 'garbage line 0: a print() that "
            "should have gone to stderr'); a stdio server writes only MCP messages to stdout") in str(error.value)
    assert [record for record in caplog.records if record.name.startswith("mcp")] == []  # once 50 tracebacks
    assert capfd.readouterr().err == ""


def test_a_server_that_prints_garbage_then_serves_works():
    tools = by_name(make_tools([{"name": "mcp", "command": [sys.executable, NOISY, "garbage-serve"]}]))
    assert tools["raises"].connection.output.stdout_garbage == 50


def test_a_server_that_crashes_at_start_is_one_line_that_quotes_the_end_of_its_stderr(capfd):
    with pytest.raises(ConfigError) as error:
        make_tools([{"name": "mcp", "command": [sys.executable, NOISY, "crash"]}])
    message = str(error.value)
    assert "cannot start or connect: MCPError: Connection closed; its stderr ended: " in message
    assert message.endswith("| RuntimeError: the tool's dependency is broken") and "\n" not in message
    assert len(message) < 700
    assert capfd.readouterr().err == ""  # once ~130 lines of the server's traceback


def test_a_tool_that_crashes_the_server_fails_in_one_line_that_quotes_its_stderr(capfd):
    tools = by_name(make_tools([{"name": "mcp", "command": [sys.executable, NOISY, "serve"]}]))
    with pytest.raises(ToolError, match=r"^Error executing tool raises$"):  # its traceback stays in the server's log
        tools["raises"].call({})
    with pytest.raises(ToolError, match=r"connection lost: .*; its stderr ended: .*RuntimeError: the tool's "
                                        r"dependency is broken$"):
        tools["dies"].call({})
    assert capfd.readouterr().err == ""


def test_the_kept_stderr_is_bounded_whatever_the_server_writes():
    flood = "import sys\nfor i in range(2000): print('x' * 5000, i, file=sys.stderr)\nprint('the end', file=sys.stderr)"
    with pytest.raises(ConfigError, match=r"its stderr ended: x{117}\.\.\. \| x{117}\.\.\. \| the end$") as error:
        make_tools([{"name": "mcp", "command": [sys.executable, "-c", flood]}])
    assert len(str(error.value)) < 1000 and "\n" not in str(error.value)


def test_a_server_that_never_answers_is_bounded_by_the_startup_timeout():
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"did not start and list its tools within 0\.5 s"):
        make_tools([{"name": "mcp", "command": [sys.executable, "-c", "import time; time.sleep(60)"],
                     "startup_timeout_s": 0.5}])
    assert time.monotonic() - start < 30  # the wait, then the SDK's bounded shutdown; not 60 s (a hang guard)


@pytest.mark.parametrize(("options", "message"), [
    ({}, "needs exactly one of 'command'"),
    ({"command": ["x"], "url": "http://127.0.0.1:1/mcp"}, "needs exactly one of 'command'"),
    ({"command": "python server.py"}, "option 'command' must be a list of strings"),
    ({"url": "ftp://host/mcp"}, "option 'url' must be an http:// or https:// URL"),
    ({"url": "http://127.0.0.1:1/mcp", "env": {"A": "1"}}, "option 'env' is for a 'command' server"),
    ({"command": ["x"], "env": {"A": 1}}, "option 'env' must map variable names to strings"),
    ({"command": ["x"], "timeout_s": 0}, "option 'timeout_s' must be a number above 0"),
    ({"command": ["x"], "tools": "add"}, "option 'tools' must be a list of tool names"),
])
def test_bad_options(options, message):
    with pytest.raises(ConfigError, match=message):
        make_tools([{"name": "mcp", **options}])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def http_server():
    """The echo server over streamable HTTP, in a subprocess on a free port; its URL once it listens."""
    port = _free_port()
    process = subprocess.Popen([sys.executable, SERVER, "--http", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"the MCP HTTP server exited with status {process.returncode}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("the MCP HTTP server did not listen within 30 s")
                time.sleep(0.1)
        yield process, f"http://127.0.0.1:{port}/mcp"
    finally:
        close_shared_tools()  # a client still connected makes the server's graceful stop wait for it
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def test_streamable_http_round_trip(http_server):
    _, url = http_server
    round_trip({"name": "mcp", "url": url})


def test_a_gone_http_server_fails_the_call_and_the_next_make(http_server):
    process, url = http_server
    tools = by_name(make_tools([{"name": "mcp", "url": url, "timeout_s": 2}]))
    process.terminate()
    process.wait(timeout=10)
    start = time.monotonic()
    with pytest.raises(ToolError, match=r"mcp server http://.* connection lost"):
        tools["add"].call({"a": 1, "b": 1})
    assert time.monotonic() - start < 3
    with pytest.raises(ConfigError, match=r"mcp server http://.* cannot start or connect"):  # made again: refused
        make_tools([{"name": "mcp", "url": url}])
    assert time.monotonic() - start < 10
