"""The real CLI with LoRA: the tiny model learns through adapters, and the checkpoint loads with PEFT alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollflow.models import resolve_model_path

pytestmark = pytest.mark.slow


def _train(*overrides: str) -> None:
    result = subprocess.run([sys.executable, "-m", "rollflow.cli", "train", "examples/lora.yaml", *overrides],
                            capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=input_ids).logits  # [B, L, V]


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_run_learns_and_its_checkpoint_loads_with_peft(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    # a KL term makes the trainer ask actor_train for reference logprobs: its base model, adapters off
    _train("train.steps=10", "train.lr_schedule=constant", "eval.every_steps=10", "data.eval.limit=200",
           "algorithm.kl_loss_coef=0.01", "output.trackers=[jsonl]", "name=lora", f"output.dir={tmp_path}")
    # as a user runs it: the command line's own Ray, its warm worker taken over by the trainer
    events = json.loads((tmp_path / "lora" / "timeline.json").read_text())["traceEvents"]
    lanes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    (ray_start,) = [e for e in events if e["name"] == "start ray"]
    assert ray_start["args"] == {"how": "prestarted"}
    assert [lanes[e["pid"]] for e in events if e["name"] == "warm up"] == ["actor_train 0"]
    rows = [json.loads(line) for line in (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()]
    initial, final = rows[0]["eval/accuracy"], rows[-1]["eval/accuracy"]
    assert final >= initial + 0.10, (initial, final)
    # LoRA's B starts at 0, so policy == reference until the first update; then the adapters move it
    assert rows[1]["actor/kl"] == pytest.approx(0.0, abs=1e-6)
    assert rows[-1]["actor/kl"] > 1e-6

    checkpoint = tmp_path / "lora" / "checkpoints" / "step_10" / "model"
    adapter_config = json.loads((checkpoint / "adapter_config.json").read_text())
    assert adapter_config["r"] == 16 and adapter_config["peft_type"] == "LORA"
    base_dir = resolve_model_path("tiny")
    with_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), checkpoint)
    merged = AutoModelForCausalLM.from_pretrained(checkpoint / "merged")
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    input_ids = torch.tensor([[5, 20, 21, 8, 22, 23, 9]])  # any tokens of the 91-token char vocabulary
    expected = _logits(with_peft, input_ids)
    assert torch.allclose(_logits(merged, input_ids), expected, atol=1e-4)
    assert (_logits(base, input_ids) - expected).abs().max() > 1e-3  # training moved the adapters
    assert Path(checkpoint / "merged" / "tokenizer_config.json").is_file()
