"""Countdown with a Python tool: combine the given numbers with + - * / to make the target.

Each turn the model either calls the tool (a program, run in the sandbox, whose output is the next
observation) or answers with an expression, which is checked by a safe evaluator (never `eval`).
"""

from __future__ import annotations

import ast
import random
import re
from fractions import Fraction
from typing import Any

from rollflow.envs.actions import find_tag
from rollflow.envs.base import ENVS, StepResult
from rollflow.errors import ConfigError

INSTRUCTIONS = """\
The observation is the task, e.g. "use 3 5 7 to make 22": write an expression with + - * / and parentheses
that uses each given number exactly once and equals the target. A turn is either a tool call,
<python>print(3*5+7)</python> (the closing tag may be left out), answered with the program's output, or an
answer, <answer>3*5+7</answer> or a line holding only the expression. A right answer gives reward 1, a wrong
one 0; both end the episode. Tool calls beyond the limit, and replies that are neither, are invalid."""

MAX_OBSERVATION_CHARS = 60  # of a tool call's output
MAX_EXPRESSION_CHARS = 200
MAX_TARGET_DRAWS = 1_000
_EXPRESSION_LINE = re.compile(r"^[\d\s+\-*/()]*\d[\d\s+\-*/()]*$")
_OPERATORS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


@ENVS.register("countdown")
class Countdown:
    """Countdown numbers game with a sandboxed Python tool.

    Args:
        num_count: how many numbers are given.
        max_number: numbers are drawn from 1..max_number.
        max_target: targets are drawn in 1..max_target.
        max_turns: turns (valid or not) before the episode is truncated.
        max_tool_calls: tool calls allowed per episode; more are invalid.
        tool_reward: the reward of a tool call whose program exits cleanly.
        invalid_penalty: the reward of an invalid turn.
        sandbox_timeout_s: wall-time and CPU-time limit of one tool call.
        sandbox: runs the programs: an object with `run_python(source, limits=...)` (default: rollflow's
            process-wide `Sandbox`).
    """

    def __init__(
        self,
        num_count: int = 3,
        max_number: int = 9,
        max_target: int = 100,
        max_turns: int = 4,
        max_tool_calls: int = 3,
        tool_reward: float = 0.0,
        invalid_penalty: float = -0.1,
        sandbox_timeout_s: float = 5.0,
        sandbox: Any = None,
    ):
        if num_count < 1 or max_number < 1 or max_target < 1:
            raise ConfigError("countdown: num_count, max_number and max_target must be >= 1")
        self.num_count, self.max_number, self.max_target = num_count, max_number, max_target
        self.max_turns = max_turns
        self.max_tool_calls = max_tool_calls
        self.tool_reward = tool_reward
        self.invalid_penalty = invalid_penalty
        self.sandbox_timeout_s = sandbox_timeout_s
        self._sandbox = sandbox
        self.numbers: list[int] = []
        self.target = 0
        self.solution = ""
        self.tool_calls = 0
        self.turns = 0
        self.done = False
        self.success = False
        self.task = ""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """Draw the numbers and a reachable target.

        Args:
            seed: the episode; None draws one.

        Returns:
            (observation, info).
        """
        rng = random.Random(random.randrange(2**31) if seed is None else seed)
        for _ in range(MAX_TARGET_DRAWS):
            self.numbers = [rng.randint(1, self.max_number) for _ in range(self.num_count)]
            self.solution, value = random_expression(self.numbers, rng, exact_division=True)
            if value.denominator == 1 and 1 <= value <= self.max_target:
                break
        else:
            raise ConfigError(f"countdown: no target in 1..{self.max_target} in {MAX_TARGET_DRAWS} draws")
        self.target = int(value)
        self.tool_calls, self.turns, self.done, self.success = 0, 0, False, False
        self.task = f"use {' '.join(map(str, self.numbers))} to make {self.target}"
        return self.task, {"success": False, "anchor": self.task}

    def step(self, action: str) -> StepResult:
        """Run the model's tool call or check its answer.

        Args:
            action: what the model wrote (see `INSTRUCTIONS`).

        Returns:
            (observation, reward, terminated, truncated, info); `info["tool_calls"]` is 1 on a tool call.
        """
        if self.done:
            return self._result(self.task, 0.0, False)
        self.turns += 1
        tool = find_tag(action, "python")
        answer = find_tag(action, "answer")
        if tool is not None and (answer is None or tool[0] < answer[0]):
            if self.tool_calls >= self.max_tool_calls:
                return self._result("no tool calls left", self.invalid_penalty, True)
            self.tool_calls += 1
            output, ok = self._run_tool(tool[1])
            return self._result(output, self.tool_reward if ok else 0.0, False, tool_calls=1)
        expression = answer[1].strip() if answer is not None else _expression_line(action)
        numbers_used, value = evaluate_expression(expression or "")
        if value is None:
            return self._result(self.task, self.invalid_penalty, True)
        self.done = True
        self.success = sorted(numbers_used) == sorted(self.numbers) and value == self.target
        return self._result("correct" if self.success else "wrong", 1.0 if self.success else 0.0, False)

    def _run_tool(self, source: str) -> tuple[str, bool]:
        """(the program's output for the model, whether it exited cleanly) of one tool call."""
        from rollflow.rewards.sandbox import SandboxLimits, default_sandbox

        sandbox = self._sandbox or default_sandbox()
        timeout = self.sandbox_timeout_s
        result = sandbox.run_python(source, limits=SandboxLimits(wall_time_s=timeout, cpu_time_s=timeout,
                                                                 max_output_bytes=4096))
        if result.timed_out:
            return "timeout", False
        text = result.stdout.decode(errors="replace").strip()
        if not text and not result.ok:  # show the error's last line ("NameError: name 'x' is not defined")
            text = (result.stderr.decode(errors="replace").strip().splitlines() or ["error"])[-1]
        return text[:MAX_OBSERVATION_CHARS], result.ok

    def _result(self, observation: str, reward: float, invalid: bool, tool_calls: int = 0) -> StepResult:
        info = {"success": self.success, "invalid_action": invalid, "anchor": observation, "tool_calls": tool_calls}
        truncated = not self.done and self.turns >= self.max_turns
        if self.done or truncated:
            info["outcome"] = ("right answer" if self.success else f"wrong answer; a right one: {self.solution}") \
                if self.done else f"out of turns: all {self.max_turns} turns used; a right answer: {self.solution}"
        return observation, reward, self.done, truncated, info

    def play_help(self) -> str:
        """The two kinds of turn, for a person playing (`rollflow env play`)."""
        return (f"answer: an expression with + - * / and parentheses using each given number once, e.g. 3*5+7 "
                f"(or <answer>3*5+7</answer>); one answer ends the episode\n"
                f"tool: <python>print(3*5+7)</python> runs Python and shows its output ({self.max_tool_calls} "
                f"calls); {self.max_turns} turns in all")

    def expert_action(self) -> str:
        """Check the known solution with the tool first (while calls are left), then answer it."""
        if self.tool_calls == 0 and self.max_tool_calls > 0:
            return f"<python>print({self.solution})</python>"
        return f"<answer>{self.solution}</answer>"

    def random_action(self, rng: random.Random) -> str:
        """An answer combining the numbers with random operators."""
        return f"<answer>{random_expression(self.numbers, rng, exact_division=False)[0]}</answer>"


def _expression_line(text: str) -> str | None:
    """The last line holding only an expression (an "= value" after it is ignored), or None."""
    for line in reversed(text.strip().splitlines()):
        line = re.sub(r"=\s*-?\d+\s*$", "", line).strip()
        if _EXPRESSION_LINE.match(line):
            return line
    return None


def random_expression(numbers: list[int], rng: random.Random, exact_division: bool) -> tuple[str, Fraction]:
    """A random expression using each number once: pairs are combined by random operators until one is left.

    Args:
        numbers: the numbers.
        rng: the random source.
        exact_division: use `/` only where it divides exactly (an integer result).

    Returns:
        (the expression with only the parentheses it needs, its exact value).
    """
    items: list[tuple[str, Fraction, str | None]] = [(str(n), Fraction(n), None) for n in numbers]  # text, value, op
    while len(items) > 1:
        left = items.pop(rng.randrange(len(items)))
        right = items.pop(rng.randrange(len(items)))
        choices = ["+", "-", "*"]
        if right[1] != 0 and (not exact_division or (left[1] / right[1]).denominator == 1):
            choices.append("/")
        op = rng.choice(choices)
        value = {"+": left[1] + right[1], "-": left[1] - right[1], "*": left[1] * right[1]}.get(op)
        value = left[1] / right[1] if value is None else value
        items.append((f"{_wrap(left, op, False)}{op}{_wrap(right, op, True)}", value, op))
    return items[0][0], items[0][1]


def _wrap(item: tuple[str, Fraction, str | None], op: str, is_right: bool) -> str:
    """The operand's text, parenthesized where precedence (or `-` / `/` on the right) needs it."""
    text, _, child = item
    if child is None:
        return text
    low_child = child in "+-"
    needs = (op in "*/" and low_child) or (is_right and op == "-" and low_child) or (is_right and op == "/")
    return f"({text})" if needs else text


def evaluate_expression(expression: str) -> tuple[list[int], Fraction | None]:
    """Safely evaluate integers combined with + - * / and parentheses (an `ast` walk, never `eval`).

    Args:
        expression: e.g. "(3+5)*7".

    Returns:
        (the integers it uses, its exact value), or ([], None) when it is anything else (names, calls,
        powers, unary minus, floats), too long, or divides by zero.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        return [], None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return [], None
    numbers: list[int] = []

    def value_of(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            numbers.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value_of(node.left), value_of(node.right)
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
            return left / right  # ZeroDivisionError when right == 0
        raise ValueError(f"not allowed: {type(node).__name__}")

    try:
        return numbers, value_of(tree.body)
    except (ValueError, ZeroDivisionError, RecursionError):
        return [], None
