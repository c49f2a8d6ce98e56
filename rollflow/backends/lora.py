"""LoRA through PEFT, shared by the training backends: wrap a causal LM, export merged weights, save / load.

The trained model is a `peft.PeftModel`: the base weights stay frozen and only the adapter matrices train.
Everything that leaves the trainer — weights for the inference engines, the merged checkpoint — is a plain
HF state dict under the base model's own parameter names, with `W + scale * B @ A` computed per LoRA layer
into new tensors. The live model is never merged in place, so an in-place merge / unmerge round trip cannot
drift the frozen base weights by float rounding step after step.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from rollflow.backends.lora_config import LoraConfig

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
MERGED_DIR = "merged"


def wrap_with_lora(model: torch.nn.Module, lora: dict[str, Any] | LoraConfig) -> torch.nn.Module:
    """Inject LoRA adapters into `model` (in place) and freeze everything else.

    Args:
        model: an HF causal LM.
        lora: `LoraConfig` fields (rank, alpha, dropout, target_modules); a dict is validated
            against that schema, so a misspelled key is an error that names it.

    Returns:
        The `peft.PeftModel` wrapping `model`; its only trainable parameters are the adapters.
    """
    import peft

    settings = lora if isinstance(lora, LoraConfig) else LoraConfig.model_validate(lora)
    from rollflow.models import VISION_MODULES

    # A vision-language model's adapters go on its language model only; its vision tower trains in full or
    # not at all (`TrainerSettings.freeze_vision_tower`).
    vision = any(name.split(".")[-1] in VISION_MODULES for name, _ in model.named_modules())
    peft_config = peft.LoraConfig(
        r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
        target_modules=settings.target_modules, bias="none", task_type="CAUSAL_LM",
        exclude_modules=r"(.*\.)?(" + "|".join(sorted(VISION_MODULES)) + r")(\..*)?" if vision else None,
    )
    with warnings.catch_warnings():
        # peft 0.21 reads a transformers attribute deprecated in 5.x; nothing for a user to act on
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        return peft.get_peft_model(model, peft_config)


def _lora_layers(peft_model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """LoRA layers by module name inside the wrapped HF model (the names the un-wrapped model uses)."""
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in peft_model.base_model.model.named_modules()
            if isinstance(module, LoraLayer)}


def _original_name(peft_name: str, lora_layers: dict[str, torch.nn.Module]) -> str | None:
    """The un-wrapped model's name of a tensor of the wrapped model, or None for an adapter tensor.

    A LoRA layer `m` holds the original module as `m.base_layer` next to its adapters (`m.lora_A...`), so
    `m.base_layer.weight` is `m.weight` of the original model and everything else under `m` is adapter-only.
    Matching module names (not substrings) keeps a model whose own modules contain "lora" or "base_layer".
    """
    parts = peft_name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:cut]) in lora_layers:
            if parts[cut] != "base_layer":
                return None
            return ".".join(parts[:cut] + parts[cut + 1:])
    return peft_name


def _merged_weight(layer: torch.nn.Module) -> torch.Tensor:
    """`W + sum over active adapters of scale * B @ A` as a new tensor, in W's dtype."""
    weight = layer.get_base_layer().weight.detach()
    if layer.merged:  # someone merged in place: W already holds the deltas
        return weight.clone()
    merged = weight.float()
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A:
            merged = merged + layer.get_delta_weight(adapter).detach().float()
    return merged.to(weight.dtype)


@torch.no_grad()
def merged_state_dict(peft_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict the un-wrapped model would have with the adapters merged into its weights.

    Keys and shapes are exactly the plain HF model's `state_dict()` (tied weights under each of their names);
    LoRA layers' weights are new tensors, every other value is the live (frozen) tensor, detached.
    """
    layers = _lora_layers(peft_model)
    state: dict[str, torch.Tensor] = {}
    for peft_name, tensor in peft_model.base_model.model.state_dict().items():
        name = _original_name(peft_name, layers)
        if name is not None:
            state[name] = tensor.detach()
    for module_name, layer in layers.items():
        key = f"{module_name}.weight"
        assert key in state, f"LoRA layer {module_name} has no weight {key} in the base state dict"
        state[key] = _merged_weight(layer)
    return state


def merged_named_parameters(peft_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Merged weights under the un-wrapped model's `named_parameters()` names (tied weights appear once).

    These are what an inference engine holding the plain HF model copies into its parameters.
    """
    layers = _lora_layers(peft_model)
    names = [_original_name(name, layers) for name, _ in peft_model.base_model.model.named_parameters()]
    state = merged_state_dict(peft_model)
    return {name: state[name] for name in names if name is not None}


def merged_model(peft_model: torch.nn.Module) -> torch.nn.Module:
    """A plain HF model (no PEFT) holding the merged weights, for `save_pretrained`.

    Built on the meta device and filled by assignment, so it shares the frozen tensors instead of copying
    the whole model; only the LoRA layers' merged weights are new memory.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from rollflow.models import is_vision_language

    base = peft_model.get_base_model()
    auto = AutoModelForImageTextToText if is_vision_language(base.config) else AutoModelForCausalLM
    with torch.device("meta"):
        plain = auto.from_config(base.config, dtype=base.dtype)
    plain.load_state_dict(merged_state_dict(peft_model), strict=True, assign=True)
    plain.generation_config = base.generation_config
    return plain.eval()


def save_lora(peft_model: torch.nn.Module, path: str | Path, tokenizer=None) -> None:
    """Adapters in PEFT format under `path`, the merged model in HF format under `path/merged`.

    `peft.PeftModel.from_pretrained(base_model, path)` restores the adapters; `path/merged` loads with
    `AutoModelForCausalLM.from_pretrained` alone, for eval and serving without PEFT.
    """
    path = Path(path)
    peft_model.save_pretrained(path, safe_serialization=True)
    merged_model(peft_model).save_pretrained(path / MERGED_DIR, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path / MERGED_DIR)


@torch.no_grad()
def load_lora(peft_model: torch.nn.Module, path: str | Path) -> None:
    """Restore the adapter weights `save_lora` wrote under `path` into `peft_model` (same LoRA settings).

    Raises:
        ValueError: the checkpoint's adapters do not match the model's (another rank or target modules).
    """
    from peft import load_peft_weights, set_peft_model_state_dict

    weights = load_peft_weights(str(path), device="cpu")
    expected = {name for name, param in peft_model.named_parameters() if param.requires_grad}  # adapters
    result = set_peft_model_state_dict(peft_model, weights)
    missing = sorted(name for name in expected if name in set(result.missing_keys))
    if result.unexpected_keys or missing or len(weights) != len(expected):
        raise ValueError(f"LoRA checkpoint {path} does not match the model's adapters: "
                         f"{len(weights)} tensors for {len(expected)} adapter parameters, "
                         f"unexpected {sorted(result.unexpected_keys)[:3]}, missing {missing[:3]}")
