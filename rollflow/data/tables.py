"""Dataset rows from any source: a JSONL or parquet file, a `datasets` directory, or a Hugging Face hub name.

`read_rows` is the one reader every pipeline's data goes through (RL prompts, SFT chats, DPO pairs,
distillation prompts). It only reads: it checks that there are rows and that each is an object, and leaves
which columns a pipeline needs to the pipeline (`rollflow.data.prompts.load_rows(required=...)`).

What `path` names decides how it is read:

- a `.jsonl` / `.json` file: JSON lines, one object per line (a `.json` file holding one JSON array of
  objects is read too);
- a `.parquet` file: read with pyarrow;
- a directory written by `datasets` `Dataset.save_to_disk` / `DatasetDict.save_to_disk` (of a dict, its
  `split`);
- any other directory: its data files, through `datasets.load_dataset(directory, split=split)` (file names
  such as `train.jsonl` / `test.parquet` name the splits);
- a string that is no local path but looks like a hub name (`owner/name` or `name`):
  `datasets.load_dataset(name, subset, split=split)`.

pyarrow and `datasets` (the `data` extra) are imported only when a source needs them. Every failure is one
line of `DataError`.
"""

from __future__ import annotations

import base64
import codecs
import datetime
import decimal
import json
import re
from pathlib import Path
from typing import Any

from rollflow.errors import DataError

Row = dict[str, Any]

JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
# `save_to_disk` writes `state.json` into a `Dataset` directory and `dataset_dict.json` into a `DatasetDict` one
SAVED_DATASET_MARKERS = ("dataset_dict.json", "state.json")
SUPPORTED_KINDS = ("JSON lines (.jsonl, .json), parquet (.parquet), a directory saved with `datasets` "
                   "save_to_disk, a directory of data files, or a Hugging Face hub dataset name")
# `owner/name` or `name`, as the hub spells them; a dot is allowed (`AI-MO/NuminaMath-1.5`)
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
# a missing path ending like a data file is a missing file, not a hub name
FILE_LIKE_SUFFIX = re.compile(r"\.(jsonl?|parquet|csv|tsv|txt|arrow|gz|bz2|xz|zst|zip|tar)$", re.IGNORECASE)
INSTALL_HINT = "pip install 'rollflow[data]'"
# first bytes -> what a data file that is not JSON text is, for the message that refuses it
BINARY_SIGNATURES = (
    (b"\x1f\x8b", "a gzip-compressed file (decompress it: gunzip)"),
    (b"BZh", "a bzip2-compressed file (decompress it: bunzip2)"),
    (b"\xfd7zXZ\x00", "an xz-compressed file (decompress it: unxz)"),
    (b"\x28\xb5\x2f\xfd", "a zstd-compressed file (decompress it: unzstd)"),
    (b"PK\x03\x04", "a zip archive (extract it)"),
    (b"PAR1", "a parquet file (name it .parquet)"),
    (b"ARROW1", "an Arrow file"),
    (b"\x89PNG", "a PNG image"),
    (b"\x7fELF", "an executable"),
)


def read_rows(path: str, split: str = "train", subset: str | None = None) -> list[Row]:
    """All rows of the dataset at `path`, as plain JSON-serializable dicts.

    Args:
        path: a `.jsonl` / `.json` / `.parquet` file, a directory saved with `datasets` `save_to_disk` or
            holding data files, or a Hugging Face hub dataset name (`owner/name`).
        split: the split of a `datasets` dataset (a `DatasetDict` directory, a directory of data files, a
            hub dataset); ignored for a single file and for a saved single `Dataset`.
        subset: a hub dataset's configuration name (`main` of `openai/gsm8k`); `None`: its default.

    Returns:
        The rows in order; values are lists, dicts, strings, numbers, booleans or None (dates become ISO
        strings, decimals strings, bytes base64 strings).

    Raises:
        DataError: a missing path, a file that is not UTF-8 / not valid JSON / not parquet, an unknown file
            kind, a row that is not an object, a missing split, no rows, a hub dataset that cannot be loaded,
            or `datasets` / pyarrow not installed when needed.
    """
    source = Path(path)
    if source.is_dir():
        rows = _read_dataset_directory(source, split)
    elif source.is_file():
        suffix = source.suffix.lower()
        if suffix in JSON_SUFFIXES:
            rows = _read_json_lines(source)
        elif suffix in PARQUET_SUFFIXES:
            rows = _read_parquet(source)
        else:
            kind = repr(source.suffix) if source.suffix else "(no extension)"
            raise DataError(f"{path}: unknown dataset file kind {kind}; supported: {SUPPORTED_KINDS}")
    elif HUB_NAME.fullmatch(path) and not FILE_LIKE_SUFFIX.search(path):
        rows = _read_hub_dataset(path, subset, split)
    else:
        raise DataError(f"dataset file not found: {path}")
    if not rows:
        raise DataError(f"dataset {path} has no rows")
    return rows


def _read_json_lines(path: Path) -> list[Row]:
    try:
        data = path.read_bytes().removeprefix(codecs.BOM_UTF8)  # some editors start UTF-8 text with a BOM
        text = data.decode("utf-8")
    except OSError as err:
        raise DataError(f"cannot read dataset file {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        line = err.object.count(b"\n", 0, err.start) + 1
        kind = _binary_kind(data)
        raise DataError(f"{path}:{line}: not UTF-8 text (byte {err.object[err.start]:#04x})"
                        f"{f': it is {kind}' if kind else ''}; a dataset is a JSONL file, one JSON object per "
                        "line") from None
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        return _read_json_array(path, text)
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        row = _parse_json(line, path, number)
        if not isinstance(row, dict):
            raise DataError(f"{path}:{number}: each line must be a JSON object")
        rows.append(row)
    return rows


def _read_json_array(path: Path, text: str) -> list[Row]:
    rows = _parse_json(text, path)
    for number, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise DataError(f"{path}: item {number} of the JSON array must be a JSON object")
    return rows


def _parse_json(text: str, path: Path, line: int | None = None) -> Any:
    """`json.loads(text)`, text being line `line` of `path` (None: the whole file); `DataError` (one line,
    naming the line) for anything `json` refuses, a nesting too deep for it or an integer too long included."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        where, reason = f"{path}:{err.lineno if line is None else line}", err.msg
    except RecursionError:
        where, reason = f"{path}:{line}" if line else str(path), "nested too deeply"
    except ValueError as err:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        where, reason = f"{path}:{line}" if line else str(path), str(err).split(":")[0]
    raise DataError(f"{where}: not valid JSON ({reason})")


def _binary_kind(data: bytes) -> str | None:
    """What a file that is not text starts like (`a gzip-compressed file`), by its first bytes; None when
    it is nothing known."""
    return next((kind for magic, kind in BINARY_SIGNATURES if data.startswith(magic)), None)


def _read_parquet(path: Path) -> list[Row]:
    try:
        import pyarrow.parquet
    except ImportError:
        raise DataError(f"reading the parquet file {path} needs pyarrow: {INSTALL_HINT}") from None
    try:
        table = pyarrow.parquet.read_table(path)
    except Exception as err:  # pyarrow raises ArrowInvalid, OSError, ... for a file that is not parquet
        head = _head(path)
        kind = ("JSON text (name it .jsonl)" if head.lstrip()[:1] in (b"{", b"[")
                else None if head.startswith(b"PAR1") else _binary_kind(head))  # PAR1: a damaged parquet file
        raise DataError(f"{path}: not a readable parquet file ({_first_line(err)})"
                        f"{f'; it is {kind}' if kind else ''}") from None
    return [_plain(row) for row in table.to_pylist()]


def _head(path: Path, size: int = 8) -> bytes:
    """The first `size` bytes of `path` (empty when it cannot be read)."""
    try:
        with path.open("rb") as file:
            return file.read(size)
    except OSError:
        return b""


def _read_dataset_directory(path: Path, split: str) -> list[Row]:
    if not any(path.iterdir()):
        raise DataError(f"dataset directory {path} is empty; supported: {SUPPORTED_KINDS}")
    datasets = _import_datasets(f"the dataset directory {path}")
    if any((path / marker).is_file() for marker in SAVED_DATASET_MARKERS):
        if _saved_without_shards(path):
            return []  # `datasets` saves an empty dataset as no files, then cannot load it (IndexError)
        try:
            loaded = datasets.load_from_disk(str(path))
        except Exception as err:  # a corrupt or half-written directory: any error, reported in one line
            raise DataError(f"cannot load the saved dataset {path}: {_first_line(err)}") from None
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DataError(f"dataset {path} has no split {split!r} (its splits: {', '.join(loaded)})")
            loaded = loaded[split]
        return [_plain(row) for row in loaded.to_list()]
    try:
        loaded = datasets.load_dataset(str(path), split=split)
    except Exception as err:  # no data files, unknown split, unreadable files: one line, no traceback
        raise DataError(f"cannot load the data files of the directory {path} (split {split!r}): "
                        f"{_first_line(err)}") from None
    return [_plain(row) for row in loaded.to_list()]


def _saved_without_shards(path: Path) -> bool:
    """Whether `path` is a `Dataset.save_to_disk` directory that lists no data files."""
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError):  # no state.json (a DatasetDict), or a broken one: `load_from_disk` reports it
        return False
    return isinstance(state, dict) and state.get("_data_files") == []


def _read_hub_dataset(name: str, subset: str | None, split: str) -> list[Row]:
    datasets = _import_datasets(f"{name!r}, which is no local path, as a Hugging Face hub dataset")
    try:
        loaded = datasets.load_dataset(name, subset, split=split)
    except Exception as err:  # offline, no such dataset, gated, unknown subset or split: one line
        which = f"subset {subset!r}, split {split!r}" if subset is not None else f"split {split!r}"
        raise DataError(f"could not load the dataset {name!r} ({which}): it is no local path, and from the "
                        f"Hugging Face hub: {_first_line(err)}") from None
    return [_plain(row) for row in loaded.to_list()]


def _import_datasets(purpose: str):
    try:
        import datasets
    except ImportError:
        raise DataError(f"reading {purpose} needs the `datasets` package: {INSTALL_HINT}") from None
    return datasets


def _first_line(err: BaseException) -> str:
    """`Type: first line` of `err`, and of its innermost cause when it has one: `datasets` wraps what went
    wrong (`DatasetGenerationError: An error occurred while generating the dataset`)."""
    def line(error: BaseException) -> str:
        lines = str(error).strip().splitlines()
        return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    cause, seen = err, {id(err)}
    while cause.__cause__ is not None and id(cause.__cause__) not in seen:  # a cycle of causes ends the walk
        cause = cause.__cause__
        seen.add(id(cause))
    return line(err) if cause is err else f"{line(err)} ({line(cause)})"


def _plain(value: Any) -> Any:
    """`value` with what JSON cannot hold made plain: arrow hands out dates, decimals and bytes."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, (datetime.date, datetime.time)):  # datetime is a date
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)  # exact: "3.50" stays "3.50"
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(value).decode("ascii")
    return str(value)
