"""Per-token logprobs of a `Batch`'s response tokens under a causal LM (one forward pass)."""

from __future__ import annotations

import torch

from rollflow.data.sample import Batch


def model_logits(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Logits that predict each response token.

    Returns:
        [B, T, V] logits; row b, column t predicts response token t (input column P + t).
    """
    from rollflow.models import uses_mrope

    prompt_width, response_width = batch.prompt_length, batch.response_width
    if uses_mrope(model):
        output = _forward_with_inputs_inside(model, batch)
    else:
        output = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
                       **model_inputs(model, batch))
    return output.logits[:, prompt_width - 1 : prompt_width + response_width - 1].float()  # [B, T, V]


def _forward_with_inputs_inside(model: torch.nn.Module, batch: Batch):
    """The forward of a multimodal-rotary model, its inputs (`model_inputs`: embeddings with the image
    features, mrope positions) made inside its forward by a pre-hook: under FSDP2 the root's own weights (the
    embedding, the vision tower's patch embedding and merger) are gathered only there, after FSDP's own
    pre-forward hook, and the tower's blocks may run only once the root's forward has started."""

    def hook(module, args, kwargs):
        return args, {**kwargs, **model_inputs(model, batch)}

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    finally:
        handle.remove()


def model_inputs(model: torch.nn.Module, batch: Batch) -> dict:
    """The inputs of a forward over `batch` besides its attention mask: [B, P + T] positions for a text model;
    for a multimodal-rotary one (Qwen2-VL's family) [3, B, P + T] positions and the input embeddings with the
    rows' image features in place (`rollflow.models.vision_inputs`), the same the engine prefilled with.

    Raises:
        ValueError: the batch has images and the model is not a vision-language model.
    """
    from rollflow.models import uses_mrope, vision_inputs

    vision = batch.vision_tensors()
    if not uses_mrope(model):
        if vision is not None:
            raise ValueError(f"the batch has images, but {type(model).__name__} is a text-only model")
        return {"position_ids": batch.position_ids}
    image_tokens = None
    if vision is not None:  # the prompt's image pads, and a response's that the env wrote (loss mask 0)
        image_tokens = batch.input_ids == model.config.image_token_id  # [B, P + T]
        image_tokens[:, batch.prompt_length:] &= batch.response_mask == 0
    return vision_inputs(model, batch.input_ids, batch.attention_mask, vision, image_tokens)[0]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log-softmax(logits / temperature) gathered at `tokens`.

    Args:
        logits: [B, T, V].
        tokens: [B, T] token ids.
        temperature: sampling temperature the engine used (> 0).

    Returns:
        [B, T] logprobs.
    """
    scaled = logits / temperature  # [B, T, V]
    picked = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B, T]
    return picked - torch.logsumexp(scaled, dim=-1)  # [B, T]


def response_tokens(batch: Batch) -> torch.Tensor:
    """[B, T] response token ids (padding included; mask with `response_mask`)."""
    return batch.input_ids[:, batch.prompt_length :]


def response_logprobs(model: torch.nn.Module, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    """Logprobs of the batch's response tokens under the causal LM `model` (one forward pass).

    Returns:
        [B, T] logprobs (padding included; mask with `response_mask`).
    """
    return token_logprobs(model_logits(model, batch), response_tokens(batch), temperature)  # [B, T]
