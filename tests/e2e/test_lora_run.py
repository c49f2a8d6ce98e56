"""The command line with LoRA: the tiny model learns through adapters, and the checkpoint loads with PEFT alone.
The run is the command line's `main` in this process (the `cli` fixture); that a `rollflow train` process
starts its own Ray ahead and its trainer takes over the warm worker is checked on the quickstart's run
(tests/e2e/test_train_runs.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rollflow.models import resolve_model_path

pytestmark = pytest.mark.slow


def _logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=input_ids).logits  # [B, L, V]


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_run_learns_and_its_checkpoint_loads_with_peft(tmp_path, cli):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    # a KL term makes the trainer ask actor_train for reference logprobs: its base model, adapters off
    result = cli("train", "examples/lora.yaml", "train.steps=10", "train.lr_schedule=constant",
                 "eval.every_steps=10", "data.eval.limit=200", "algorithm.kl_loss_coef=0.01",
                 "output.trackers=[jsonl]", "name=lora", f"output.dir={tmp_path}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
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
