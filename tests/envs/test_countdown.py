"""Countdown: seeded tasks, the sandboxed Python tool, answers checked by the safe evaluator, the expert."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from rollflow.envs.countdown import Countdown, evaluate_expression, random_expression
from rollflow.envs.play import expert_policy, run_episode


@pytest.mark.parametrize(("expression", "numbers", "value"), [
    ("3*5+7", [3, 5, 7], 22),
    ("(3+5)*7", [3, 5, 7], 56),
    ("7-(5-3)", [7, 5, 3], 5),
    ("6/4*2", [6, 4, 2], 3),  # exact: 6/4 = 3/2, * 2 = 3
    ("1/3", [1, 3], Fraction(1, 3)),
])
def test_evaluate_expression(expression, numbers, value):
    assert evaluate_expression(expression) == (numbers, value)


@pytest.mark.parametrize("expression", [
    "__import__('os')", "__import__('os').system('true')", "2**10", "-3+5", "3.5+1", "x+1", "True+1",
    "3 5", "1/0", "(1)" * 300, "", "print(1)", "[1][0]",
])
def test_evaluator_rejects_everything_else(expression):
    assert evaluate_expression(expression) == ([], None)


def test_random_expressions_render_with_correct_parentheses():
    rng = random.Random(0)
    for _ in range(300):
        numbers = [rng.randint(1, 9) for _ in range(4)]
        text, value = random_expression(numbers, rng, exact_division=False)
        used, evaluated = evaluate_expression(text)
        assert evaluated == value and sorted(used) == sorted(numbers), text


def test_task_is_seeded_and_reachable():
    env = Countdown()
    observation, info = env.reset(5)
    assert observation == env.reset(5)[0]
    assert observation == f"use {env.numbers[0]} {env.numbers[1]} {env.numbers[2]} to make {env.target}"
    assert len({env.reset(seed)[0] for seed in range(20)}) > 10
    for seed in range(50):
        env.reset(seed)
        used, value = evaluate_expression(env.solution)
        assert value == env.target and sorted(used) == sorted(env.numbers) and 1 <= env.target <= 100


def _env(**kwargs) -> Countdown:
    env = Countdown(**kwargs)
    env.reset(0)
    env.numbers, env.target, env.solution, env.task = [3, 5, 7], 22, "3*5+7", "use 3 5 7 to make 22"
    return env


def test_tool_call_runs_in_the_sandbox():
    env = _env(tool_reward=0.05)
    observation, reward, terminated, truncated, info = env.step("<python>print(2+3)</python>")
    assert "5" in observation and (reward, terminated, truncated) == (0.05, False, False)
    assert info["tool_calls"] == 1 and info["invalid_action"] is False
    # A missing closing tag runs to the end; the output is cut to 60 characters.
    observation, reward, *_ = env.step("let me check <python>print('x' * 500)")
    assert observation == "x" * 60 and reward == 0.05


def test_tool_errors_and_hostile_code_only_return_text():
    env = _env(max_tool_calls=10, max_turns=10, tool_reward=1.0, sandbox_timeout_s=1.0)
    observation, reward, *_ = env.step("<python>print(undefined_name)</python>")
    assert observation == "NameError: name 'undefined_name' is not defined" and reward == 0.0
    observation, *_ = env.step("<python>import os; os.system('echo from-shell')</python>")
    assert "from-shell" in observation
    observation, *_ = env.step("<python>import os, signal; os.kill(os.getppid(), signal.SIGKILL)</python>")
    assert isinstance(observation, str)
    observation, reward, *_ = env.step("<python>while True: pass</python>")
    assert (observation, reward) == ("timeout", 0.0)
    # The env still works.
    assert env.step("<answer>3*5+7</answer>")[1] == 1.0


def test_tool_call_limit():
    env = _env(max_tool_calls=1, invalid_penalty=-0.3)
    env.step("<python>print(1)</python>")
    observation, reward, terminated, truncated, info = env.step("<python>print(2)</python>")
    assert (observation, reward, terminated) == ("no tool calls left", -0.3, False)
    assert info["invalid_action"] is True and info["tool_calls"] == 0


@pytest.mark.parametrize(("answer", "reward"), [
    ("<answer>3*5+7</answer>", 1.0),
    ("<answer> 7+5*3 </answer>", 1.0),
    ("7+3*5 = 22", 1.0),  # an expression line; "= 22" is ignored
    ("I think:\n(7+5-3)*3\n7+3*5", 1.0),  # the last expression line counts
    ("<answer>3*5+7+0</answer>", 0.0),  # a number not given
    ("<answer>5*5-3</answer>", 0.0),  # 5 twice, 7 unused
    ("<answer>3*7+5</answer>", 0.0),  # all numbers once, but 26
])
def test_answers(answer, reward):
    env = _env()
    observation, got, terminated, truncated, info = env.step(answer)
    assert (got, terminated, info["success"]) == (reward, True, reward == 1.0)
    assert observation == ("correct" if reward else "wrong")


@pytest.mark.parametrize("junk", ["", "hello", "\x00junk", "<answer>hello</answer>", "<answer>3*</answer>"])
def test_invalid_action_penalty_and_state_unchanged(junk):
    env = _env(invalid_penalty=-0.1)
    observation, reward, terminated, truncated, info = env.step(junk)
    assert (observation, reward, terminated, truncated) == ("use 3 5 7 to make 22", -0.1, False, False)
    assert info["invalid_action"] is True and env.tool_calls == 0


def test_truncation_at_max_turns():
    env = _env(max_turns=2)
    assert env.step("hmm")[3] is False
    _, _, terminated, truncated, info = env.step("hmm")
    assert (terminated, truncated, info["success"]) == (False, True, False)


def test_expert_solves_twenty_seeds_with_one_tool_call_each():
    env = Countdown()
    for seed in range(20):
        result = run_episode(env, expert_policy(env), seed, max_steps=10)
        assert result["success"] and result["steps"] == 2 and result["return"] == 1.0


def test_expert_without_tools_answers_at_once():
    env = Countdown(num_count=4, max_tool_calls=0)
    result = run_episode(env, expert_policy(env), 1, max_steps=10)
    assert result["success"] and result["steps"] == 1
