"""Loading a run config: YAML file + `a.b=c` overrides, validated against the pipeline it names.

`RunConfig` is a union of the pipelines' config models, discriminated by the `pipeline` key (default
`rlvr`); `PIPELINES` holds each pipeline, in one entry: its config model and its step class. Unknown keys are errors that name the key
and suggest the nearest valid one; a key given twice in one mapping is an error too (YAML would silently keep
the second: a repeated `train:` block would reset `steps`).
"""

from __future__ import annotations

import copy
import difflib
import re
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, Field, ValidationError

from rollflow.config.agentic import AgenticConfig
from rollflow.config.rlvr import RLVRConfig
from rollflow.config.sections import RunConfigBase
from rollflow.config.supervised import DistillConfig, DPOConfig, SFTConfig
from rollflow.errors import ConfigError
from rollflow.registry import Registry, import_object

DEFAULT_PIPELINE = "rlvr"



@dataclass(frozen=True)
class Pipeline:
    """One pipeline: all that is registered of it.

    Attributes:
        config: its run config model (a `RunConfigBase` with `pipeline: Literal[<name>]`).
        step: `"module:Class"`, its step class (`rollflow.pipelines.loop.PipelineStep`), built from a config;
            imported on first use, so loading a config needs no torch.
    """

    config: type[RunConfigBase]
    step: str

    def step_class(self) -> type:
        return import_object(self.step)

    def roles_of(self, config: RunConfigBase) -> list[str]:
        """The roles a run of `config` starts, in start order."""
        return self.step_class()(config).roles()


# Every pipeline, by the name its configs give as `pipeline:`; a new one is one config model, one step class
# and one entry here. `rollflow.pipelines.run` runs a config through its pipeline's step.
PIPELINES: Registry[Pipeline] = Registry("pipeline")
PIPELINES.register("rlvr")(Pipeline(RLVRConfig, "rollflow.pipelines.rlvr:RLVRStep"))
PIPELINES.register("sft")(Pipeline(SFTConfig, "rollflow.pipelines.supervised:SFTStep"))
PIPELINES.register("dpo")(Pipeline(DPOConfig, "rollflow.pipelines.supervised:DPOStep"))
PIPELINES.register("distill")(Pipeline(DistillConfig, "rollflow.pipelines.supervised:DistillStep"))
PIPELINES.register("agentic")(Pipeline(AgenticConfig, "rollflow.pipelines.agentic:AgenticStep"))

RunConfig = Annotated[Union[tuple(PIPELINES[name].config for name in PIPELINES)],  # noqa: UP007
                      Field(discriminator="pipeline")]


class _DuplicateKeyError(yaml.YAMLError):
    def __init__(self, key: object, first_line: int, line: int):
        lines = f"lines {first_line} and {line}" if first_line != line else f"line {line}"
        super().__init__(f"key {key!r} appears twice in one mapping ({lines}); YAML would silently keep only "
                         "the second: merge the two")
        self.key = key


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error as one line: what is wrong and where (PyYAML's own text spans several lines)."""
    problem = getattr(err, "problem", None)
    if not problem:
        return " ".join(str(err).split())
    mark = getattr(err, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    hint = "; indent with spaces, not tabs" if "'\\t'" in problem else ""
    return f"{problem}{where}{hint}"


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` whose mappings refuse a key given twice. A key a `<<` merge brings in may still be
    overridden by an explicit one (that is what merges are for)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}  # key -> the line it first appears on
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            try:
                hash(key)
            except TypeError:  # an unhashable key: the base constructor names the problem
                continue
            if key in seen:
                raise _DuplicateKeyError(key, seen[key], line)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str) -> Any:
    """Parse YAML text (a config file or an override's value) like `yaml.safe_load`, refusing duplicate keys.

    Raises:
        yaml.YAMLError: invalid YAML, or a key given twice in one mapping.
    """
    return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: plain data only, no Python objects


def config_model(pipeline: object) -> type[RunConfigBase]:
    """The config model of `pipeline` (a name); raises `ConfigError` naming the valid pipelines."""
    if not isinstance(pipeline, str) or pipeline not in PIPELINES:
        raise ConfigError(f"pipeline: {PIPELINES.unknown_message(str(pipeline))}")
    return PIPELINES[pipeline].config


# One key of an override path: a name, then any `[N]` list indices (`functions[0]`, `matrix[1][2]`).
_PATH_PART = re.compile(r"([^\[\]]*)((?:\[[^\[\]]*\])*)")
_INDEX = re.compile(r"\[([^\[\]]*)\]")


def _override_path(dotted: str) -> list[str | int]:
    """The keys of an override path: `reward.functions[0].weight` -> `["reward", "functions", 0, "weight"]`.

    A bracketed index becomes an int; a plain all-digit key (`reward.functions.0.weight`) stays a string and
    indexes a list when the node it meets is one (`_set_dotted`)."""
    keys: list[str | int] = []
    for part in dotted.split("."):
        match = _PATH_PART.fullmatch(part)
        if match is None:
            raise ConfigError(f"override {dotted}: {part!r} is not a key or a key with list indices like "
                              "`functions[0]`")
        name, indices = match.groups()
        if name or not indices:
            keys.append(name)
        for index in _INDEX.findall(indices):
            if not index.isdigit():
                raise ConfigError(f"override {dotted}: [{index}] is not a list index (a number from 0)")
            keys.append(int(index))
    return keys


def _path_text(keys: list[str | int]) -> str:
    """`["reward", "functions", 0]` -> `reward.functions[0]`, as a user writes it."""
    text = ""
    for key in keys:
        text += f"[{key}]" if isinstance(key, int) else (f".{key}" if text else key)
    return text


def _list_index(node: list[Any], key: str | int, keys: list[str | int], dotted: str) -> int:
    """`key` as an index into `node`, the list at `keys`; `ConfigError` (one line) when it is none or out of
    range."""
    if isinstance(key, str) and not key.isdigit():
        raise ConfigError(f"override {dotted}: {_path_text(keys)} is a list; index it by position, e.g. "
                          f"{_path_text([*keys, 0])}")
    index = int(key)
    if index >= len(node):
        raise ConfigError(f"override {dotted}: index {index} is out of range: {_path_text(keys)} has "
                          f"{len(node)} item{'s' if len(node) != 1 else ''}")
    return index


def _section_model(model: Any, keys: list[str | int]) -> type[BaseModel] | None:
    """The config model of the section at `keys` under `model` (through optional, dict and list fields), or
    None where the path leaves the schema."""
    candidates = [model]
    for key in keys:
        found = []
        for leaf in (leaf for candidate in candidates for leaf in _alternatives(candidate)):
            if isinstance(leaf, type) and issubclass(leaf, BaseModel):
                field = leaf.model_fields.get(key) if isinstance(key, str) else None
                found += [field.annotation] if field is not None else []
            elif get_origin(leaf) is dict and isinstance(key, str):
                found.append(get_args(leaf)[1])
            elif get_origin(leaf) is list:
                found.append(get_args(leaf)[0])
        candidates = found
    models = [leaf for candidate in candidates for leaf in _alternatives(candidate)
              if isinstance(leaf, type) and issubclass(leaf, BaseModel)]
    return models[0] if models else None


def _alternatives(annotation: Any) -> list[Any]:
    """The types a union annotation allows (`X | None` -> `[X, None]`); any other annotation as it is."""
    if get_origin(annotation) in (Union, types.UnionType):
        return [leaf for arg in get_args(annotation) for leaf in _alternatives(arg)]
    return [annotation]


def _default_section(default: Any, section: type[BaseModel] | None) -> Any:
    """What a section missing from the tree starts as, for an override to change one key of: the keys of its
    default (`default`, from the pipeline's defaults) that differ from the section model's own field defaults
    (`data.train`'s `task: add2`), not those that equal them. Pydantic fills those in all the same, and they
    stay unset: a validator that asks whether the config set a key (`model_fields_set`: `train.steps` beside
    `train.epochs`, the asynchronous TIS default) sees only the override's key."""
    if isinstance(default, list):
        return copy.deepcopy(default)
    if not isinstance(default, dict):
        return {}
    try:
        own = section.model_construct().model_dump(mode="json") if section is not None else {}
    except Exception:  # noqa: BLE001 -- a section model that cannot be built empty: keep every default
        own = {}
    return {key: copy.deepcopy(value) for key, value in default.items() if key not in own or own[key] != value}


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any, model: type[BaseModel],
                defaults: dict[str, Any]) -> None:
    """Set `tree[a][b]... = value` (`a.b[0].c` indexes a list); a section missing from `tree` starts as its
    default, so `a.b.c=1` changes one key of the default section instead of replacing the section.

    A key that replaces others when set by an override (a section's `override_replaces`, e.g. a dataset's
    `path` and `task`, of which a config sets exactly one) drops them from the section."""
    keys = _override_path(dotted)
    node: Any = tree
    default: Any = defaults
    for depth, key in enumerate(keys[:-1]):
        if isinstance(node, list):
            key = keys[depth] = _list_index(node, key, keys[:depth], dotted)
            default = default[key] if isinstance(default, list) and key < len(default) else None
            child = node[key]
        elif isinstance(key, int):
            raise ConfigError(f"override {dotted}: {_path_text(keys[:depth]) or 'the config'} is a section, not "
                              "a list")
        else:
            default = default.get(key) if isinstance(default, dict) else None
            child = node.get(key)
            if child is None:
                child = node[key] = _default_section(default, _section_model(model, keys[:depth + 1]))
        if not isinstance(child, (dict, list)):
            what = repr(key) if isinstance(key, str) else _path_text(keys[:depth + 1])
            expected = "a list" if isinstance(keys[depth + 1], int) else "a section"
            raise ConfigError(f"override {dotted}: {what} is a value, not {expected}")
        node = child
    last = keys[-1]
    if isinstance(node, list):
        node[_list_index(node, last, keys[:-1], dotted)] = value
        return
    if isinstance(last, int):
        raise ConfigError(f"override {dotted}: {_path_text(keys[:-1]) or 'the config'} is a section, not a "
                          "list")
    section = _section_model(model, keys[:-1])
    if value is not None:
        for replaced in getattr(section, "override_replaces", {}).get(last, ()):
            node.pop(replaced, None)
    node[last] = value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=c` overrides; values are parsed as YAML (`3`, `1e-5`, `true`, `[1, 2]`, `null`).

    A path indexes lists as `reward.functions[0].weight` (or `reward.functions.0.weight`). Setting a
    dataset's `path` replaces the config's `task` and the other way round (`override_replaces`).

    A section missing from `tree` starts from the defaults of the pipeline the run names (a `pipeline=`
    override counts, wherever it stands).
    """
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        try:
            value = parse_yaml(raw) if raw.strip() else ""
        except _DuplicateKeyError as err:
            raise ConfigError(f"override {item!r}: key {err.key!r} appears twice in one mapping") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({_yaml_problem(err)})") from None
        parsed.append((key.strip(), value))
    tree.update({key: value for key, value in parsed if key == "pipeline"})
    if parsed:
        model = config_model(tree.get("pipeline", DEFAULT_PIPELINE))
        defaults = model.model_construct().model_dump(mode="json")
    for key, value in parsed:
        _set_dotted(tree, key, value, model, defaults)
    return tree


def _fields_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The field names of the sub-model that `loc` (a pydantic error location, minus the last key) points at."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        field = current.model_fields.get(part) if isinstance(current, type) else None
        if field is None:
            return []
        annotation = field.annotation
        current = next(
            (arg for arg in _flatten_annotation(annotation) if isinstance(arg, type) and issubclass(arg, BaseModel)),
            None,
        )
        if current is None:
            return []
    return list(current.model_fields) if isinstance(current, type) else []


def _flatten_annotation(annotation: Any) -> list[Any]:
    args = getattr(annotation, "__args__", None)
    if not args:
        return [annotation]
    return [leaf for arg in args for leaf in _flatten_annotation(arg)]


def _describe(error: dict[str, Any], model: type[BaseModel]) -> str:
    loc = tuple(error["loc"])
    where = ".".join(str(p) for p in loc) or "config"
    if error["type"] == "extra_forbidden":
        valid = _fields_at(model, loc[:-1])
        near = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
        hint = f"; did you mean {'.'.join([*map(str, loc[:-1]), near[0]])!r}?" if near else ""
        return f"unknown config key {where!r}{hint} (valid here: {', '.join(valid)})"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] in ("value_error", "assertion_error") and (not loc or isinstance(error.get("input"),
                                                                                    dict | BaseModel)):
        return f"{where}: {message}" if loc else message
    return f"{where}: {message} (got {error.get('input')!r})"


def build_config(tree: dict[str, Any]) -> RunConfig:
    """Validate a raw config tree against the model of the pipeline it names (default `rlvr`); raise
    `ConfigError` with one line per problem."""
    model = config_model(tree.get("pipeline", DEFAULT_PIPELINE))
    try:
        return model.model_validate(tree)
    except ValidationError as err:
        raise ConfigError("; ".join(_describe(e, model) for e in err.errors())) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (or start from defaults when `path` is None), apply overrides, validate.

    Raises:
        ConfigError: missing, unreadable, non-UTF-8 or empty file, bad YAML, a key given twice, unknown key,
            wrong type, bad batch sizes.
    """
    tree: dict[str, Any] = {}
    if path is not None:
        tree = _read_config_file(Path(path))
    return build_config(apply_overrides(tree, overrides or []))


def pipeline_of(path: str | Path) -> str | None:
    """The `pipeline` a config file names, None when it names none. Raises `ConfigError` for an unreadable
    file, as `load_config` would."""
    return _read_config_file(Path(path)).get("pipeline")


def _read_config_file(path: Path) -> dict[str, Any]:
    """The mapping a config file holds; `ConfigError` (one line) for anything else."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}" + (" (it is a directory)" if path.is_dir() else ""))
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                          f"{err.start}); is it a YAML file?") from None
    try:
        loaded = parse_yaml(text)
    except _DuplicateKeyError as err:
        raise ConfigError(f"config file {path}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(err)}") from None
    if loaded is None:
        raise ConfigError(f"config file {path} is empty; write at least the keys you change from the defaults "
                          "(e.g. `name: my_run`)")
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, not {type(loaded).__name__}")
    return loaded


def dump_config(config: RunConfig) -> str:
    """The resolved config as YAML (what `--print-config` prints and what the run directory keeps)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
