"""The `calculator` tool: one arithmetic expression, evaluated from its syntax tree (never `eval`).

`+ - * / // % **`, unary minus and plus, parentheses, integer and decimal numbers. Arithmetic is exact
(`fractions.Fraction`): `0.1 + 0.2` is `0.3`, `1/3*3` is `1`. The answer is an integer when the value is
integral, else a decimal rounded to 10 significant digits.

Limits, so that no expression can take the process's time or memory: the expression's length, the size of
an exponent (`9**9**9` fails at once, before anything is computed), and the magnitude of every intermediate
value. A value whose exact fraction grows past `MAX_EXACT_BITS` continues as the nearest float.
"""

from __future__ import annotations

import ast
import math
import operator
from fractions import Fraction
from typing import Any

from rollflow.tools.base import (
    TOOLS,
    ToolError,
    check_arguments,
    function_schema,
    positive_int,
    positive_number,
)

MAX_EXACT_BITS = 10_000  # numerator and denominator of an exact value stay below this many bits
SIGNIFICANT_DIGITS = 10
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
SUPPORTED = "+ - * / // % ** and parentheses"


class Calculator:
    """The `calculator` tool. Argument: `expression` (string).

    Args:
        max_length: the longest expression accepted, in characters.
        max_exponent: the largest integer exponent accepted (in absolute value).
        max_magnitude: the largest absolute value of the result and of every intermediate value.
    """

    name = "calculator"

    def __init__(self, max_length: int = 200, max_exponent: int = 1000, max_magnitude: float = 1e15):
        self.max_length = positive_int(self.name, "max_length", max_length)
        self.max_exponent = positive_int(self.name, "max_exponent", max_exponent)
        self.max_magnitude = positive_number(self.name, "max_magnitude", max_magnitude)

    def schema(self) -> dict[str, Any]:
        expression = {"type": "string", "description": "e.g. (3 + 4) * 5 / 2"}
        return function_schema(self.name, "Evaluate an arithmetic expression.", {"expression": expression},
                               ["expression"])

    def call(self, arguments: dict[str, Any]) -> str:
        """Evaluate `arguments["expression"]`. Returns the value as text; raises ToolError (one line)."""
        check_arguments(self.schema(), arguments)
        return format_number(self.evaluate(arguments["expression"]))

    def close(self) -> None:
        """Nothing to release."""

    def evaluate(self, expression: str) -> Fraction:
        """The exact value of `expression`.

        Args:
            expression: arithmetic, e.g. "(3 + 4) * 5 / 2".

        Returns:
            Its value.

        Raises:
            ToolError: too long, not arithmetic, division by zero, or past a limit.
        """
        text = expression.strip()
        if not text:
            raise ToolError("expression is empty")
        if len(text) > self.max_length:
            raise ToolError(f"expression is too long ({len(text)} characters, at most {self.max_length})")
        try:
            tree = ast.parse(text, mode="eval")
        except SyntaxError as error:
            raise ToolError(f"invalid expression: {error.msg}") from None
        except (ValueError, MemoryError, RecursionError):
            raise ToolError("invalid expression") from None
        return self._value(tree.body)

    def _value(self, node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant):
            return self._bounded(_number(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = self._value(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp):
            left, right = self._value(node.left), self._value(node.right)
            if isinstance(node.op, ast.Pow):
                return self._bounded(self._power(left, right))
            function = OPERATORS.get(type(node.op))
            if function is None:
                hint = " (use ** for powers)" if isinstance(node.op, ast.BitXor) else ""
                raise ToolError(f"unsupported operator{hint}; the calculator knows {SUPPORTED}")
            try:
                return self._bounded(function(left, right))
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
        if isinstance(node, ast.Name):
            raise ToolError(f"unknown name {node.id!r}; the calculator knows numbers and {SUPPORTED}")
        raise ToolError(f"unsupported syntax ({type(node).__name__}); the calculator knows {SUPPORTED}")

    def _power(self, base: Fraction, exponent: Fraction) -> Fraction:
        """`base ** exponent`, refused before computing when the result would pass the limits."""
        if base == 0:
            if exponent < 0:
                raise ToolError("division by zero")
            return Fraction(1) if exponent == 0 else Fraction(0)
        if exponent.denominator != 1:  # a root: real only for a positive base, and inexact anyway
            if base < 0:
                raise ToolError("a negative number to a fractional power is not a real number")
            self._check_power_magnitude(base, float(exponent))
            return Fraction(float(base) ** float(exponent))
        power = exponent.numerator
        if abs(power) > self.max_exponent:
            raise ToolError(f"exponent {power} is too large (at most {self.max_exponent})")
        self._check_power_magnitude(base, power)
        bits = abs(power) * max(base.numerator.bit_length(), base.denominator.bit_length())
        if bits > MAX_EXACT_BITS:  # e.g. 0.123456789 ** 1000: tiny, but a huge exact fraction
            return Fraction(float(base) ** power)
        return base**power

    def _check_power_magnitude(self, base: Fraction, power: float) -> None:
        log10 = power * (math.log10(abs(base.numerator)) - math.log10(base.denominator))
        if log10 > math.log10(self.max_magnitude) + 1e-12:
            raise ToolError(f"result is too large (the limit is {self.max_magnitude:g} in absolute value)")

    def _bounded(self, value: Fraction) -> Fraction:
        if abs(value) > self.max_magnitude:
            raise ToolError(f"result is too large (the limit is {self.max_magnitude:g} in absolute value)")
        if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_EXACT_BITS:
            return Fraction(float(value))
        return value


def _number(value: Any) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ToolError(f"unsupported value {value!r}; the calculator knows numbers and {SUPPORTED}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ToolError("number is too large")
        return Fraction(repr(value))  # the decimal as written: 0.1 is 1/10, not the float's binary value
    return Fraction(value)


def format_number(value: Fraction) -> str:
    """An integral value as an integer ("12"), any other as a decimal of 10 significant digits ("0.3333333333").

    Args:
        value: the number.

    Returns:
        Its text.
    """
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.{SIGNIFICANT_DIGITS}g}"


@TOOLS.register("calculator")
def make_calculator(max_length: int = 200, max_exponent: int = 1000, max_magnitude: float = 1e15) -> Calculator:
    """The `calculator` tool (options: see `Calculator`)."""
    return Calculator(max_length, max_exponent, max_magnitude)
