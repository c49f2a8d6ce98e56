"""Tolerant parsing of the actions a model writes, shared by the built-in envs.

A model (a 1M-parameter one included) writes free text; these functions find the action in it or return
None, which the env turns into an invalid-action turn. They never raise on any input.

Direction words (`parse_direction`), decided once for every grid env:
    - case-insensitive, whole words only: the first of `left`, `down`, `right`, `up` that appears as a word
      anywhere in the text wins (" down." -> Down, "I go LEFT" -> Left, "<answer>Up</answer>" -> Up);
    - a single letter `l`, `d`, `r` or `u` (either case) is accepted when it is the whole stripped text
      ("R" -> Right), not inside a sentence (a stray "a" or "I" must not become a move);
    - anything else is None: "Rightwards?" (not the whole word), "", "hello", "\\x00junk".
"""

from __future__ import annotations

import re

# Canonical action text -> (row delta, column delta) on a grid whose row 0 is the top.
DIRECTIONS: dict[str, tuple[int, int]] = {"Left": (0, -1), "Down": (1, 0), "Right": (0, 1), "Up": (-1, 0)}

_DIRECTION_WORDS = {name.lower(): name for name in DIRECTIONS}
_DIRECTION_LETTERS = {name[0].lower(): name for name in DIRECTIONS}
_WORD = re.compile(r"[a-z]+", re.IGNORECASE)
_INTEGER = re.compile(r"-?\d+")
MAX_INTEGER_DIGITS = 18  # longer digit runs are not actions (and int() of >4300 digits raises)


def parse_direction(text: str) -> str | None:
    """The direction the text names (see the module docstring for the rules).

    Args:
        text: what the model wrote.

    Returns:
        "Left", "Down", "Right" or "Up", or None when the text names none.
    """
    stripped = text.strip()
    if len(stripped) == 1:
        return _DIRECTION_LETTERS.get(stripped.lower())
    for match in _WORD.finditer(text):
        name = _DIRECTION_WORDS.get(match.group().lower())
        if name is not None:
            return name
    return None


def parse_first_integer(text: str) -> int | None:
    """The first integer written in the text ("I guess 12." -> 12, "-3" -> -3).

    Args:
        text: what the model wrote.

    Returns:
        The integer, or None when there is none or it has more than `MAX_INTEGER_DIGITS` digits.
    """
    match = _INTEGER.search(text)
    if match is None or len(match.group().lstrip("-")) > MAX_INTEGER_DIGITS:
        return None
    return int(match.group())


def parse_name(text: str, names: list[str]) -> int | None:
    """The index in `names` of the first of them written as a word in the text (case-insensitive).

    Args:
        text: what the model wrote.
        names: the action names, e.g. ["left", "down", "right", "up"].

    Returns:
        The index of the earliest name in the text, or None.
    """
    earliest: tuple[int, int] | None = None
    for index, name in enumerate(names):
        match = re.search(rf"(?<![a-z0-9_]){re.escape(name)}(?![a-z0-9_])", text, re.IGNORECASE)
        if match and (earliest is None or match.start() < earliest[0]):
            earliest = (match.start(), index)
    return None if earliest is None else earliest[1]


def find_tag(text: str, tag: str) -> tuple[int, str] | None:
    """The content of the first `<tag>...</tag>` in the text; a missing closing tag runs to the end.

    Args:
        text: what the model wrote.
        tag: the tag name, e.g. "python".

    Returns:
        (position of the opening tag, content), or None when the opening tag is absent.
    """
    start = text.find(f"<{tag}>")
    if start < 0:
        return None
    body_start = start + len(tag) + 2
    end = text.find(f"</{tag}>", body_start)
    return start, text[body_start:] if end < 0 else text[body_start:end]
