"""`check_safetensors_file`: the driver reads a safetensors file's header (8-byte length, JSON table of
tensors) and refuses a file shorter than the header says, so a copy or download cut short is one line naming
the file instead of every worker failing to load it."""

from __future__ import annotations

import json
import shutil

import pytest

from rollflow.errors import ModelLoadError
from rollflow.models import BUNDLED_MODELS, check_model_files, check_safetensors_file

TINY = BUNDLED_MODELS["tiny"]


def _write(path, header: dict, data_bytes: int) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + bytes(data_bytes))


def test_the_bundled_model_is_whole():
    check_safetensors_file(TINY / "model.safetensors")
    assert check_model_files("tiny") == str(TINY)


def test_a_model_file_cut_in_half_is_named(tmp_path):
    model = tmp_path / "m"
    shutil.copytree(TINY, model)
    weights = model / "model.safetensors"
    size = weights.stat().st_size  # 4080256: 8 + a 5240-byte header + 4075008 bytes of tensors
    with weights.open("r+b") as file:
        file.truncate(size // 2)
    with pytest.raises(ModelLoadError) as error:
        check_model_files(str(model))
    assert str(error.value) == (f"model file {weights} is cut short: it has {size // 2} bytes, its header describes "
                                f"{size}; copy or download it again")


@pytest.mark.parametrize("content, message", [
    (b"", "is not a safetensors file (0 bytes, no header)"),
    (b"\x01\x02", "is not a safetensors file (2 bytes, no header)"),
    ((1000).to_bytes(8, "little") + b"{}", "is cut short: it has 10 bytes, its header alone needs 1008"),
    ((2**40).to_bytes(8, "little") + b"{}", "is not a safetensors file (10 bytes, no header)"),
    ((4).to_bytes(8, "little") + b"PK\x03\x04", "is not a safetensors file (its header is not the JSON table"),
    ((2).to_bytes(8, "little") + b"[]", "is not a safetensors file (its header is not the JSON table"),
])
def test_what_is_not_a_safetensors_file(tmp_path, content, message):
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match=f"^model file {path} " + message.replace("(", r"\(").replace(")", r"\)")):
        check_safetensors_file(path)


def test_a_whole_file_or_one_without_tensors_passes(tmp_path):
    path = tmp_path / "model.safetensors"
    _write(path, {"__metadata__": {"format": "pt"}}, 0)
    check_safetensors_file(path)
    _write(path, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 8)
    check_safetensors_file(path)
    _write(path, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 7)
    with pytest.raises(ModelLoadError, match="it has 76 bytes, its header describes 77"):
        check_safetensors_file(path)
