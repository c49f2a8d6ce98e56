"""The config reference (docs/config.md), generated from the schema: every key, its type, default and meaning.

`python -m rollflow.config.reference docs/config.md` rewrites the file; with no argument the reference goes
to stdout. The text of each row is the field's `description`; `tests/config/test_config_reference.py` checks
that every field has one and that the committed file is what `render_config_reference()` returns.

Layout: a fixed introduction, the pipelines, then the keys of `RunConfigBase` (every pipeline has them), then
each pipeline's own sections. Each section is one table of dotted keys, recursing into nested sections
(`data.eval.limit`), into the items of a list of sections (`reward.functions[].name`) and into the values of a
mapping of names to sections (`data.domains.<name>.share`); a section made only of sections (`roles`) gets
one table per sub-section.
"""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, Union, get_args, get_origin

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from rollflow.config.loading import DEFAULT_PIPELINE, PIPELINES
from rollflow.config.sections import RunConfigBase
from rollflow.registry import generated_doc_main

REGENERATE = "python -m rollflow.config.reference docs/config.md"

INTRODUCTION = f"""\
# Config reference

<!-- Generated from the schema in rollflow/config/ by `{REGENERATE}`.
Edit the field descriptions there, not this file. -->

A run is one YAML file, validated on load against the typed schema of the pipeline its `pipeline:` key names
(default `{DEFAULT_PIPELINE}`). The [keys every pipeline has](#keys-every-pipeline-has) come first, then each
pipeline's own sections.

Any key can be overridden on the command line as `key.path=value`, e.g. `rollout.groups_per_step=32` or
`roles.actor_train.backend=fsdp2`. The value is parsed as YAML (`3`, `1e-5`, `true`, `[a, b]`, `{{name: x}}`,
`null`), and overriding one key of a section keeps the section's other keys. `rollflow train CFG
--print-config` prints the resolved config with every default.

Unknown keys are errors that name the nearest valid key (`unknown config key 'rollout.prompt_per_step'; did
you mean 'rollout.groups_per_step'?`); wrong types name the key and the value; batch sizes that do not
divide say which number to change. Algorithm, backend and engine names and their options are checked against
their registries at load time.

Reading the tables: a key is its dotted path from the top of the file. `int > 0` and `float in [0, 1)` are
numbers with bounds, `"a" | "b"` one of those strings, `null` YAML's null, `section` a mapping of the keys
listed under it, `list[section]` a list of such mappings (the keys of each item written `key[].name`),
`dict[str, section]` a mapping of names you choose to such mappings (their keys written `key.<name>.field`).
Defaults are written as YAML; the keys of a section whose default is `null` show the defaults they take once
the section is set.
"""

TABLE_HEADER = "| key | type | default | description |\n|---|---|---|---|"


class Row(NamedTuple):
    key: str
    type: str
    default: str | None  # as YAML; None: the key is required
    description: str


def render_config_reference() -> str:
    """The whole docs/config.md, generated from `PIPELINES`' config models and the field descriptions.

    Returns:
        Markdown text ending in one newline; the same for the same schema.
    """
    parts = [INTRODUCTION, _pipelines_table(), "## Keys every pipeline has"]
    parts += _sections(RunConfigBase, _shared_fields(), shared=True)
    for name in PIPELINES:
        model = PIPELINES[name].config
        parts.append(f"## Pipeline `{name}`\n\n{_summary(model)}")
        parts += _sections(model, _own_fields(model), shared=False)
    return "\n\n".join(part.strip("\n") for part in parts) + "\n"


def _shared_fields() -> list[str]:
    """The fields of `RunConfigBase` that every pipeline keeps as they are (a section some pipeline redefines,
    like the supervised pipelines' `data`, is listed under each pipeline instead)."""
    base = RunConfigBase.model_fields
    return [name for name, field in base.items() if name == "pipeline"
            or all(PIPELINES[p].config.model_fields[name].annotation == field.annotation for p in PIPELINES)]


def _own_fields(model: type[RunConfigBase]) -> list[str]:
    """The fields a pipeline's model adds to the shared ones or redefines (the `pipeline` key aside)."""
    shared = _shared_fields()
    return [name for name in model.model_fields if name != "pipeline" and name not in shared]


def _pipelines_table() -> str:
    lines = ["## Pipelines", "", "| `pipeline` | what it runs | its own sections |", "|---|---|---|"]
    for name in PIPELINES:
        model = PIPELINES[name].config
        label = f"`{name}` (default)" if name == DEFAULT_PIPELINE else f"`{name}`"
        own = ", ".join(f"`{field}`" for field in _own_fields(model)) or "none"
        lines.append(f"| {label} | {_cell(_summary(model))} | {own} |")
    return "\n".join(lines)


def _summary(model: type[BaseModel]) -> str:
    """The first paragraph of a model's docstring, on one line."""
    return " ".join((model.__doc__ or "").strip().split("\n\n")[0].split())


def _sections(model: type[BaseModel], names: list[str], shared: bool) -> list[str]:
    """The top-level keys of `names` as one table, then one heading (and table) per section among them."""
    parts = []
    top_rows = []
    for name in names:
        field = model.model_fields[name]
        if _is_section(field.annotation):
            continue
        if shared and name == "pipeline":
            pipelines = " | ".join(json.dumps(pipeline) for pipeline in PIPELINES)
            top_rows.append(Row(name, pipelines, DEFAULT_PIPELINE, field.description or ""))
        else:
            top_rows += _rows(name, field, _default(field))
    if top_rows:
        parts.append("### Top-level keys\n\n" + _table(top_rows))
    for name in names:
        field = model.model_fields[name]
        if _is_section(field.annotation):
            parts += _section(name, field, _default(field), level=3)
    return parts


def _section(key: str, field: FieldInfo, value: Any, level: int) -> list[str]:
    """A heading for section `key`, its description, then its table, or one sub-heading per sub-section.

    `value` is the section's default (its keys' defaults come from it), or `PydanticUndefined`.
    """
    fields = field.annotation.model_fields
    values = {name: getattr(value, name) if isinstance(value, BaseModel) else _default(sub)
              for name, sub in fields.items()}
    parts = [f"{'#' * level} `{key}`\n\n{field.description or ''}"]
    if fields and all(_is_section(sub.annotation) for sub in fields.values()):
        for name, sub in fields.items():
            parts += _section(f"{key}.{name}", sub, values[name], level + 1)
        return parts
    rows = [row for name, sub in fields.items() for row in _rows(f"{key}.{name}", sub, values[name])]
    parts.append(_table(rows))
    return parts


def _rows(key: str, field: FieldInfo, value: Any) -> list[Row]:
    """The row of `key`, then the rows of the keys under it when it is a section or a list of sections.

    Args:
        key: dotted path of the field.
        field: its pydantic field.
        value: its default here: the field's own default, or its value in the parent section's default.
    """
    default = None if value is PydanticUndefined else _yaml(value)
    row = Row(key, _type(field.annotation, field.metadata), default, field.description or "")
    model = _section_model(field.annotation)
    if model is None:
        return [row]
    if isinstance(value, BaseModel):
        row = row._replace(default=_yaml(_changed(value)))
    else:  # null, or a list or mapping of sections: the keys under it show their own defaults
        value = None
    key = _item_key(key, field.annotation)
    children = []
    for name, sub in model.model_fields.items():
        children += _rows(f"{key}.{name}", sub, _default(sub) if value is None else getattr(value, name))
    return [row, *children]


def _changed(section: BaseModel) -> dict[str, Any]:
    """The keys of a section whose values differ from their own defaults (what the section's default sets)."""
    return {name: getattr(section, name) for name, field in type(section).model_fields.items()
            if field.is_required() or getattr(section, name) != _default(field)}


def _default(field: FieldInfo) -> Any:
    """A field's default value; `PydanticUndefined` for a required field."""
    if field.default_factory is not None:
        return field.default_factory()
    return field.default


def _yaml(value: Any) -> str:
    """`value` as YAML shows it, on one line (flow style)."""
    text = yaml.safe_dump(to_jsonable_python(value), default_flow_style=True, sort_keys=False, width=10**6,
                          allow_unicode=True)
    return text.removesuffix("\n...\n").strip()


def _is_section(annotation: Any) -> bool:
    """A section that is always there (not optional, not a list): it gets a heading of its own."""
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a section, an optional section, or a list or mapping (of lists) of sections; None for any
    other type."""
    if _is_section(annotation):
        return annotation
    if get_origin(annotation) is dict:
        return _section_model(get_args(annotation)[1])
    if get_origin(annotation) is list or _is_union(annotation):
        for arg in get_args(annotation):
            model = _section_model(arg)
            if model is not None:
                return model
    return None


def _item_key(key: str, annotation: Any) -> str:
    """The key the fields of `annotation`'s sections hang from: `key` for a section, `key[]` for a list of
    sections, `key.<name>` for a mapping of names to sections (`key.<name>[]` to lists of them)."""
    if _is_union(annotation):
        sections = [arg for arg in get_args(annotation) if _section_model(arg) is not None]
        return _item_key(key, sections[0]) if sections else key
    if get_origin(annotation) is dict:
        return _item_key(f"{key}.<name>", get_args(annotation)[1])
    if get_origin(annotation) is list:
        return _item_key(f"{key}[]", get_args(annotation)[0])
    return key


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType)


def _type(annotation: Any, metadata: Sequence[Any] = ()) -> str:
    """A readable type: `int > 0`, `float in [0, 1)`, `"a" | "b"`, `list[int] | null`, `section`, ..."""
    if _is_union(annotation):
        parts = [_type(arg, metadata) for arg in get_args(annotation) if arg is not type(None)]
        return " | ".join(parts + ["null"] * (type(None) in get_args(annotation)))
    if get_origin(annotation) is Literal:
        return " | ".join("null" if arg is None else json.dumps(arg) for arg in get_args(annotation))
    if _is_section(annotation):
        return "section"
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is list:
        return f"list[{_type(args[0])}]"
    if origin is tuple:
        return "[" + ", ".join(_type(arg) for arg in args) + "]"
    if origin is dict:
        return "dict" if not args or args[1] is Any else f"dict[{_type(args[0])}, {_type(args[1])}]"
    if annotation is Any:
        return "any"
    name = getattr(annotation, "__name__", str(annotation))
    return f"{name} {_bounds(metadata)}".strip() if name in ("int", "float") else name


def _bounds(metadata: Sequence[Any]) -> str:
    """`> 0`, `>= 1`, `in [0, 1)` from a field's `gt` / `ge` / `lt` / `le` constraints."""
    low = high = None
    for item in metadata:
        if isinstance(item, (annotated_types.Gt, annotated_types.Ge)):
            low = ("(", ">", item.gt) if isinstance(item, annotated_types.Gt) else ("[", ">=", item.ge)
        elif isinstance(item, (annotated_types.Lt, annotated_types.Le)):
            high = (")", "<", item.lt) if isinstance(item, annotated_types.Lt) else ("]", "<=", item.le)
    if low and high:
        return f"in {low[0]}{low[2]}, {high[2]}{high[0]}"
    bound = low or high
    return f"{bound[1]} {bound[2]}" if bound else ""


def _table(rows: list[Row]) -> str:
    lines = [TABLE_HEADER]
    for row in rows:
        default = "required" if row.default is None else f"`{_cell(row.default)}`"
        lines.append(f"| `{row.key}` | `{_cell(row.type)}` | {default} | {_cell(row.description)} |")
    return "\n".join(lines)


def _cell(text: str) -> str:
    """Text fit for one table cell: one line, pipes escaped (also inside code spans, as GFM tables need)."""
    return " ".join(text.split()).replace("|", "\\|")


def main(argv: list[str] | None = None) -> int:
    """Write the reference to the path given (e.g. docs/config.md), or print it when none is."""
    return generated_doc_main(argv, REGENERATE, render_config_reference)


if __name__ == "__main__":
    sys.exit(main())
