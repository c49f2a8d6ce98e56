"""Instruction-following rules: each check by hand, IFEval rows, combination modes."""

from __future__ import annotations

import pytest

from rollflow.registry import UnknownNameError
from rollflow.rewards import INSTRUCTION_RULES, MissingColumnError, instruction_rules
from rollflow.rewards.rules import count_sentences, count_words

R = INSTRUCTION_RULES


def test_counts():
    assert count_words("Hello, world! It's fine.") == 5  # Hello / world / It / s / fine
    assert count_sentences("One. Two! Three? four") == 4


@pytest.mark.parametrize(
    ("rule", "text", "params", "expected"),
    [
        ("length_constraints:number_words", "a b c", {"num_words": 3, "relation": "at least"}, True),
        ("length_constraints:number_words", "a b c", {"num_words": 3, "relation": "less than"}, False),
        (
            "length_constraints:number_sentences",
            "A. B. C.",
            {"num_sentences": 4, "relation": "less than"},
            True,
        ),
        ("length_constraints:number_paragraphs", "p1\n***\np2\n***\np3", {"num_paragraphs": 3}, True),
        ("length_constraints:number_paragraphs", "p1\n***\n\n***\np3", {"num_paragraphs": 2}, False),
        ("keywords:existence", "The Cat sat", {"keywords": ["cat", "sat"]}, True),
        ("keywords:existence", "The Cat sat", {"keywords": ["dog"]}, False),
        ("keywords:forbidden_words", "scatter", {"forbidden_words": ["cat"]}, True),  # whole words only
        ("keywords:forbidden_words", "a cat", {"forbidden_words": ["cat"]}, False),
        ("keywords:frequency", "ho ho HO", {"keyword": "ho", "frequency": 3, "relation": "at least"}, True),
        (
            "keywords:letter_frequency",
            "banana",
            {"letter": "a", "let_frequency": 3, "let_relation": "less than"},
            False,
        ),
        ("detectable_format:json_format", '```json\n{"a": 1}\n```', {}, True),
        ("detectable_format:json_format", "{'a': 1}", {}, False),
        ("detectable_format:number_bullet_lists", "* one\n* two\n- three", {"num_bullets": 3}, True),
        ("detectable_format:number_bullet_lists", "* one", {"num_bullets": 2}, False),
        ("detectable_format:title", "<<My Poem>>\ntext", {}, True),
        ("detectable_format:title", "My Poem", {}, False),
        ("detectable_format:number_highlighted_sections", "*one* and *two*", {"num_highlights": 2}, True),
        ("change_case:english_lowercase", "all lower 123", {}, True),
        ("change_case:english_lowercase", "Not lower", {}, False),
        ("change_case:english_capital", "ALL CAPS!", {}, True),
        ("punctuation:no_comma", "no commas here", {}, True),
        ("punctuation:no_comma", "one, two", {}, False),
        (
            "startend:end_checker",
            "... Is there anything else?  ",
            {"end_phrase": "is there anything else?"},
            True,
        ),
        ("startend:quotation", '"quoted"', {}, True),
        ("startend:quotation", '"half', {}, False),
        ("detectable_content:postscript", "body\nP.S. bye", {"postscript_marker": "P.S."}, True),
        ("detectable_content:postscript", "body", {"postscript_marker": "P.S."}, False),
    ],
)
def test_rule(rule, text, params, expected):
    assert R.get(rule)(text, **params) is expected


def test_constraints_column_fraction_and_all():
    row = {
        "constraints": [
            {"rule": "change_case:english_lowercase"},
            {"rule": "length_constraints:number_words", "relation": "at least", "num_words": 10},
        ]
    }
    result = instruction_rules("hello world. this is fine.", **row)
    # lowercase met, 5 words < 10 not met: 1 / 2
    assert result == {
        "reward": 0.5,
        "change_case:english_lowercase": 1.0,
        "length_constraints:number_words": 0.0,
    }
    assert instruction_rules("hello world.", mode="all", **row)["reward"] == 0.0


def test_ifeval_row_format_with_unused_kwargs_as_none():
    row = {
        "prompt": "Write in lowercase and end with 'bye'.",
        "instruction_id_list": ["change_case:english_lowercase", "startend:end_checker"],
        "kwargs": [{"end_phrase": None, "num_words": None}, {"end_phrase": "bye", "num_words": None}],
    }
    assert instruction_rules("ok, bye", **row)["reward"] == 1.0


def test_errors():
    with pytest.raises(UnknownNameError, match="unknown instruction rule 'no_such_rule'"):
        instruction_rules("x", constraints=[{"rule": "no_such_rule"}])
    with pytest.raises(MissingColumnError, match="'constraints' or 'instruction_id_list'"):
        instruction_rules("x", prompt="p")
    with pytest.raises(ValueError, match="kwargs has 1"):
        instruction_rules(
            "x", instruction_id_list=["punctuation:no_comma", "startend:quotation"], kwargs=[{}]
        )
