"""Code reward: run the model's Python program against test cases in the sandbox.

The row's `tests` column (a list, or a JSON string of one) holds either style:

* stdin/stdout: `[{"input": "1 2\\n", "output": "3\\n"}, ...]` — the program runs once per case with that
  stdin; its stdout must match the expected output up to trailing whitespace on each line and blank lines
  at the end.
* call-a-function: `[{"fn_name": "add", "args": [1, 2], "output": 3}, ...]` (`"kwargs"` optional) — the
  program is loaded once and each call's return value is compared with `output` (lists and tuples alike,
  floats to 1e-6 relative). APPS/TACO-style `{"fn_name": ..., "inputs": [[...], ...], "outputs": [...]}`
  and stdin-style `{"inputs": [...], "outputs": [...]}` dicts are accepted too.

Expected outputs never enter the sandbox: the program's outputs or return values come out and are compared
here, so a program cannot read the answers or forge a "passed" report. A compile error, crash, timeout
or limit hit scores 0 for the cases it affects.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

from rollflow.rewards.registry import REWARD_FUNCTIONS, needs_columns, require_column
from rollflow.rewards.sandbox import Sandbox, SandboxLimits, default_sandbox

_FENCED_BLOCK = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_RESULT_MARKER = "__rollflow_results__"

# Runs inside the sandbox: loads the solution, calls the function for each case, prints the return values.
_FUNCTION_HARNESS = r"""
import json, signal, sys
cases = json.load(open("cases.json"))
per_case_s = float(sys.argv[1])
class CaseTimeout(BaseException):
    pass
def on_alarm(signum, frame):
    raise CaseTimeout
namespace = {"__name__": "solution"}
results = []
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), namespace)
except BaseException as error:
    print(json.dumps({"load_error": type(error).__name__}), flush=True)
    raise SystemExit(0)
for case in cases:
    name = case["fn_name"]
    fn = namespace.get(name)
    if fn is None and "Solution" in namespace:  # LeetCode style
        fn = getattr(namespace["Solution"](), name, None)
    try:
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, per_case_s)
        try:
            value = fn(*case["args"], **case["kwargs"])
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        results.append({"value": json.loads(json.dumps(value, default=repr))})
    except BaseException as error:
        results.append({"error": type(error).__name__})
print("MARKER" + json.dumps(results), flush=True)
""".replace("MARKER", _RESULT_MARKER)


@dataclass(frozen=True)
class StdioCase:
    """One stdin/stdout test case."""

    input: str
    output: str


@dataclass(frozen=True)
class CallCase:
    """One call-a-function test case."""

    fn_name: str
    args: list[Any]
    kwargs: dict[str, Any]
    output: Any


def extract_code(completion: str) -> str:
    """The program in a completion: the last fenced Python block, else the last fenced block, else all.

    Args:
        completion: the model's completion.

    Returns:
        The program text.
    """
    blocks = _FENCED_BLOCK.findall(completion)
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    if blocks:
        return blocks[-1][1]
    return completion


def parse_tests(tests: Any) -> list[StdioCase | CallCase]:
    """Normalize a `tests` column into test cases.

    Args:
        tests: a list of case dicts, an APPS-style dict of parallel lists, or a JSON string of either.

    Returns:
        The cases.

    Raises:
        ValueError: the column has no recognizable cases.
    """
    if isinstance(tests, str):
        tests = json.loads(tests)
    if isinstance(tests, dict):  # APPS / TACO: {"inputs": [...], "outputs": [...], "fn_name"?: ...}
        inputs, outputs = tests.get("inputs", []), tests.get("outputs", [])
        if "fn_name" in tests:
            tests = [
                {"fn_name": tests["fn_name"], "args": list(args), "output": _unwrap_single(output)}
                for args, output in zip(inputs, outputs)
            ]
        else:
            tests = [{"input": i, "output": o} for i, o in zip(inputs, outputs)]
    cases: list[StdioCase | CallCase] = []
    for case in tests or []:
        if "fn_name" in case:
            cases.append(
                CallCase(
                    case["fn_name"],
                    list(case.get("args", [])),
                    dict(case.get("kwargs", {})),
                    case.get("output"),
                )
            )
        elif "input" in case and "output" in case:
            cases.append(StdioCase(_as_text(case["input"]), _as_text(case["output"])))
        else:
            raise ValueError(f"code test case needs 'input'/'output' or 'fn_name'/'args'/'output': {case!r}")
    if not cases:
        raise ValueError("the 'tests' column holds no test cases")
    return cases


def _as_text(value: Any) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _unwrap_single(output: Any) -> Any:
    """APPS wraps each expected return value in a one-element list."""
    return output[0] if isinstance(output, list) and len(output) == 1 else output


def _normalize_stdout(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def values_equal(got: Any, expected: Any) -> bool:
    """Compare a returned value with the expected one: tuples equal lists, floats to 1e-6 relative.

    Args:
        got: the value the program returned (after a JSON round trip).
        expected: the expected value.

    Returns:
        Whether they match.
    """
    if isinstance(got, bool) or isinstance(expected, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(got, (int, float)) and isinstance(expected, (int, float)):
        return math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(got, (list, tuple)) and isinstance(expected, (list, tuple)):
        return len(got) == len(expected) and all(values_equal(g, e) for g, e in zip(got, expected))
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(values_equal(got[k], expected[k]) for k in got)
    return got == expected


def run_stdio_case(sandbox: Sandbox, program: str, case: StdioCase, limits: SandboxLimits) -> bool:
    """Run the program on one stdin case.

    Args:
        sandbox: where to run it.
        program: Python source.
        case: the case.
        limits: limits for this run.

    Returns:
        Whether it exited cleanly with the expected output.
    """
    result = sandbox.run_python(program, stdin=case.input, limits=limits)
    if not result.ok:
        return False
    return _normalize_stdout(result.stdout.decode(errors="replace")) == _normalize_stdout(case.output)


def run_call_cases(
    sandbox: Sandbox, program: str, cases: Sequence[CallCase], limits: SandboxLimits
) -> list[bool]:
    """Load the program once and call its function for every case (each call under `wall_time_s`).

    Args:
        sandbox: where to run it.
        program: Python source defining the function(s) (or a LeetCode-style `Solution` class).
        cases: the calls.
        limits: limits per call; the whole run gets `len(cases)` times the wall and CPU time.

    Returns:
        Pass / fail per case.
    """
    calls = [{"fn_name": c.fn_name, "args": c.args, "kwargs": c.kwargs} for c in cases]
    scale = len(cases) + 1
    run_limits = SandboxLimits(
        **{
            **limits.__dict__,
            "wall_time_s": limits.wall_time_s * scale,
            "cpu_time_s": limits.cpu_time_s * scale,
        }
    )
    result = sandbox.run(
        ["python", "harness.py", str(limits.wall_time_s)],
        {"harness.py": _FUNCTION_HARNESS, "solution.py": program, "cases.json": json.dumps(calls)},
        limits=run_limits,
    )
    reported = None
    if result.ok:
        for line in result.stdout.decode(errors="replace").splitlines():
            if line.startswith(_RESULT_MARKER):
                reported = line[len(_RESULT_MARKER) :]
    try:
        outcomes = json.loads(reported) if reported else []
    except json.JSONDecodeError:
        outcomes = []
    if not isinstance(outcomes, list) or len(outcomes) != len(cases):
        return [False] * len(cases)
    return [
        isinstance(outcome, dict) and "value" in outcome and values_equal(outcome["value"], case.output)
        for outcome, case in zip(outcomes, cases)
    ]


@REWARD_FUNCTIONS.register("code_tests")
@needs_columns("tests")
def code_tests(
    completion: str,
    *,
    mode: Literal["fraction", "all"] = "fraction",
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    **row,
) -> float:
    """Run the completion's program against the row's `tests`; score passed cases.

    Stdin cases run in parallel through the sandbox's bounded pool; in "all" mode the first failure ends
    the evaluation early.

    Args:
        completion: the model's completion (code is taken from its last fenced block).
        mode: "fraction" scores passed / total, "all" scores 1.0 only if every case passes.
        timeout_s: wall and CPU time per case.
        memory_mb: memory limit per run.
        **row: the dataset row; needs the column `tests` (see the module docstring).

    Returns:
        A reward in [0.0, 1.0].
    """
    if mode not in ("fraction", "all"):
        raise ValueError(f"code_tests mode must be 'fraction' or 'all', got {mode!r}")
    cases = parse_tests(require_column(row, "tests", "code_tests"))
    program = extract_code(completion)
    if not program.strip():
        return 0.0
    sandbox = default_sandbox()
    limits = SandboxLimits(
        **{
            **sandbox.limits.__dict__,
            "wall_time_s": timeout_s,
            "cpu_time_s": timeout_s,
            "memory_bytes": memory_mb << 20,
        }
    )
    call_cases = [c for c in cases if isinstance(c, CallCase)]
    stdio_cases = [c for c in cases if isinstance(c, StdioCase)]
    passed = sum(run_call_cases(sandbox, program, call_cases, limits)) if call_cases else 0
    if mode == "all" and passed < len(call_cases):
        return 0.0
    futures: list[Future] = [sandbox.submit(run_stdio_case, sandbox, program, c, limits) for c in stdio_cases]
    for future in futures:
        ok = future.result()
        passed += ok
        if mode == "all" and not ok:
            for pending in futures:
                pending.cancel()
            return 0.0
    return passed / len(cases) if mode == "fraction" else float(passed == len(cases))
