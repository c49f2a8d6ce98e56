import re

import pytest

from rollflow.data.arithmetic import ARITHMETIC_TASKS, arithmetic_splits
from rollflow.registry import UnknownNameError


def test_same_seed_gives_identical_rows_in_identical_order():
    assert arithmetic_splits(seed=3) == arithmetic_splits(seed=3)


def test_different_seeds_hold_out_different_rows():
    _, eval_a = arithmetic_splits(seed=0)
    _, eval_b = arithmetic_splits(seed=1)
    assert {row["prompt"] for row in eval_a} != {row["prompt"] for row in eval_b}


def test_train_and_eval_are_disjoint_by_operand_pair_and_cover_the_task():
    train_rows, eval_rows = arithmetic_splits(seed=0, num_eval=500)
    assert len(eval_rows) == 500 and len(train_rows) == 90 * 90 - 500
    train_pairs = {tuple(row["prompt"].split("+")) for row in train_rows}
    eval_pairs = {tuple(row["prompt"].split("+")) for row in eval_rows}
    assert len(train_pairs) == len(train_rows) and len(eval_pairs) == len(eval_rows)
    assert not train_pairs & eval_pairs
    assert len(train_pairs | eval_pairs) == 90 * 90


def test_rows_are_plain_prompts_with_correct_answers():
    train_rows, eval_rows = arithmetic_splits()
    for row in train_rows + eval_rows:
        assert set(row) == {"prompt", "answer"}
        assert re.fullmatch(r"[1-9]\d\+[1-9]\d", row["prompt"]), row  # a, b in 10..99; no chat markup
        a, b = row["prompt"].split("+")
        assert row["answer"] == str(int(a) + int(b))


def test_unknown_task_names_the_valid_ones():
    assert "add2" in ARITHMETIC_TASKS
    with pytest.raises(UnknownNameError, match="add2"):
        arithmetic_splits(task="add3")


@pytest.mark.parametrize("num_eval", [0, 8100])
def test_num_eval_must_leave_rows_on_both_sides(num_eval):
    with pytest.raises(ValueError, match="num_eval"):
        arithmetic_splits(num_eval=num_eval)


def test_sum3_rows_are_three_one_digit_numbers_with_a_fifth_held_out():
    train_rows, eval_rows = arithmetic_splits("sum3")
    assert (len(train_rows), len(eval_rows)) == (800, 200)  # a fifth of 1,000 problems (add2 keeps 500)
    assert not {row["prompt"] for row in train_rows} & {row["prompt"] for row in eval_rows}
    for row in train_rows + eval_rows:
        assert set(row) == {"prompt", "answer"}
        assert re.fullmatch(r"\d\+\d\+\d", row["prompt"]), row  # digits and '+': the tiny model's tokenizer
        assert row["answer"] == str(sum(int(term) for term in row["prompt"].split("+")))
    assert len(arithmetic_splits("add2")[1]) == 500  # the default split of add2 is unchanged
