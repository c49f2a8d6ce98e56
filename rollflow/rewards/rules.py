"""Instruction-following rule rewards (IFEval-style): small verifiable checks, combined per prompt.

Each rule is `check(completion, **params) -> bool`, registered in `INSTRUCTION_RULES` under its IFEval
instruction id and taking IFEval's parameter names, so IFEval-format rows work as they are. A row picks
its rules with either

* IFEval's columns: `instruction_id_list: ["length_constraints:number_words", ...]` and
  `kwargs: [{"relation": "at least", "num_words": 50}, ...]` (parallel lists), or
* `constraints: [{"rule": "length_constraints:number_words", "relation": "at least", "num_words": 50}, ...]`.

`instruction_rules` returns `{"reward": fraction (or all-or-nothing) of rules met, <rule id>: 1.0/0.0 ...}`;
with `combine_rewards` the per-rule entries are logged and only "reward" is weighted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Literal

from rollflow.registry import Registry
from rollflow.rewards.registry import REWARD_FUNCTIONS, MissingColumnError

# Every rule: `check(completion: str, **params) -> bool`; params are keyword-only, named as in IFEval.
INSTRUCTION_RULES: Registry[Callable[..., bool]] = Registry("instruction rule")

_RELATIONS = {"less than": lambda n, k: n < k, "at least": lambda n, k: n >= k}


def _relation(count: int, relation: str, target: int) -> bool:
    if relation not in _RELATIONS:
        raise ValueError(f"relation must be one of {sorted(_RELATIONS)}, got {relation!r}")
    return _RELATIONS[relation](count, target)


def count_words(text: str) -> int:
    """Words as IFEval counts them: runs of word characters."""
    return len(re.findall(r"\b\w+\b", text))


def count_sentences(text: str) -> int:
    """Sentences: non-empty pieces ending at `.`, `!` or `?` (followed by space or the end)."""
    return len([s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if re.search(r"\w", s)])


@INSTRUCTION_RULES.register("length_constraints:number_words")
def number_words(completion: str, *, num_words: int, relation: str = "at least") -> bool:
    """Word count is `relation` ("less than" / "at least") `num_words`."""
    return _relation(count_words(completion), relation, num_words)


@INSTRUCTION_RULES.register("length_constraints:number_sentences")
def number_sentences(completion: str, *, num_sentences: int, relation: str = "at least") -> bool:
    """Sentence count is `relation` `num_sentences`."""
    return _relation(count_sentences(completion), relation, num_sentences)


@INSTRUCTION_RULES.register("length_constraints:number_paragraphs")
def number_paragraphs(completion: str, *, num_paragraphs: int) -> bool:
    """Exactly `num_paragraphs` non-empty paragraphs separated by the markdown divider `***`."""
    paragraphs = re.split(r"\s?\*\*\*\s?", completion)
    if any(not p.strip() for p in paragraphs[1:-1]):
        return False
    return len([p for p in paragraphs if p.strip()]) == num_paragraphs


@INSTRUCTION_RULES.register("keywords:existence")
def keywords_existence(completion: str, *, keywords: list[str]) -> bool:
    """Every keyword appears (case-insensitive)."""
    return all(re.search(re.escape(k), completion, re.IGNORECASE) for k in keywords)


@INSTRUCTION_RULES.register("keywords:forbidden_words")
def forbidden_words(completion: str, *, forbidden_words: list[str]) -> bool:
    """No forbidden word appears as a whole word (case-insensitive)."""
    return not any(
        re.search(r"\b" + re.escape(w) + r"\b", completion, re.IGNORECASE) for w in forbidden_words
    )


@INSTRUCTION_RULES.register("keywords:frequency")
def keyword_frequency(completion: str, *, keyword: str, frequency: int, relation: str = "at least") -> bool:
    """`keyword` occurs `relation` `frequency` times (case-insensitive)."""
    return _relation(len(re.findall(re.escape(keyword), completion, re.IGNORECASE)), relation, frequency)


@INSTRUCTION_RULES.register("keywords:letter_frequency")
def letter_frequency(
    completion: str, *, letter: str, let_frequency: int, let_relation: str = "at least"
) -> bool:
    """`letter` occurs `let_relation` `let_frequency` times (case-insensitive)."""
    return _relation(completion.lower().count(letter.lower()), let_relation, let_frequency)


@INSTRUCTION_RULES.register("detectable_format:json_format")
def json_format(completion: str) -> bool:
    """The whole completion is JSON (a surrounding ```json fence is allowed)."""
    text = completion.strip()
    text = re.sub(r"^```(?:json|Json|JSON)?\s*|\s*```$", "", text)
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@INSTRUCTION_RULES.register("detectable_format:number_bullet_lists")
def number_bullet_lists(completion: str, *, num_bullets: int) -> bool:
    """Exactly `num_bullets` markdown bullets (`* ` or `- ` at the start of a line)."""
    return len(re.findall(r"^\s*[*-]\s", completion, re.MULTILINE)) == num_bullets


@INSTRUCTION_RULES.register("detectable_format:title")
def title(completion: str) -> bool:
    """A title wrapped in double angular brackets, like <<poem of joy>>."""
    return any(t.strip() for t in re.findall(r"<<([^\n]+?)>>", completion))


@INSTRUCTION_RULES.register("detectable_format:number_highlighted_sections")
def number_highlighted_sections(completion: str, *, num_highlights: int) -> bool:
    """At least `num_highlights` sections highlighted with markdown, like *highlighted section*."""
    found = [h for h in re.findall(r"\*[^\n*]+\*", completion) if h.strip("*").strip()]
    found += [h for h in re.findall(r"\*\*[^\n*]+\*\*", completion) if h.strip("*").strip()]
    return len(found) >= num_highlights


@INSTRUCTION_RULES.register("change_case:english_lowercase")
def english_lowercase(completion: str) -> bool:
    """All letters are lowercase (and there is at least one)."""
    return completion == completion.lower() and any(c.isalpha() for c in completion)


@INSTRUCTION_RULES.register("change_case:english_capital")
def english_capital(completion: str) -> bool:
    """All letters are uppercase (and there is at least one)."""
    return completion == completion.upper() and any(c.isalpha() for c in completion)


@INSTRUCTION_RULES.register("punctuation:no_comma")
def no_comma(completion: str) -> bool:
    """No comma anywhere."""
    return "," not in completion


@INSTRUCTION_RULES.register("startend:end_checker")
def end_checker(completion: str, *, end_phrase: str) -> bool:
    """The completion ends with `end_phrase` (case-insensitive, surrounding whitespace ignored)."""
    return completion.strip().lower().endswith(end_phrase.strip().lower())


@INSTRUCTION_RULES.register("startend:quotation")
def quotation(completion: str) -> bool:
    """The whole completion is wrapped in double quotes."""
    text = completion.strip()
    return len(text) > 1 and text[0] == '"' and text[-1] == '"'


@INSTRUCTION_RULES.register("detectable_content:postscript")
def postscript(completion: str, *, postscript_marker: str = "P.S.") -> bool:
    """A postscript starting with `postscript_marker` is present."""
    return (
        re.search(r"\s*" + re.escape(postscript_marker.lower()) + r".*$", completion.lower(), re.MULTILINE)
        is not None
    )


def _row_constraints(row: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(rule id, params) pairs from `constraints` or IFEval's `instruction_id_list` + `kwargs`."""
    if row.get("constraints") is not None:
        constraints = row["constraints"]
        if isinstance(constraints, str):
            constraints = json.loads(constraints)
        return [(c["rule"], {k: v for k, v in c.items() if k != "rule"}) for c in constraints]
    if row.get("instruction_id_list") is not None:
        ids = list(row["instruction_id_list"])
        params = list(row.get("kwargs") or [{}] * len(ids))
        if len(params) != len(ids):
            raise ValueError(f"instruction_id_list has {len(ids)} entries but kwargs has {len(params)}")
        # IFEval rows store every possible parameter, None where unused: keep the set ones.
        return [(i, {k: v for k, v in (p or {}).items() if v is not None}) for i, p in zip(ids, params)]
    present = ", ".join(sorted(row)) or "none"
    raise MissingColumnError(
        "reward 'instruction_rules' needs the column 'constraints' or 'instruction_id_list' (+ 'kwargs'), "
        f"but the row has: {present}"
    )


@REWARD_FUNCTIONS.register("instruction_rules")
def instruction_rules(
    completion: str, *, mode: Literal["fraction", "all"] = "fraction", **row
) -> dict[str, float]:
    """Check the row's instruction rules against the completion.

    Args:
        completion: the model's completion.
        mode: "fraction" scores the share of rules met, "all" scores 1.0 only when every rule is met.
        **row: the dataset row; needs `constraints` or `instruction_id_list` (+ `kwargs`).

    Returns:
        `{"reward": score, <rule id>: 1.0 or 0.0 for each rule}`.

    Raises:
        UnknownNameError: a rule id that is not registered (the message lists the valid ones).
    """
    if mode not in ("fraction", "all"):
        raise ValueError(f"instruction_rules mode must be 'fraction' or 'all', got {mode!r}")
    results: dict[str, float] = {}
    for rule_id, params in _row_constraints(row):
        check = INSTRUCTION_RULES.get(rule_id)
        key = rule_id if rule_id not in results else f"{rule_id}#{len(results)}"
        results[key] = 1.0 if check(completion, **params) else 0.0
    if not results:
        return {"reward": 0.0}
    met = sum(results.values())
    score = met / len(results) if mode == "fraction" else float(met == len(results))
    return {"reward": score, **results}
