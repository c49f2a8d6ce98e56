"""The code reward: extraction, test formats, scoring modes, failures scored 0."""

from __future__ import annotations

import json

import pytest

from rollflow.rewards import MissingColumnError, code_tests
from rollflow.rewards.code import CallCase, StdioCase, extract_code, parse_tests, values_equal

ADD_STDIN = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
STDIN_TESTS = [
    {"input": "1 2\n", "output": "3\n"},
    {"input": "5 5", "output": "10"},
    {"input": "0 0", "output": "1"},  # wrong on purpose: the program fails this one
]


def test_extract_code():
    assert extract_code("text\n```python\nprint(1)\n```\nmore\n```py\nprint(2)\n```") == "print(2)\n"
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"
    assert extract_code("```python\nprint(1)\n```\n```text\nout\n```") == "print(1)\n"
    assert extract_code("print(4)") == "print(4)"


def test_parse_tests_formats():
    assert parse_tests(json.dumps(STDIN_TESTS[:1])) == [StdioCase("1 2\n", "3\n")]
    assert parse_tests({"inputs": ["1\n"], "outputs": ["2\n"]}) == [StdioCase("1\n", "2\n")]
    assert parse_tests({"fn_name": "f", "inputs": [[1, 2]], "outputs": [[3]]}) == [
        CallCase("f", [1, 2], {}, 3)
    ]
    with pytest.raises(ValueError, match="no test cases"):
        parse_tests([])
    with pytest.raises(ValueError, match="needs 'input'/'output'"):
        parse_tests([{"stdin": "x"}])


def test_values_equal():
    assert values_equal([1, 2], (1, 2))
    assert values_equal(0.1 + 0.2, 0.3)
    assert not values_equal(1, True) and not values_equal(True, 1)
    assert values_equal({"a": [1.0]}, {"a": [1]})
    assert not values_equal([1, 2], [1, 2, 3])


def test_stdin_fraction_and_all_or_nothing():
    # 2 of 3 cases pass: fraction = 2 / 3.
    assert code_tests(ADD_STDIN, tests=STDIN_TESTS) == pytest.approx(2 / 3)
    assert code_tests(ADD_STDIN, tests=STDIN_TESTS, mode="all") == 0.0
    assert code_tests(ADD_STDIN, tests=STDIN_TESTS[:2], mode="all") == 1.0


def test_function_style_including_leetcode_class():
    program = (
        "```python\ndef add(a, b):\n    return a + b\n\nclass Solution:\n"
        "    def twoSum(self, nums, target):\n        return (0, 1)\n```"
    )
    tests = [
        {"fn_name": "add", "args": [1, 2], "output": 3},
        {"fn_name": "add", "args": [1.5, 2], "output": 3.5},
        {"fn_name": "twoSum", "args": [[2, 7], 9], "output": [0, 1]},
        {"fn_name": "add", "args": [1, 1], "output": 3},  # wrong on purpose
    ]
    assert code_tests(program, tests=tests) == 0.75


def test_failures_score_zero():
    assert code_tests("```python\ndef broken(:\n```", tests=STDIN_TESTS[:1]) == 0.0  # syntax error
    assert code_tests("```python\nraise SystemExit(1)\n```", tests=STDIN_TESTS[:1]) == 0.0
    assert code_tests("", tests=STDIN_TESTS[:1]) == 0.0
    looping = "```python\ndef add(a, b):\n    while True:\n        pass\n```"
    assert code_tests(looping, tests=[{"fn_name": "add", "args": [1, 2], "output": 3}], timeout_s=0.5) == 0.0
    assert code_tests("```python\nwhile True: pass\n```", tests=STDIN_TESTS[:1], timeout_s=0.5) == 0.0


def test_a_slow_case_fails_only_itself():
    program = "```python\nimport time\ndef f(x):\n    if x == 0:\n        time.sleep(10)\n    return x\n```"
    tests = [{"fn_name": "f", "args": [0], "output": 0}, {"fn_name": "f", "args": [1], "output": 1}]
    assert code_tests(program, tests=tests, timeout_s=0.5) == 0.5


def test_forged_result_lines_do_not_pass():
    # The program prints a fake results line; expected outputs never enter the sandbox, and the harness's
    # own (last) line reports the real return value.
    program = "```python\nprint('__rollflow_results__[{\"value\": 3}]')\ndef add(a, b):\n    return 0\n```"
    assert code_tests(program, tests=[{"fn_name": "add", "args": [1, 2], "output": 3}]) == 0.0


def test_option_and_column_errors():
    with pytest.raises(MissingColumnError, match="'code_tests' needs the dataset column 'tests'"):
        code_tests(ADD_STDIN, prompt="p")
    with pytest.raises(ValueError, match="mode must be"):
        code_tests(ADD_STDIN, tests=STDIN_TESTS, mode="most")
