"""Loading models and tokenizers: the bundled tiny model, a local HF directory, or a hub id.

All three go through `AutoModelForCausalLM` / `AutoTokenizer`, so the code path that loads the bundled
model is the one that loads a real model.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

import torch

from rollflow.errors import ModelLoadError

BUNDLED_MODELS = {"tiny": Path(__file__).parent / "assets" / "tiny-qwen2-add",
                  "tiny-vl": Path(__file__).parent / "assets" / "tiny-qwen2vl-count"}  # count_shapes, ~40%
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A loadable model directory holds weights and a tokenizer; these are the files that count as each.
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt", "*.tiktoken")
HUB_PROBE_TIMEOUT_S = 3.0
SAFETENSORS_MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library refuses a longer header


def resolve_model_path(path: str) -> str:
    """Map a bundled name (`tiny`) to its directory, check a local directory (a LoRA checkpoint resolves to
    its `merged/` model), or pass a hub id through."""
    if "\x00" in path:
        raise ModelLoadError(f"model path {path!r} contains a NUL character")
    if path in BUNDLED_MODELS:
        if not (BUNDLED_MODELS[path] / "config.json").is_file():
            raise ModelLoadError(f"bundled model {path!r} is missing from {BUNDLED_MODELS[path]}; "
                                 "rebuild it with `rollflow build-tiny-model`")
        return str(BUNDLED_MODELS[path])
    expanded = Path(path).expanduser()
    if expanded.exists():
        if (expanded / "adapter_config.json").is_file() and (expanded / "merged" / "config.json").is_file():
            return str(expanded / "merged")  # a LoRA checkpoint: its merged full model serves as the model
        if not (expanded / "config.json").is_file():
            raise ModelLoadError(f"model path {path!r} is not a Hugging Face model directory (no config.json)")
        return str(expanded)
    if path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise ModelLoadError(f"model path {path!r} does not exist")
    return path  # a hub id like "Qwen/Qwen2.5-0.5B"; transformers resolves it (its cache when offline)


def check_model_files(path: str) -> str:
    """What the driver checks of a model before a run's first step: a local directory has weights and a
    tokenizer, and each of its safetensors files is whole (`check_safetensors_file`); a hub id is in the local Hugging Face cache or the hub answers (transformers would otherwise
    retry for ~50 s, printing each retry, before failing).

    Args:
        path: bundled name, local directory (or LoRA checkpoint) or hub id, as in `model.path`.

    Returns:
        The resolved path (see `resolve_model_path`).

    Raises:
        ModelLoadError: one line naming what is missing.
    """
    resolved = resolve_model_path(path)
    directory = Path(resolved)
    if directory.is_dir():
        if not _has_any(directory, WEIGHT_FILES):
            raise ModelLoadError(f"model directory {directory} has no weights (no *.safetensors, *.bin or their "
                                 "index files); save the model there with save_pretrained")
        if not _has_any(directory, TOKENIZER_FILES):
            raise ModelLoadError(f"model directory {directory} has no tokenizer (no tokenizer.json, "
                                 "tokenizer_config.json or vocabulary file); save it there with "
                                 "tokenizer.save_pretrained")
        for weights in sorted(directory.glob("*.safetensors")):
            check_safetensors_file(weights)
        return resolved
    _check_hub_model(resolved)
    return resolved


def check_safetensors_file(path: Path) -> None:
    """A safetensors file is whole: an 8-byte little-endian header length, a JSON header that fits in the file,
    and every byte the header's tensors span (`data_offsets`, counted from the header's end). Reads the header
    only, so a copy or download cut short is named here, on the driver, instead of failing in every worker.

    Raises:
        ModelLoadError: one line naming the file and what is wrong with it.
    """
    try:
        size = path.stat().st_size
        file = path.open("rb")
    except OSError as err:
        raise ModelLoadError(f"cannot read model file {path}: {err.strerror or err}") from None
    with file:
        prefix = file.read(8)
        header_size = int.from_bytes(prefix, "little")
        if len(prefix) < 8 or header_size > SAFETENSORS_MAX_HEADER_BYTES:
            raise ModelLoadError(f"model file {path} is not a safetensors file ({size} bytes, no header); copy or "
                                 "download it again")
        if 8 + header_size > size:
            raise ModelLoadError(f"model file {path} is cut short: it has {size} bytes, its header alone needs "
                                 f"{8 + header_size}; copy or download it again")
        try:
            header = json.loads(file.read(header_size))
            ends = [int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            raise ModelLoadError(f"model file {path} is not a safetensors file (its header is not the JSON "
                                 "table of tensors); copy or download it again") from None
    expected = 8 + header_size + max(ends, default=0)
    if size < expected:
        raise ModelLoadError(f"model file {path} is cut short: it has {size} bytes, its header describes "
                             f"{expected}; copy or download it again")


def _has_any(directory: Path, patterns: tuple[str, ...]) -> bool:
    return any(next(directory.glob(pattern), None) is not None for pattern in patterns)


def _check_hub_model(repo_id: str) -> None:
    """A hub id must be cached locally, or the hub reachable (checked in a few seconds, not retried)."""
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ModelLoadError(f"model path {repo_id!r} is neither a local directory nor a valid hub id "
                             f"({_first_line(err)})") from None
    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return  # cached: transformers loads it without the network
    where = f"not a local directory and not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    if constants.HF_HUB_OFFLINE or os.environ.get("TRANSFORMERS_OFFLINE", "0").lower() in ("1", "true", "yes"):
        raise ModelLoadError(f"model {repo_id!r} is {where}, and HF_HUB_OFFLINE is set; download it first or "
                             "give a local directory")
    endpoint = urlparse(constants.ENDPOINT)
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    if not _reachable(host, port, HUB_PROBE_TIMEOUT_S):
        raise ModelLoadError(f"model {repo_id!r} is {where}, and the hub ({host}) cannot be reached; download "
                             "it first (`huggingface-cli download`) or give a local directory")


def _reachable(host: str, port: int, timeout_s: float) -> bool:
    """Whether a TCP connection to host:port opens within `timeout_s`, name lookup included (in a daemon
    thread: a lookup can hang past any socket timeout)."""
    outcome: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            outcome.append(True)
        except OSError:
            outcome.append(False)

    thread = threading.Thread(target=probe, name="rollflow-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(outcome and outcome[0])


def load_model_config(path: str, trust_remote_code: bool = False):
    """The model's `transformers` config (context length, vocabulary size, ...) without loading weights.

    Raises:
        ModelLoadError: the config cannot be read (one line).
    """
    from transformers import AutoConfig

    _quiet_transformers()
    resolved = resolve_model_path(path)
    try:
        return AutoConfig.from_pretrained(resolved, trust_remote_code=trust_remote_code)
    except Exception as err:  # transformers raises many types (OSError, ValueError, KeyError for unknown types)
        raise ModelLoadError(f"cannot read the model config of {path!r}: {_first_line(err)}") from None


def preload_model_code(path: str, trust_remote_code: bool = False) -> None:
    """Import the modeling code of the model at `path` now, without building it.

    transformers' modeling imports take seconds of CPU on a small machine. A trainer worker builds its model
    only after its ranks have met (`init_backend`); calling this in its constructor moves the imports to where
    every worker's constructor runs concurrently. Best effort: a failure here is left for the real load to
    report.
    """
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        MODEL_FOR_CAUSAL_LM_MAPPING[type(load_model_config(path, trust_remote_code))]
    except Exception:  # noqa: BLE001 - remote code, unknown architectures, ...: the load says what is wrong
        pass


def _quiet_transformers() -> None:
    """No per-load progress bars or advisory warnings in worker logs."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """Load the tokenizer at `path` (bundled name, directory or hub id); pad token defaults to EOS."""
    from transformers import AutoTokenizer

    _quiet_transformers()
    resolved = resolve_model_path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolved, trust_remote_code=trust_remote_code)
    except Exception as err:  # transformers raises many types (OSError, ValueError, HTTP errors)
        raise ModelLoadError(f"cannot load tokenizer from {path!r}: {_first_line(err)}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(path: str, dtype: str = "float32", trust_remote_code: bool = False) -> torch.nn.Module:
    """Load a causal LM for training or inference (eval mode; the caller switches to train): a text model
    through `AutoModelForCausalLM`, a vision-language one (Qwen2-VL, ...) through
    `AutoModelForImageTextToText`; both take token ids and give next-token logits."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    _quiet_transformers()
    resolved = resolve_model_path(path)
    try:
        config = AutoConfig.from_pretrained(resolved, trust_remote_code=trust_remote_code)
        auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
        model = auto.from_pretrained(resolved, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    except Exception as err:
        reason = _first_line(err)
        if "ignore_mismatched_sizes" in reason:  # the shapes are in a report transformers logged, not the error
            reason = _mismatched_weight(resolved, trust_remote_code) or reason
        raise ModelLoadError(f"cannot load model from {path!r}: {reason}") from None
    return model.eval()


def _mismatched_weight(resolved: str, trust_remote_code: bool) -> str | None:
    """The first weight of the checkpoint whose shape is not the one `config.json`'s model has, said in words;
    None when none is found (or the comparison itself fails)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(resolved, trust_remote_code=trust_remote_code)
        with torch.device("meta"):  # shapes only: no memory
            expected = {name: list(tensor.shape) for name, tensor in
                        AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
                        .state_dict().items()}
        for file in sorted(Path(resolved).glob("*.safetensors")):
            with safe_open(str(file), "pt") as weights:
                for name in weights.keys():
                    shape = list(weights.get_slice(name).get_shape())
                    if name in expected and expected[name] != shape:
                        return (f"weight {name} has shape {shape} in {file.name}, but the model config.json "
                                f"describes has {expected[name]}")
    except Exception:  # noqa: BLE001  (only a better message was at stake)
        return None
    return None


def eos_token_ids(model: torch.nn.Module, tokenizer=None) -> list[int]:
    """All EOS ids: the generation config's (int or list) plus the tokenizer's."""
    ids: set[int] = set()
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif generation_eos:
        ids.update(generation_eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    config_eos = getattr(model.config, "eos_token_id", None)
    if isinstance(config_eos, int):
        ids.add(config_eos)
    return sorted(ids)


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]


CPU_ATTENTION = "rollflow_cpu"  # the attention implementation `use_cpu_attention` switches a model to
SHORT_KEYS = 32  # at most this many keys, a multi-token query runs as matmul-softmax-matmul too (see below)


def cpu_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs) -> tuple[torch.Tensor, None]:
    """Attention as matmul, softmax, matmul where that beats torch's sdpa on CPU; anything else goes to sdpa.

    On CPU, `scaled_dot_product_attention` is built for long sequences: one query token (decode) runs ~1.5-2x
    slower than these three ops, and so does a training or prefill pass over short rows (the bundled model's
    ~12-token sums: the model's whole forward and backward ~15% slower). From ~48 keys on, sdpa wins.

    Args:
        query: [B, H, Q, D]; key, value: [B, KV, L, D] (H a multiple of KV: grouped-query attention; the last
            Q of the L positions are the queries').
        attention_mask: None (causal when Q > 1 and the module is causal) or transformers' sdpa mask, bool
            [B, 1, Q, L] (True: attend).

    Returns:
        ([B, Q, H, D] attention output, None), the attention-interface convention.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, queries, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    plain = ((queries == 1 or length <= SHORT_KEYS) and not dropout and kwargs.get("softcap") is None
             and kwargs.get("s_aux") is None and heads % kv_heads == 0
             and (attention_mask is None or (attention_mask.dtype == torch.bool and attention_mask.shape[1] == 1)))
    if not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    groups = heads // kv_heads
    # query head h attends with key head h // groups (transformers' repeat_kv): no copies of keys or values
    grouped = query.reshape(batch, kv_heads, groups * queries, dim)  # [B, KV, G*Q, D]
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float()  # [B, KV, G*Q, L]
    scores = scores.view(batch, kv_heads, groups, queries, length) * (scaling if scaling is not None else dim ** -0.5)
    if attention_mask is None and queries > 1 and kwargs.get("is_causal", getattr(module, "is_causal", True)):
        positions = torch.arange(length, device=query.device)
        attention_mask = (positions[None, :] <= positions[length - queries:, None]).view(1, 1, queries, length)
    if attention_mask is not None:
        mask = attention_mask.unsqueeze(2)  # [B or 1, 1, 1, Q, L]
        # the dtype's lowest value, not -inf: a padding query with no key to attend stays finite (its output
        # is never used; a NaN there would still reach the gradients through 0 * NaN)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1).to(value.dtype)  # [B, KV, G, Q, L]
    output = torch.matmul(probs.view(batch, kv_heads, groups * queries, length), value)  # [B, KV, G*Q, D]
    return output.view(batch, heads, queries, dim).transpose(1, 2), None


def use_cpu_attention(model: torch.nn.Module) -> None:
    """Switch a model that uses sdpa to `cpu_attention` (a model with its own attention keeps it). For models
    on CPU: on a GPU, sdpa's kernels win at every length."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if CPU_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(CPU_ATTENTION, cpu_attention)
        AttentionMaskInterface.register(CPU_ATTENTION, sdpa_mask)  # the same masks as sdpa
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(CPU_ATTENTION)


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword `model.forward` takes its KV cache by: `cache` (transformers >= 5.20) or
    `past_key_values` (earlier, and models with their own code). A model given the wrong one ignores it
    silently and decodes every token without its context."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# Module names under which vision-language models keep their image encoder and its projection (Qwen2-VL's
# family: `visual`; LLaVA's: `vision_tower`, `multi_modal_projector`; others: `vision_model`).
VISION_MODULES = frozenset({"visual", "vision_tower", "vision_model", "multi_modal_projector"})


def is_vision_weight(name: str) -> bool:
    """Whether a parameter name is a vision tower's (a module named in `VISION_MODULES` on its path)."""
    return not VISION_MODULES.isdisjoint(name.split("."))


def is_vision_language(config) -> bool:
    """Whether a model config is a vision-language model's (transformers loads it as image-text-to-text and
    not as a causal LM: Qwen2-VL, Qwen2.5-VL, ...)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", None)
    return model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def uses_mrope(model: torch.nn.Module) -> bool:
    """Whether the model places tokens by multimodal rotary positions (`get_rope_index`: Qwen2-VL's family),
    so its inputs need `vision_inputs`' three-axis positions, image or not."""
    return _rope_index_owner(model) is not None


def _rope_index_owner(model: torch.nn.Module):
    """The submodule that has `get_rope_index` (under PEFT or FSDP wrappers too), or None; looked up once."""
    if not hasattr(model, "_rollflow_rope_owner"):
        owner = next((module for module in model.modules() if callable(getattr(module, "get_rope_index", None))),
                     None)
        object.__setattr__(model, "_rollflow_rope_owner", owner)
    return model._rollflow_rope_owner


def vision_inputs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  vision: tuple[torch.Tensor, torch.Tensor] | None,
                  image_tokens: torch.Tensor | None = None) -> tuple[dict, torch.Tensor]:
    """The inputs of a multimodal-rotary model (`uses_mrope`: Qwen2-VL's family) for one forward over whole
    sequences (a prefill, or prompts and responses in training).

    The image features go into the input embeddings here, at `image_tokens`, and not by the model's own
    placement (every image-pad token of `input_ids`): a model may sample the image-pad token itself, and
    that token is text, as its engine fed it.

    Args:
        input_ids: [B, L] token ids, left-padded; image tokens expanded (one per merged patch).
        attention_mask: [B, L] 1 on real tokens.
        vision: ([patches, D] pixel values, [images, 3] grids) of the images of the rows, in row order; None:
            no row has an image.
        image_tokens: [B, L] bool, the tokens that stand for image patches; None: every image-pad token (a
            prompt's).

    Returns:
        (keyword inputs for `model(...)` that replace `input_ids`: `inputs_embeds` [B, L, H] and `position_ids`
        [3, B, L] counted from each row's first real token; the [B] rope deltas: the token after a row's
        last one sits at text position (its real tokens) + delta).

    Raises:
        ValueError: the images' features do not fill the image tokens exactly (one line with both counts).
    """
    owner = _rope_index_owner(model)
    image_token = getattr(owner.config, "image_token_id", None)
    if image_tokens is None:
        image_tokens = input_ids == image_token if image_token is not None else torch.zeros_like(input_ids,
                                                                                                 dtype=torch.bool)
    grids = None if vision is None else vision[1].to(input_ids.device)
    merge = int(getattr(getattr(owner.config, "vision_config", None), "spatial_merge_size", 2))
    features_count = 0 if grids is None else int((grids.prod(dim=-1) // merge**2).sum())
    if features_count != int(image_tokens.sum()):  # before the rope index, which fails obscurely on it
        raise ValueError(f"the images give {features_count} image features for {int(image_tokens.sum())} "
                         "image tokens in the input ids")
    positions, deltas = owner.get_rope_index(input_ids, mm_token_type_ids=image_tokens.int(),
                                             image_grid_thw=grids, attention_mask=attention_mask)  # [3, B, L]
    embeds = owner.get_input_embeddings()(input_ids)  # [B, L, H]
    if vision is not None:
        output = owner.get_image_features(vision[0].to(input_ids.device), grids, return_dict=True)
        features = torch.cat(list(output.pooler_output)).to(embeds.dtype)  # [image tokens, H]
        embeds = embeds.masked_scatter(image_tokens.unsqueeze(-1).expand_as(embeds), features)
    return {"input_ids": None, "inputs_embeds": embeds, "position_ids": positions}, deltas.reshape(-1)
