"""`torch` training backend: one process, plain PyTorch, micro-batching with gradient accumulation.

The loss function is passed in (compose, don't inherit): `loss_fn(logits, micro_batch, normalizer) ->
(loss, metrics)`, where `loss` is the micro-batch's contribution to the global loss (see
`rollflow.algorithms.aggregation`), so the accumulated gradient does not depend on the micro-batch size.
With `value_head=True` the model is a `ValueModel` (the critic) and the loss function receives [b, T]
values instead of [b, T, V] logits. With `lora=...` the causal LM is wrapped with PEFT LoRA adapters (see
`rollflow.backends.lora`): only the adapters train, the base model with adapters disabled is the reference
policy, and weights leave the trainer merged, under the plain model's names.
"""

from __future__ import annotations

import functools
import json
import math
import random
from collections.abc import Callable
from pathlib import Path

import torch

from rollflow.algorithms import LossNormalizer, loss_normalizer
from rollflow.backends import lora as lora_adapters
from rollflow.backends.logprobs import model_logits, response_tokens, token_logprobs
from rollflow.backends.value_model import ValueModel, response_values
from rollflow.data.sample import Batch
from rollflow.models import load_causal_lm, load_tokenizer

LossFn = Callable[[torch.Tensor, Batch, LossNormalizer], tuple[torch.Tensor, dict[str, float]]]


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """LR factor at optimizer step `step` (0-based): linear warm-up, then constant or cosine to 0."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def move_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                        device: torch.device | str) -> None:
    """Move a model's parameters and its optimizer's state tensors (Adam moments) to `device`."""
    model.to(device)  # an FSDP2 module re-registers its sharded parameters after the move
    for state in (optimizer.state.values() if optimizer is not None else []):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.to(device, non_blocking=True)


class TorchBackend:
    """Holds the model, optimizer and LR schedule of one training worker.

    Args:
        model_path: bundled name, local HF directory or hub id.
        dtype: parameter dtype ("float32" on CPU).
        lr, betas, weight_decay: AdamW settings.
        warmup_steps: linear LR warm-up over this many optimizer steps.
        lr_schedule: after warm-up, "constant" or "cosine" (to 0 at `total_steps`).
        total_steps: optimizer steps in the run (for the cosine schedule).
        max_grad_norm: gradient clipping.
        micro_batch_size: samples per forward/backward.
        trainable: False for a frozen reference model (no optimizer).
        value_head: hold a `ValueModel` (backbone + scalar head) instead of the causal LM, for a critic.
        max_response_length: the constant L of `seq_mean_token_sum_norm` (the generation limit); None uses
            each batch's padded response width.
        lora: `rollflow.config.LoraConfig` fields (rank, alpha, dropout, target_modules) to train LoRA
            adapters instead of all weights; None trains every weight.
        device: "cpu", "cuda" (the current CUDA device), or None for CUDA when available. Inputs move to it
            per micro-batch; results come back on CPU.
    """

    def __init__(self, model_path: str, dtype: str = "float32", lr: float = 1e-5,
                 betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0, warmup_steps: int = 0,
                 max_grad_norm: float = 1.0, micro_batch_size: int = 32, trainable: bool = True,
                 lr_schedule: str = "constant", total_steps: int = 0,
                 trust_remote_code: bool = False, value_head: bool = False,
                 max_response_length: int | None = None, lora: dict | None = None, device: str | None = None):
        if lora is not None and (value_head or not trainable):
            raise ValueError("lora needs a trainable causal LM (not value_head=True or trainable=False)")
        self.value_head = value_head
        self.lora = lora
        if value_head:
            self.model = ValueModel.from_pretrained(model_path, dtype, trust_remote_code)
        else:
            self.model = load_causal_lm(model_path, dtype, trust_remote_code)
        if lora is not None:
            self.model = lora_adapters.wrap_with_lora(self.model, lora)  # freezes the base weights
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model.to(self.device)
        self.resident = True
        self.forward = response_values if value_head else model_logits  # [b, T] values or [b, T, V] logits
        self.tokenizer = load_tokenizer(model_path, trust_remote_code)
        self.micro_batch_size = micro_batch_size
        self.max_response_length = max_response_length
        self.max_grad_norm = max_grad_norm
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        # only what trains goes to the optimizer and the clipping (all weights, or just the LoRA adapters)
        self.trainable_parameters = [p for p in self.model.parameters() if p.requires_grad]
        if trainable:
            self.optimizer = torch.optim.AdamW(self.trainable_parameters, lr=lr, betas=betas,
                                               weight_decay=weight_decay)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, functools.partial(lr_multiplier, warmup_steps=warmup_steps,
                                                  total_steps=total_steps, schedule=lr_schedule))
        else:
            self.model.requires_grad_(False)

    def _micro_batches(self, batch: Batch):
        if not self.resident:
            raise RuntimeError("TorchBackend used while offloaded; call onload() first")
        for start in range(0, batch.size, self.micro_batch_size):
            yield batch.select(slice(start, start + self.micro_batch_size)).to(self.device)

    @torch.no_grad()
    def forward_logprobs(self, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        """Logprobs of the batch's response tokens. Returns [B, T] (0 where padded)."""
        self.model.eval()
        parts = []
        for micro in self._micro_batches(batch):
            logits = model_logits(self.model, micro)  # [b, T, V]
            parts.append(token_logprobs(logits, response_tokens(micro), temperature) * (micro.attention_mask[
                :, micro.prompt_length:] > 0))
        return torch.cat(parts).cpu()

    def forward_reference_logprobs(self, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        """Logprobs under the reference policy: the base model with the LoRA adapters disabled (no second
        copy of the model). Returns [B, T] (0 where padded).
        """
        if self.lora is None:
            raise RuntimeError("forward_reference_logprobs needs lora: without adapters the trained weights "
                               "are the policy, so the reference is a separate frozen model")
        with self.model.disable_adapter():
            return self.forward_logprobs(batch, temperature)

    @torch.no_grad()
    def forward_values(self, batch: Batch) -> torch.Tensor:
        """Values of the batch's response tokens (value head only). Returns [B, T] (0 where padded)."""
        assert self.value_head, "forward_values needs value_head=True"
        self.model.eval()
        parts = [response_values(self.model, micro) * (micro.attention_mask[:, micro.prompt_length:] > 0)
                 for micro in self._micro_batches(batch)]
        return torch.cat(parts).cpu()

    def train_step(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on `batch` (all micro-batches accumulated). Returns averaged metrics."""
        assert self.optimizer is not None, "train_step on a frozen backend"
        self.model.train()
        normalizer = loss_normalizer(batch.response_mask, self.max_response_length)
        total_tokens = max(float(batch.response_mask.sum()), 1.0)
        sums: dict[str, float] = {}
        total_loss = 0.0
        for micro in self._micro_batches(batch):
            outputs = self.forward(self.model, micro)  # [b, T, V] logits, or [b, T] values
            loss, metrics = loss_fn(outputs, micro, normalizer)
            loss.backward()
            total_loss += float(loss.detach())
            weight = float(micro.response_mask.sum()) / total_tokens  # token-weighted metric average
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value) * weight
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable_parameters, self.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {**sums, "loss": total_loss, "grad_norm": float(grad_norm),
                "lr": self.scheduler.get_last_lr()[0]}

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Parameters by name, detached on CPU (tied weights appear once), for weight sync.

        With LoRA: the merged weights under the plain HF model's parameter names and shapes.
        """
        if self.lora is not None:
            weights = lora_adapters.merged_named_parameters(self.model)
        else:
            weights = {name: p.detach() for name, p in self.model.named_parameters()}
        return {name: tensor.to("cpu").contiguous() for name, tensor in weights.items()}

    def offload(self) -> None:
        """Move weights and optimizer state to host memory between phases (on CPU nothing moves); until
        `onload()`, forward and training calls raise RuntimeError."""
        if self.device.type == "cuda":
            move_training_state(self.model, self.optimizer, torch.device("cpu"))
            torch.cuda.empty_cache()
        self.resident = False

    def onload(self) -> None:
        """Bring weights and optimizer state back to the device."""
        if self.device.type == "cuda":
            move_training_state(self.model, self.optimizer, self.device)
        self.resident = True

    def save(self, path: str | Path) -> None:
        """Model + tokenizer in HF format under `path` (a value model: `value_model.safetensors`), optimizer /
        scheduler / RNG in `trainer_state.pt`. With LoRA, `path` holds the adapters in PEFT format and
        `path/merged` the merged model in HF format."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self.lora is not None:
            lora_adapters.save_lora(self.model, path, self.tokenizer)
        elif self.value_head:
            self.model.save(path)
        else:
            self.model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)
        state = {
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }
        torch.save(state, path / "trainer_state.pt")
        (path / "rollflow_checkpoint.json").write_text(json.dumps({"format": 1, "lora": self.lora is not None}))

    def load(self, path: str | Path) -> None:
        """Restore what `save` wrote (weights or LoRA adapters, optimizer, scheduler, RNG)."""
        path = Path(path)
        if self.lora is not None:
            lora_adapters.load_lora(self.model, path)
        elif self.value_head:
            self.model.load(path)
        else:
            dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
            self.model.load_state_dict(load_causal_lm(str(path), dtype=dtype).state_dict())
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        if self.optimizer and state["optimizer"]:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler and state["scheduler"]:
            self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
