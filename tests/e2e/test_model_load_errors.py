"""A model that cannot be loaded is one line: a cut-short weights file through the real command line (no
worker traceback forwarded by Ray, no trailing log of the math-verify helpers that were still starting), and
weights of another shape named by weight and shapes (issue #26)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollflow.errors import ModelLoadError
from rollflow.models import BUNDLED_MODELS, load_causal_lm

QUICKSTART = ["examples/quickstart.yaml", "train.steps=2", "eval.every_steps=0"]


def _run(tmp_path, model) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollflow.cli", "train", *QUICKSTART, f"model.path={model}",
                           f"output.dir={tmp_path / 'runs'}"], capture_output=True, text=True, timeout=300)


def _copy_of_tiny(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(BUNDLED_MODELS["tiny"], model)
    return model


def test_a_truncated_safetensors_file_is_named_by_the_driver(tmp_path):
    model = _copy_of_tiny(tmp_path)
    weights = model / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as file:
        file.truncate(size // 2)
    result = _run(tmp_path, model)
    assert result.returncode == 2, result.stderr
    # was: Ray's 26-line creation-task traceback from the worker, the worker's error, then a CancelledError log
    assert result.stderr.splitlines() == [
        f"rollflow: error: model file {weights} is cut short: it has {size // 2} bytes, its header describes "
        f"{size}; copy or download it again"]


def test_weights_of_another_shape_name_the_weight_and_both_shapes(tmp_path):
    """Weights whole, but of the wrong shape: the driver's checks pass, the worker's load fails; transformers
    puts the shapes in a logged report and says only "look at the above report"."""
    model = _copy_of_tiny(tmp_path)
    weights = load_file(model / "model.safetensors")
    name = next(name for name in weights if "embed_tokens" in name)
    weights[name] = torch.zeros(3, 5)
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as error:
        load_causal_lm(str(model))
    assert str(error.value) == (f"cannot load model from '{model}': weight model.embed_tokens.weight has shape "
                                "[3, 5] in model.safetensors, but the model config.json describes has [262, 128]")
