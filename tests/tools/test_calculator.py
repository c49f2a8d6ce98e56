"""The calculator: exact arithmetic from the syntax tree, its limits, its one-line errors."""

from __future__ import annotations

import time

import pytest

from rollflow.tools import ToolError
from rollflow.tools.calculator import Calculator


def calculate(expression: str, **options) -> str:
    return Calculator(**options).call({"expression": expression})


@pytest.mark.parametrize(("expression", "answer"), [
    ("2 + 3 * 4", "14"),  # 3 * 4 = 12, + 2
    ("(2 + 3) * 4", "20"),
    ("7 / 2", "3.5"),
    ("1 / 3", "0.3333333333"),  # 10 significant digits
    ("2 / 3", "0.6666666667"),  # rounded, not cut
    ("0.1 + 0.2", "0.3"),  # exact: 1/10 + 2/10 = 3/10 (floats give 0.30000000000000004)
    ("1 / 3 * 3", "1"),  # exact: (1/3) * 3 = 1, an integer
    ("10 / 4 * 2", "5"),  # 5/2 * 2
    ("7 // 2", "3"),
    ("-7 // 2", "-4"),  # floor, as Python
    ("7 % 3", "1"),
    ("-7 % 3", "2"),  # -7 = 3 * -3 + 2
    ("2 ** 10", "1024"),
    ("2 ** -2", "0.25"),  # 1 / 4
    ("-2 ** 2", "-4"),  # ** binds tighter than unary minus: -(2 ** 2)
    ("(-2) ** 3", "-8"),
    ("2 ** 3 ** 2", "512"),  # right-associative: 2 ** 9
    ("4 ** 0.5", "2"),
    ("2 ** 0.5", "1.414213562"),  # sqrt(2) = 1.41421356237...
    ("1e3 + 1", "1001"),
    ("+5 - -3", "8"),
    ("  12  ", "12"),
    ("10 ** 15", "1000000000000000"),  # at the magnitude limit, still an integer
    ("1234567.891 * 1000", "1234567891"),
])
def test_values(expression, answer):
    assert calculate(expression) == answer


@pytest.mark.parametrize(("expression", "message"), [
    ("1 / 0", "^division by zero$"),
    ("5 // 0", "^division by zero$"),
    ("5 % 0", "^division by zero$"),
    ("0 ** -1", "^division by zero$"),
    ("x + 1", "unknown name 'x'"),
    ("__import__('os').system('true')", r"unsupported syntax \(Call\)"),
    ("2 ^ 3", r"use \*\* for powers"),
    ("1 if 1 else 2", "unsupported syntax"),
    ("True + 1", "unsupported value True"),
    ("'a' * 3", "unsupported value 'a'"),
    ("1 +", "invalid expression"),
    ("", "expression is empty"),
    ("(-8) ** (1 / 3)", "not a real number"),
    ("10 ** 16", "result is too large"),
    ("10 ** 8 * 10 ** 8", "result is too large"),
    ("1e300", "result is too large"),
    ("1e999", "number is too large"),  # the literal is inf
])
def test_errors_are_one_line(expression, message):
    with pytest.raises(ToolError, match=message) as error:
        calculate(expression)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("expression", ["9 ** 9 ** 9", "2 ** 10 ** 10", "(10 ** 9) ** (10 ** 9)", "2 ** 100000"])
def test_huge_powers_are_refused_before_computing(expression):
    start = time.monotonic()
    with pytest.raises(ToolError, match="too large"):
        calculate(expression)
    assert time.monotonic() - start < 0.5


def test_huge_exact_fractions_continue_as_floats():
    start = time.monotonic()
    assert calculate("0.5 ** 1000") == "9.332636185e-302"  # exact: 1 / 2**1000 (1001 bits)
    assert calculate("0.123456789 ** 500") == "0"  # 10**-454: the exact fraction would have 15,000 bits
    # (4/3)**20 = 4**20 / 3**20 = 1099511627776 / 3486784401 = 315 + 1174541461 / 3486784401 = 315.33685520...
    assert calculate("(1 + 1 / 3) ** 20") == "315.3368552"
    assert time.monotonic() - start < 0.5


def test_limits_are_options():
    with pytest.raises(ToolError, match=r"expression is too long \(11 characters, at most 10\)"):
        calculate("1+2+3+4+5+6", max_length=10)
    assert calculate("1+" * 99 + "1") == "100"  # 199 characters, under the default 200
    with pytest.raises(ToolError, match="exponent 4 is too large"):
        calculate("2 ** 4", max_exponent=3)
    with pytest.raises(ToolError, match="result is too large"):
        calculate("10 * 11", max_magnitude=100)
    assert calculate("10 * 10", max_magnitude=100) == "100"


def test_arguments_are_checked():
    calculator = Calculator()
    with pytest.raises(ToolError, match="argument 'expression' must be string, got integer"):
        calculator.call({"expression": 5})
    with pytest.raises(ToolError, match="missing required argument 'expression'"):
        calculator.call({})
    assert calculator.schema()["function"]["description"] == "Evaluate an arithmetic expression."
