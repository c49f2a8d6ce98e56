"""Checks of raw config values the sections share: run names, paths, column names, non-finite numbers, and
whether a raw value is a section's default; and `Strict`, the base of every section."""

from __future__ import annotations

import math
import unicodedata
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

MAX_NAME_LENGTH = 100  # a run name's characters (`rollflow.cli` keeps a copy, for its parser's start)


def plain_group_by_columns(columns: list[str]) -> list[str]:
    """`eval.group_by`: a column name becomes part of a metric name (`eval/C=V/accuracy`): no `/` or `=`, each
    once."""
    for column in columns:
        if not column.strip() or "/" in column or "=" in column:
            raise ValueError(f"column {column!r} must be a non-empty name without '/' or '='")
    repeated = sorted({column for column in columns if columns.count(column) > 1})
    if repeated:
        raise ValueError(f"each column may appear once; repeated: {', '.join(repeated)}")
    return columns


def control_characters(text: str) -> str:
    """The control characters of `text` (NUL, newline, tab, escape, ...) as escapes, e.g. `'\\x00'`;
    empty when it has none."""
    found = dict.fromkeys(c for c in text if unicodedata.category(c) == "Cc")
    return ", ".join(repr(c) for c in found)


def is_default(default: BaseModel | None, value: Any) -> bool:
    """`value` (raw config, or a section) validates to `default`."""
    if isinstance(value, BaseModel):
        return value == default
    try:
        return type(default).model_validate(value) == default
    except ValueError:  # pydantic's ValidationError: not the default, whatever it is
        return False


def name_problem(name: str) -> str | None:
    """Why `name` cannot be a run name (a single directory below output.dir), or None."""
    control = control_characters(name)
    if control:
        return f"must not contain control characters ({control})"
    if not name.strip():
        return "must not be empty"
    if len(name) > MAX_NAME_LENGTH:
        return f"has {len(name)} characters, more than {MAX_NAME_LENGTH}"
    if "/" in name or "\\" in name:
        return "must not contain '/' or '\\': it names one directory under output.dir (set that for the parent)"
    if name in (".", ".."):
        return f"must not be {name!r}"
    return None


def non_finite(node: Any, path: tuple[str, ...]) -> tuple[tuple[str, ...], float] | None:
    """(path, value) of the first NaN or infinite float in a raw config tree, or None."""
    if isinstance(node, float) and not math.isfinite(node):
        return path, node
    if isinstance(node, dict):
        items = ((str(key), value) for key, value in node.items())
    elif isinstance(node, (list, tuple)):
        items = ((str(index), value) for index, value in enumerate(node))
    else:
        return None
    for key, value in items:
        found = non_finite(value, (*path, key))
        if found is not None:
            return found
    return None


def _leaf_annotations(annotation: Any) -> list[Any]:
    args = get_args(annotation)
    return [leaf for arg in args for leaf in _leaf_annotations(arg)] if args else [annotation]


class Strict(BaseModel):
    """Base of every config section: unknown keys are errors, numbers are finite (no NaN or inf), and a
    boolean is not taken for a number (`steps: true` would otherwise mean 1 step)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None:
            leaves = _leaf_annotations(cls.model_fields[info.field_name].annotation)
            if (int in leaves or float in leaves) and bool not in leaves and Any not in leaves:
                raise ValueError("expected a number, not true / false")
        return value
