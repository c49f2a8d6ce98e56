"""A data file that is not JSON lines or parquet (binary, compressed, or JSON that Python's parser refuses) is
one line `rollflow: error: ...` naming the file and what was expected, exit status 2, before the first step,
for every command that reads data: the workers that started meanwhile are stopped where they are."""

from __future__ import annotations

import gzip
import json
import random

import pytest

from rollflow.cli import EXIT_USER_ERROR, main
from rollflow.cluster.groups import StartCancelled

ROW = json.dumps({"prompt": "1+1", "answer": "2"}) + "\n"
BINARY = random.Random(0).randbytes(4096)  # random bytes: not UTF-8 from the first line on

CASES = {  # file name -> (content, what the one line says after the file name)
    "random.jsonl": (BINARY, ":1: not UTF-8 text (byte 0x"),
    "packed.jsonl": (gzip.compress(ROW.encode()),
                     ":1: not UTF-8 text (byte 0x8b): it is a gzip-compressed file (decompress it: gunzip); a "
                     "dataset is a JSONL file, one JSON object per line"),
    "huge.jsonl": (('{"prompt": "x", "answer": ' + "9" * 5000 + "}\n").encode(),
                   ":1: not valid JSON (Exceeds the limit (4300 digits) for integer string conversion)"),
    "deep.jsonl": (("[" * 100_000 + "\n").encode(), ":1: not valid JSON (nested too deeply)"),
    "deep.json": (("[" * 100_000).encode(), ": not valid JSON (nested too deeply)"),
    "random.parquet": (BINARY, ": not a readable parquet file ("),
    "rows.parquet": (ROW.encode(), ": not a readable parquet file (ArrowInvalid: "),
}


@pytest.fixture(autouse=True)
def starts(monkeypatch):
    """Ray and the workers stood in for: Ray "starts" at once, and a start of workers lasts until it is
    cancelled (as a real one, importing torch, outlasts the check of a small file). Returns the roles of each
    start that was cancelled."""
    cancelled_starts = []

    def start_roles(config, roles, specs=None, cancelled=None):
        assert cancelled is not None and cancelled.wait(60), "a bad data file did not stop the workers' start"
        cancelled_starts.append(list(roles))
        raise StartCancelled

    monkeypatch.setattr("rollflow.workers.roles.start_ray", lambda *args, **kwargs: None)
    monkeypatch.setattr("rollflow.workers.roles.stop_ray", lambda: None)
    monkeypatch.setattr("rollflow.workers.roles.start_roles", start_roles)
    return cancelled_starts


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rollflow: error: ") and "Traceback" not in err, err
    return err.removeprefix("rollflow: error: ").rstrip("\n")


@pytest.mark.parametrize("name", CASES)
def test_train_refuses_the_file_in_one_line(tmp_path, capsys, starts, name):
    content, expected = CASES[name]
    path = tmp_path / name
    path.write_bytes(content)
    message = _one_line_error(capsys, ["train", "examples/quickstart.yaml", f"data.train.path={path}"])
    assert message.startswith(f"{path}{expected}"), message
    assert starts == [["actor_train", "actor_infer"]]  # started while the data was read, then stopped


def test_sft_and_eval_refuse_it_too(tmp_path, capsys, starts):
    path = tmp_path / "random.jsonl"
    path.write_bytes(BINARY)
    sft = _one_line_error(capsys, ["sft", "examples/sft_tiny.yaml", "model.path=tiny", f"data.train.path={path}"])
    evaluation = _one_line_error(capsys, ["eval", "--model", "tiny", "--data", str(path)])
    assert starts == [["actor_train", "actor_infer"]]  # sft's start, stopped; eval checks before it starts
    for message in (sft, evaluation):
        assert message.startswith(f"{path}:1: not UTF-8 text") and message.endswith("a dataset is a JSONL file, "
                                                                                    "one JSON object per line")
    (tmp_path / "rows.parquet").write_bytes(ROW.encode())
    assert _one_line_error(capsys, ["eval", "--model", "tiny", "--data", str(tmp_path / "rows.parquet")]).endswith(
        "; it is JSON text (name it .jsonl)")
