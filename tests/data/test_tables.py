"""The one dataset reader (`rollflow.data.tables.read_rows`): JSONL, parquet, `datasets` directories and hub
names give the same plain rows, and every bad input is one line of `DataError`. Nothing is downloaded."""

import datetime
import decimal
import json
import sys
from types import SimpleNamespace

import datasets
import pyarrow
import pyarrow.parquet
import pytest

from rollflow.config.sections import DatasetConfig
from rollflow.data.prompts import load_dataset, load_rows
from rollflow.data.tables import read_rows
from rollflow.errors import DataError

# a prompt row, an SFT chat (`messages`, a list of dicts) and a DPO pair in one: every column survives
ROWS = [
    {"prompt": "1+1", "answer": "2", "level": 1,
     "messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}],
     "chosen": "2", "rejected": "3"},
    {"prompt": "2+3", "answer": "5", "level": 2,
     "messages": [{"role": "user", "content": "2+3"}], "chosen": "5", "rejected": "6"},
]


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch, tmp_path):
    """`datasets` caches what it generates from a directory of data files under `tmp_path`, not in ~/.cache.
    (No test reaches the hub: the ones that name a hub dataset replace `datasets.load_dataset`.)"""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _write_parquet(path, rows):
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    return path


def _save_dataset(path, rows):
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def _error(path, **kwargs) -> str:
    with pytest.raises(DataError) as info:
        read_rows(str(path), **kwargs)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    return message


@pytest.mark.parametrize("write, name", [
    (_write_jsonl, "d.jsonl"), (_write_jsonl, "d.json"), (_write_parquet, "d.parquet"), (_save_dataset, "saved"),
])
def test_the_same_rows_round_trip_through_every_kind(tmp_path, write, name):
    path = write(tmp_path / name, ROWS)
    rows = read_rows(str(path))
    assert rows == ROWS  # nested `messages` included, as plain lists and dicts
    assert json.loads(json.dumps(rows)) == rows


def test_a_dataset_dict_directory_gives_the_split_asked_for(tmp_path):
    path = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(ROWS[1:])}).save_to_disk(str(path))
    assert read_rows(str(path)) == ROWS  # split defaults to train
    assert read_rows(str(path), split="test") == ROWS[1:]
    assert "has no split 'eval' (its splits: train, test)" in _error(path, split="eval")


def test_a_directory_of_data_files_names_its_splits_by_file(tmp_path):
    folder = tmp_path / "files"
    folder.mkdir()
    _write_jsonl(folder / "train.jsonl", ROWS)
    _write_jsonl(folder / "test.jsonl", ROWS[:1])
    assert read_rows(str(folder), split="test") == ROWS[:1]
    assert read_rows(str(folder)) == ROWS
    assert "Unknown split" in _error(folder, split="validation")


def test_a_json_file_may_hold_one_array_of_objects(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(ROWS, indent=2))
    assert read_rows(str(path)) == ROWS
    path.write_text("[1, 2]")
    assert "item 1 of the JSON array must be a JSON object" in _error(path)


def test_arrow_values_come_back_json_serializable(tmp_path):
    table = pyarrow.table({
        "prompt": ["a"],
        "when": [datetime.datetime(2024, 5, 1, 12, 30)],
        "price": pyarrow.array([decimal.Decimal("3.50")], pyarrow.decimal128(5, 2)),
        "blob": [b"\x00\xff"],
    })
    pyarrow.parquet.write_table(table, tmp_path / "d.parquet")
    [row] = read_rows(str(tmp_path / "d.parquet"))
    assert row == {"prompt": "a", "when": "2024-05-01T12:30:00", "price": "3.50", "blob": "AP8="}
    json.dumps(row)


def test_load_rows_checks_the_required_columns(tmp_path):
    path = _write_parquet(tmp_path / "d.parquet", [{"messages": [{"role": "user", "content": "hi"}]}])
    # an SFT dataset has no prompt column: it names its own
    assert load_rows(path=str(path), required=("messages",))[0]["messages"][0]["content"] == "hi"
    assert load_rows(path=str(path), required=()) == load_rows(path=str(path), required=["messages"])
    rows = [{"prompt": "p", "chosen": "a", "rejected": "b"}, {"prompt": "q", "chosen": "c"}]
    pairs = _write_jsonl(tmp_path / "pairs.jsonl", rows)
    with pytest.raises(DataError) as info:
        load_rows(path=str(pairs), required=("prompt", "chosen", "rejected"))
    message = str(info.value)
    assert "\n" not in message
    assert "has no 'rejected' column (row 2 lacks it; columns: chosen, prompt)" in message
    with pytest.raises(DataError, match="has no 'prompt' column"):  # the default: the prompt column
        load_rows(path=str(path))


def test_load_dataset_passes_the_sections_fields_through(tmp_path, monkeypatch):
    folder = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(ROWS[1:])}).save_to_disk(str(folder))
    section = DatasetConfig(path=str(folder), split="test")
    assert load_dataset(section, answer_key="chosen") == [{**ROWS[1], "answer": "5"}]
    calls = []
    monkeypatch.setattr(datasets, "load_dataset",
                        lambda *args, **kwargs: calls.append((args, kwargs)) or datasets.Dataset.from_list(ROWS))
    hub = SimpleNamespace(task=None, path="owner/name", split="test[:2]", subset="main", limit=1)
    assert load_dataset(hub, required=("messages",)) == ROWS[:1]
    assert calls == [(("owner/name", "main"), {"split": "test[:2]"})]


def test_a_hub_dataset_that_cannot_be_loaded_is_one_line(monkeypatch):
    def offline(name, subset=None, split=None):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (OfflineModeIsEnabled)\nmore detail")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    message = _error("owner/name", split="test", subset="main")
    assert message == ("could not load the dataset 'owner/name' (subset 'main', split 'test'): it is no local "
                       "path, and from the Hugging Face hub: ConnectionError: Couldn't reach 'owner/name' on the "
                       "Hub (OfflineModeIsEnabled)")
    assert "could not load the dataset 'gsm8k' (split 'train')" in _error("gsm8k")


def test_paths_that_are_no_hub_name_are_missing_files(monkeypatch):
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: pytest.fail("reached for the hub"))
    for path in ("/nonexistent/d.jsonl", "data/train.csv", "a b", "./x", "a/b/c"):
        assert _error(path) == f"dataset file not found: {path}"


@pytest.mark.parametrize("name, content, message", [
    ("d.jsonl", b'{"prompt": "1+1"}\n\x89PNG\r\n\x1a\n\x00', r"d.jsonl:2: not UTF-8 text (byte 0x89)"),
    ("d.jsonl", b"", "has no rows"),
    ("d.jsonl", b"\n  \n", "has no rows"),
    ("d.jsonl", b'{"prompt": "x"}\n[1, 2]\n', "d.jsonl:2: each line must be a JSON object"),
    ("d.jsonl", b'{"prompt": "x"\n', "d.jsonl:1: not valid JSON"),
    ("d.parquet", b'{"prompt": "not parquet"}\n', "d.parquet: not a readable parquet file (ArrowInvalid: "),
    ("d.parquet", b"", "d.parquet: not a readable parquet file"),
    ("d.csv", b"prompt\n1+1\n", "unknown dataset file kind '.csv'; supported: JSON lines (.jsonl, .json), "
                               "parquet (.parquet), a directory saved with `datasets` save_to_disk"),
    ("README", b"hi\n", "unknown dataset file kind (no extension)"),
])
def test_bad_files_are_one_line_errors(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    assert message in _error(path)


def test_empty_datasets_and_directories_are_one_line_errors(tmp_path):
    empty_table = pyarrow.Table.from_pylist([], schema=pyarrow.schema([("prompt", pyarrow.string())]))
    pyarrow.parquet.write_table(empty_table, tmp_path / "d.parquet")
    assert _error(tmp_path / "d.parquet") == f"dataset {tmp_path / 'd.parquet'} has no rows"
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"prompt": []}).save_to_disk(str(saved))  # saved as no data files at all
    assert "has no rows" in _error(saved)
    datasets.Dataset.from_dict({"prompt": ["a"]}).select([]).save_to_disk(str(tmp_path / "selected"))
    assert "has no rows" in _error(tmp_path / "selected")  # saved as one data file of no rows
    (tmp_path / "folder").mkdir()
    assert "dataset directory" in _error(tmp_path / "folder") and "is empty" in _error(tmp_path / "folder")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "d.jsonl").write_bytes(b"\x89PNG\r\n")
    assert "cannot load the data files of the directory" in _error(broken)
    half_saved = tmp_path / "half"
    half_saved.mkdir()
    (half_saved / "state.json").write_text("{")
    assert "cannot load the saved dataset" in _error(half_saved)


def test_missing_optional_packages_name_the_extra(tmp_path, monkeypatch):
    parquet = _write_parquet(tmp_path / "d.parquet", ROWS)
    saved = _save_dataset(tmp_path / "saved", ROWS)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # `import` now raises ImportError
    monkeypatch.setitem(sys.modules, "datasets", None)
    for path in (parquet, saved, "owner/name"):
        assert "pip install 'rollflow[data]'" in _error(path)
    assert read_rows(str(_write_jsonl(tmp_path / "d.jsonl", ROWS))) == ROWS  # JSONL needs neither


def test_dataset_config_split_and_subset_fit_the_source():
    assert DatasetConfig(path="openai/gsm8k", split="test", subset="main").split == "test"
    assert DatasetConfig(task="add2", split="eval").split == "eval"
    with pytest.raises(ValueError, match="a synthetic task's split is `train` or `eval`"):
        DatasetConfig(task="add2", split="test")
    with pytest.raises(ValueError, match="drop `subset`"):
        DatasetConfig(task="add2", subset="main")
    with pytest.raises(ValueError, match="exactly one of `task`"):
        DatasetConfig(task="add2", path="d.parquet")
