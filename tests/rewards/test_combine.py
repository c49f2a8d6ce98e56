"""`combine_rewards`: weighted totals, dict rewards, validation."""

from __future__ import annotations

import math

import pytest

from rollflow.rewards import combine_rewards


def _constant(value):
    return lambda completion, **row: value


def test_weighted_sum_of_floats():
    combined = combine_rewards([("answer", _constant(1.0), 1.0), ("format", _constant(0.5), 0.2)])
    total, parts = combined("text", answer="1")
    # 1.0 * 1.0 + 0.2 * 0.5 = 1.1
    assert math.isclose(total, 1.1)
    assert parts == {"answer": 1.0, "format": 0.5}  # unweighted


def test_dict_reward_without_reward_key_sums_entries():
    rules = _constant({"word_count": 1.0, "json": 0.0, "ending": 1.0})
    total, parts = combine_rewards([("rules", rules, 0.5)])("text")
    # value = 1 + 0 + 1 = 2; total = 0.5 * 2 = 1.0
    assert total == 1.0
    assert parts == {"rules": 2.0, "rules/word_count": 1.0, "rules/json": 0.0, "rules/ending": 1.0}


def test_dict_reward_with_reward_key_logs_the_rest():
    fn = _constant({"reward": 0.25, "passed": 1.0, "total": 4.0})
    total, parts = combine_rewards([("code", fn, 2.0), ("bonus", _constant(True), -1.0)])("text")
    # 2.0 * 0.25 + (-1.0) * 1.0 = -0.5
    assert total == -0.5
    assert parts == {"code": 0.25, "code/passed": 1.0, "code/total": 4.0, "bonus": 1.0}


def test_row_is_passed_through():
    seen = {}

    def spy(completion, **row):
        seen.update(row, completion=completion)
        return 0.0

    combine_rewards([("spy", spy, 1.0)])("c", prompt="p", answer="a", domain="math")
    assert seen == {"completion": "c", "prompt": "p", "answer": "a", "domain": "math"}


@pytest.mark.parametrize(
    ("rewards", "error", "pattern"),
    [
        ([], ValueError, "at least one"),
        ([("a", _constant(1.0), 1.0), ("a", _constant(1.0), 1.0)], ValueError, "repeated: a"),
        ([("a/b", _constant(1.0), 1.0)], ValueError, "must not contain '/'"),
        ([("a", 3, 1.0)], TypeError, "not callable"),
        ([("a", _constant(1.0), float("nan"))], ValueError, "non-finite weight"),
    ],
)
def test_bad_specs(rewards, error, pattern):
    with pytest.raises(error, match=pattern):
        combine_rewards(rewards)


@pytest.mark.parametrize(
    ("value", "error", "pattern"),
    [
        (None, TypeError, "reward 'r' returned NoneType"),
        ("1.0", TypeError, "returned str"),
        (float("nan"), ValueError, "returned NaN"),
        ({"x": "bad"}, TypeError, "entry 'x' returned str"),
    ],
)
def test_bad_values(value, error, pattern):
    with pytest.raises(error, match=pattern):
        combine_rewards([("r", _constant(value), 1.0)])("text")


def test_reward_exception_propagates():
    def boom(completion, **row):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        combine_rewards([("r", boom, 1.0)])("text")
