"""The python tool: a program's output, a time-out, an error's last line, in rollflow's sandbox.

Like tests/rewards/test_sandbox.py, these run at whatever isolation level the machine has (bubblewrap where
installed; the sandbox warns and falls back to weaker levels elsewhere): what they check holds at every level.
"""

from __future__ import annotations

import time

import pytest

from rollflow.tools import ToolError
from rollflow.tools.python_tool import PythonTool


def run(code: str, **options) -> str:
    return PythonTool(**options).call({"code": code})


def test_the_output_is_what_the_program_printed():
    assert run("print(6 * 7)\n") == "42"
    assert run("for i in range(3):\n    print(i)") == "0\n1\n2"
    assert run("x = 1") == "(no output)"


def test_an_error_is_its_last_line():
    with pytest.raises(ToolError, match="^ZeroDivisionError: division by zero$"):
        run("print('before')\n1 / 0")
    with pytest.raises(ToolError, match="^NameError: name 'undefined' is not defined$"):
        run("undefined + 1")
    with pytest.raises(ToolError, match="^exited with status 3$"):
        run("import sys\nsys.exit(3)")


def test_a_program_past_its_time_is_stopped():
    start = time.monotonic()
    with pytest.raises(ToolError, match=r"^timed out after 1 s$"):
        run("while True:\n    pass", timeout_s=1)
    assert time.monotonic() - start < 15  # its 1 s limit, not forever (a hang guard)


def test_long_output_is_cut():
    assert run("print('x' * 100)", max_output_chars=10) == "x" * 10 + " ...(output truncated)"
    flooded = run("while True:\n    print('y' * 100)", max_output_chars=20)
    assert flooded == "y" * 20 + " ...(output truncated)"


def test_the_argument_is_checked():
    with pytest.raises(ToolError, match="missing required argument 'code'"):
        PythonTool().call({"source": "print(1)"})
