"""The `python` tool: run a program the model wrote in rollflow's sandbox and show what it printed.

The program runs as `main.py` in `rollflow.rewards.sandbox`'s process-wide sandbox (bubblewrap where it is
available: no network, a private file system view, CPU, memory and process limits), with the standard
library only. A wall-time limit ends it; its error's last line (`NameError: name 'x' is not defined`) is
the failed call's message.
"""

from __future__ import annotations

from typing import Any

from rollflow.tools.base import (
    TOOLS,
    ToolError,
    check_arguments,
    function_schema,
    one_line,
    positive_int,
    positive_number,
)

MIN_OUTPUT_BYTES = 4096  # the sandbox's output cap, at least; the text is cut to max_output_chars after


class PythonTool:
    """The `python` tool. Argument: `code` (string).

    Args:
        timeout_s: wall-time and CPU-time limit of one run, in seconds.
        max_output_chars: the printed output is cut to this many characters.
        memory_mb: the program's memory limit.
    """

    name = "python"

    def __init__(self, timeout_s: float = 5.0, max_output_chars: int = 1000, memory_mb: int = 512):
        self.timeout_s = positive_number(self.name, "timeout_s", timeout_s)
        self.max_output_chars = positive_int(self.name, "max_output_chars", max_output_chars)
        self.memory_mb = positive_int(self.name, "memory_mb", memory_mb)

    def schema(self) -> dict[str, Any]:
        code = {"type": "string", "description": "a Python program; print what you want to see"}
        return function_schema(self.name, "Run Python code and return what it prints.", {"code": code}, ["code"])

    def call(self, arguments: dict[str, Any]) -> str:
        """Run `arguments["code"]`.

        Returns:
            Its standard output, stripped and cut to `max_output_chars` ("(no output)" when it printed
            nothing).

        Raises:
            ToolError: it timed out, or exited non-zero (the message: its standard error's last line).
        """
        from rollflow.rewards.sandbox import SandboxLimits, default_sandbox

        check_arguments(self.schema(), arguments)
        limits = SandboxLimits(
            wall_time_s=self.timeout_s,
            cpu_time_s=self.timeout_s,
            memory_bytes=self.memory_mb << 20,
            max_output_bytes=max(MIN_OUTPUT_BYTES, 4 * self.max_output_chars),
        )
        result = default_sandbox().run_python(arguments["code"], limits=limits)
        if result.timed_out:
            raise ToolError(f"timed out after {self.timeout_s:g} s")
        if result.returncode is not None and result.returncode != 0:
            lines = result.stderr.decode(errors="replace").strip().splitlines()
            if lines:
                raise ToolError(one_line(lines[-1]))
            if result.returncode < 0:
                raise ToolError(f"killed by signal {-result.returncode}")
            raise ToolError(f"exited with status {result.returncode}")
        text = result.stdout.decode(errors="replace").strip()
        if len(text) > self.max_output_chars or result.output_limited:
            return text[: self.max_output_chars] + " ...(output truncated)"
        return text or "(no output)"

    def close(self) -> None:
        """Nothing to release (the sandbox is process-wide)."""


@TOOLS.register("python")
def make_python(timeout_s: float = 5.0, max_output_chars: int = 1000, memory_mb: int = 512) -> PythonTool:
    """The `python` tool (options: see `PythonTool`)."""
    return PythonTool(timeout_s, max_output_chars, memory_mb)
