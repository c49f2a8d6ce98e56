"""Math rewards: the final answer checked with math-verify, a boxed-format rule and a length penalty.

`math_answer` first tries a fast path in the calling thread (microseconds): it takes the last `\\boxed{}`
of the completion (or the whole completion when it is a bare answer) and compares it with the reference
as a string and, when both are plain numbers (integer, decimal, `a/b`, `\\frac{a}{b}`), as exact
fractions. Only what the fast path cannot decide goes to math-verify, which runs in helper processes
under a hard time limit (see `math_verifier.py` for why processes and not signals or threads).
"""

from __future__ import annotations

import re
from fractions import Fraction

from rollflow.rewards.math_verifier import default_verifier
from rollflow.rewards.registry import REWARD_FUNCTIONS, needs_columns, require_column

_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_SLASH_FRACTION = re.compile(r"([+-]?\d+)\s*/\s*(\d+)")
_LATEX_FRACTION = re.compile(r"([+-]?)\\[dt]?frac\{\s*(\d+)\s*\}\{\s*(\d+)\s*\}")
_BARE_ANSWER_MAX_CHARS = 40  # a completion this short with no \boxed may be the answer itself


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced.

    Args:
        text: a completion.

    Returns:
        The content between the braces, or None when there is no complete boxed expression.
    """
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def _normalize(text: str) -> str:
    """Strip whitespace, `$` delimiters and a trailing full stop; collapse inner whitespace."""
    text = text.strip().strip("$").strip().rstrip(".").strip()
    return " ".join(text.split())


def _as_fraction(text: str) -> Fraction | None:
    """`text` as an exact number when it is a plain integer, decimal, `a/b` or `\\frac{a}{b}`."""
    if _NUMBER.fullmatch(text):
        return Fraction(text)
    match = _SLASH_FRACTION.fullmatch(text)
    if match and int(match.group(2)) != 0:
        return Fraction(int(match.group(1)), int(match.group(2)))
    match = _LATEX_FRACTION.fullmatch(text)
    if match and int(match.group(3)) != 0:
        return Fraction(int(match.group(1) + match.group(2)), int(match.group(3)))
    return None


def fast_math_verdict(completion: str, answer: str) -> float | None:
    """Decide the easy cases without math-verify.

    Args:
        completion: the model's completion.
        answer: the reference answer.

    Returns:
        1.0 or 0.0 when the answer is decided, None when math-verify must decide.
    """
    boxed = last_boxed(completion)
    if boxed is not None:
        candidate = _normalize(boxed)
    elif len(completion.strip()) <= _BARE_ANSWER_MAX_CHARS:
        candidate = _normalize(completion)
    else:
        return None
    gold = _normalize(answer)
    if candidate and candidate == gold:
        return 1.0
    got, expected = _as_fraction(candidate), _as_fraction(gold)
    if got is None or expected is None:
        return None
    if got == expected:
        return 1.0
    # Clearly different numbers are wrong. Near misses go to math-verify, which rounds floats to 6 places.
    if abs(got - expected) > Fraction(1, 10**4) * max(1, abs(got), abs(expected)):
        return 0.0
    return None


@REWARD_FUNCTIONS.register("math_answer")
@needs_columns("answer")
def math_answer(completion: str, *, timeout_s: float = 5.0, **row) -> float:
    """1.0 when the completion's final answer equals the reference answer mathematically, else 0.0.

    Accepts `\\boxed{}` answers, plain numbers, fractions and LaTeX expressions (`0.5` == `1/2` ==
    `\\frac{2}{4}`). A verification that exceeds the time limit scores 0.0.

    Args:
        completion: the model's completion.
        timeout_s: time limit for math-verify (the fast path needs none).
        **row: the dataset row; needs the column `answer` (str or number).

    Returns:
        1.0 or 0.0.

    Raises:
        MissingColumnError: the row has no `answer`.
    """
    answer = str(require_column(row, "answer", "math_answer"))
    verdict = fast_math_verdict(completion, answer)
    if verdict is not None:
        return verdict
    if not completion.strip():
        return 0.0
    return 1.0 if default_verifier().verify(answer, completion, timeout_s).correct else 0.0


def _start_math_verify_helpers() -> None:
    default_verifier().start_helpers()


math_answer.warm_up = _start_math_verify_helpers  # `warm_up_rewards`: a run starts them with its workers


@REWARD_FUNCTIONS.register("exact_match")
@needs_columns("answer")
def exact_match(completion: str, **row) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, equals the stripped answer.

    Args:
        completion: the model's completion.
        **row: the dataset row; needs the column `answer`.

    Returns:
        1.0 or 0.0.
    """
    answer = str(require_column(row, "answer", "exact_match"))
    return 1.0 if completion.strip() == answer.strip() else 0.0


@REWARD_FUNCTIONS.register("boxed_format")
def boxed_format(completion: str, **row) -> float:
    """Format reward: 1.0 when the completion puts a non-empty answer in `\\boxed{...}`, else 0.0.

    Args:
        completion: the model's completion.
        **row: the dataset row (unused).

    Returns:
        1.0 or 0.0.
    """
    boxed = last_boxed(completion)
    return 1.0 if boxed is not None and boxed.strip() else 0.0


@REWARD_FUNCTIONS.register("length_penalty")
def length_penalty(completion: str, *, max_chars: int = 4096, buffer_chars: int = 1024, **row) -> float:
    """Soft overlong penalty (DAPO-style), measured in characters because rewards see text.

    0.0 up to `max_chars - buffer_chars`, then falling linearly to -1.0 at `max_chars`, and -1.0 beyond.

    Args:
        completion: the model's completion.
        max_chars: length at which the penalty reaches -1.
        buffer_chars: width of the linear ramp before `max_chars`.
        **row: the dataset row (unused).

    Returns:
        A penalty in [-1.0, 0.0].
    """
    if buffer_chars <= 0 or buffer_chars > max_chars:
        raise ValueError(
            f"length_penalty needs 0 < buffer_chars <= max_chars, got {buffer_chars}, {max_chars}"
        )
    excess = len(completion) - (max_chars - buffer_chars)
    if excess <= 0:
        return 0.0
    return -min(1.0, excess / buffer_chars)
