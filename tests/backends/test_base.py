"""The shared backend pieces: `TrainerSettings`, the protocol, `create_backend` / `check_backend_kwargs`, and the
model / optimizer setup both backends build from."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from rollflow.backends import BACKENDS, backend_kwarg_names, check_backend_kwargs, create_backend
from rollflow.backends.base import SETTINGS_FIELDS, TrainerSettings, TrainingBackend, micro_batch_rows
from rollflow.backends.training_state import build_model, build_optimizer
from rollflow.backends.value_model import ValueModel
from rollflow.errors import ConfigError


def test_settings_hold_every_shared_constructor_field_with_its_default():
    settings = TrainerSettings("tiny")
    assert SETTINGS_FIELDS == {field.name for field in dataclasses.fields(TrainerSettings)} == {
        "model_path", "dtype", "lr", "betas", "weight_decay", "warmup_steps", "max_grad_norm", "micro_batch_size",
        "trainable", "lr_schedule", "total_steps", "trust_remote_code", "value_head", "max_response_length",
        "lora", "device", "on_nonfinite", "freeze_vision_tower"}
    assert (settings.dtype, settings.lr, settings.betas, settings.micro_batch_size, settings.trainable,
            settings.lr_schedule, settings.lora, settings.device, settings.on_nonfinite) == (
        "float32", 1e-5, (0.9, 0.999), 32, True, "constant", None, None, "stop")
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.lr = 1.0


def test_settings_reject_contradictions_and_unknown_schedules():
    with pytest.raises(ValueError, match="lora needs a trainable causal LM"):
        TrainerSettings("tiny", lora={"rank": 2}, trainable=False)
    with pytest.raises(ValueError, match="constant, cosine"):
        TrainerSettings("tiny", lr_schedule="linear")
    with pytest.raises(ValueError, match="stop, skip_step"):
        TrainerSettings("tiny", on_nonfinite="skip")


def test_base_module_imports_only_the_standard_library_and_torch():
    """Every backend and worker imports `rollflow.backends.base`; nothing heavy or upward may come with it
    (the config imports `rollflow.backends.settings`, which imports no torch: tests/config/test_without_torch.py)."""
    code = ("import sys, rollflow.backends.base\n"
            "print(sorted(m for m in sys.modules if m.startswith(('rollflow', 'transformers', 'peft', "
            "'torch.distributed.fsdp', 'safetensors'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == str(["rollflow", "rollflow.backends", "rollflow.backends.base",
                                  "rollflow.backends.settings", "rollflow.errors", "rollflow.registry"])


def test_backend_kwargs_are_the_backend_class_keywords():
    assert {"fsdp2", "sim", "torch"} <= set(BACKENDS.names())
    assert backend_kwarg_names("torch") == ["trim_micro_batches"]
    assert backend_kwarg_names("sim") == ["simulation", "payload_bytes"]  # `simulation`: the worker's cluster.sim
    assert backend_kwarg_names("fsdp2") == ["mixed_precision", "reshard_after_forward", "trim_micro_batches"]
    check_backend_kwargs("fsdp2", {"mixed_precision": {"param_dtype": "bfloat16"}, "reshard_after_forward": False})
    check_backend_kwargs("torch", {})
    check_backend_kwargs("torch", {"trim_micro_batches": False})


def test_unknown_backend_kwargs_fail_with_one_line_naming_the_valid_keys():
    with pytest.raises(ConfigError) as error:
        check_backend_kwargs("fsdp2", {"mixed_precison": {}})
    message = str(error.value)
    assert "\n" not in message
    assert "mixed_precison" in message
    assert "valid keys: mixed_precision, reshard_after_forward, trim_micro_batches" in message
    assert "did you mean 'mixed_precision'" in message
    with pytest.raises(ConfigError, match="'torch' training backend; valid keys: trim_micro_batches; rollflow "
                                          "sets lr from"):
        check_backend_kwargs("torch", {"lr": 1.0})
    with pytest.raises(ConfigError, match="unknown training backend 'fsdp'. Did you mean 'fsdp2'"):
        check_backend_kwargs("fsdp", {"mixed_precision": {}})


def test_create_backend_builds_by_name_and_checks_kwargs_before_loading(random_model_dir):
    with pytest.raises(ConfigError, match="mixed_precision"):
        create_backend("torch", TrainerSettings(random_model_dir), mixed_precision={})
    backend = create_backend("torch", TrainerSettings(random_model_dir, micro_batch_size=4))
    assert type(backend).__name__ == "TorchBackend" and isinstance(backend, TrainingBackend)
    backend.close()  # nothing to release in one process


def test_build_model_and_optimizer_follow_the_settings(random_model_dir):
    frozen = build_model(TrainerSettings(random_model_dir, trainable=False))
    assert not any(p.requires_grad for p in frozen.parameters())
    assert build_optimizer(frozen, TrainerSettings(random_model_dir, trainable=False)) == (None, None)

    settings = TrainerSettings(random_model_dir, value_head=True, lr=1e-3, betas=(0.8, 0.9), warmup_steps=4)
    critic = build_model(settings)
    assert isinstance(critic, ValueModel) and all(p.requires_grad for p in critic.parameters())
    optimizer, scheduler = build_optimizer(critic, settings)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert [p for group in optimizer.param_groups for p in group["params"]] == list(critic.parameters())
    assert optimizer.defaults["betas"] == (0.8, 0.9)
    assert scheduler.get_last_lr() == [pytest.approx(1e-3 / 4)]  # warm-up step 1 of 4


def test_offload_guard_names_the_backend_and_the_call(random_model_dir):
    from rollflow.backends.torch_backend import TorchBackend

    backend = TorchBackend(TrainerSettings(random_model_dir, trainable=False))
    backend.offload()
    assert not backend.resident
    with pytest.raises(RuntimeError, match=r"TorchBackend\.forward_logprobs called while offloaded; call onload"):
        backend.forward_logprobs(None)
    backend.onload()
    assert backend.resident


def test_micro_batches_take_rows_longest_first_or_in_order():
    lengths = torch.tensor([3, 9, 5, 9, 1])
    # longest first, ties in row order: 9 (row 1), 9 (row 3), 5 (row 2), 3 (row 0), 1 (row 4)
    assert [rows.tolist() for rows in micro_batch_rows(lengths, 2, by_length=True)] == [[1, 3], [2, 0], [4]]
    assert [rows.tolist() for rows in micro_batch_rows(lengths, 2, by_length=False)] == [[0, 1], [2, 3], [4]]
    assert micro_batch_rows(torch.zeros(0, dtype=torch.long), 2, by_length=True) == []  # an empty shard
