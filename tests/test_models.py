"""Model path resolution: bundled names, HF directories, LoRA checkpoints, hub ids, clear errors."""

import pytest

from rollflow.errors import ModelLoadError
from rollflow.models import resolve_model_path


def test_lora_checkpoint_resolves_to_its_merged_model(tmp_path):
    (tmp_path / "merged").mkdir()
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "merged" / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path / "merged")
    (tmp_path / "config.json").write_text("{}")  # adapters beside a full model: still the merged one
    assert resolve_model_path(str(tmp_path)) == str(tmp_path / "merged")


def test_directory_without_config_and_missing_path_fail_clearly(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))
    assert resolve_model_path("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert resolve_model_path("tiny").endswith("tiny-qwen2-add")
