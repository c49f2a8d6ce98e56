"""A value model for the critic: a causal LM's backbone (its LM head dropped) with a scalar value head.

The value of response token t is read from the hidden state that predicts it (input column P + t - 1), the
same position whose logits give the token's logprob, so values line up with logprobs and advantages:
`V_t` estimates the return from the state just before token t is emitted.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rollflow.data.sample import Batch
from rollflow.models import load_causal_lm

WEIGHTS_FILE = "value_model.safetensors"


class ValueModel(torch.nn.Module):
    """Backbone + `Linear(hidden, 1)`, zero-initialized so every value starts at 0 (no random baseline).

    Args:
        backbone: the transformer body of a causal LM (`model.base_model`), returning hidden states.
        hidden_size: width of its last hidden state.
    """

    def __init__(self, backbone: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = torch.nn.Linear(hidden_size, 1, dtype=next(backbone.parameters()).dtype)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(cls, model_path: str, dtype: str = "float32",
                        trust_remote_code: bool = False) -> ValueModel:
        """The backbone of the causal LM at `model_path` (bundled name, directory or hub id) + a new head."""
        from rollflow.errors import ConfigError
        from rollflow.models import is_vision_language

        causal_lm = load_causal_lm(model_path, dtype, trust_remote_code)
        if is_vision_language(causal_lm.config):  # its forward reads token ids: the values would not see images
            raise ConfigError("a value model (the critic) of a vision-language model is not supported")
        return cls(causal_lm.base_model, causal_lm.config.hidden_size)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor) -> torch.Tensor:
        """Returns [B, L] one value per input position."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state  # [B, L, H]
        # a fresh tensor, not a view: FSDP2 warns on every forward that returns a view
        return self.value_head(hidden).squeeze(-1).clone()  # [B, L]

    def save(self, path: str | Path) -> None:
        """All weights (backbone + head) in one safetensors file under `path`."""
        state = {name: tensor.contiguous() for name, tensor in self.state_dict().items()}
        save_file(state, str(Path(path) / WEIGHTS_FILE))

    def load(self, path: str | Path) -> None:
        self.load_state_dict(load_file(str(Path(path) / WEIGHTS_FILE)))


def response_values(model: ValueModel, batch: Batch) -> torch.Tensor:
    """Values of the batch's response tokens.

    Returns:
        [B, T] float values; column t is read at input column P + t - 1, like `model_logits`.
    """
    prompt_width, response_width = batch.prompt_length, batch.response_width
    values = model(batch.input_ids, batch.attention_mask, batch.position_ids)  # [B, P + T]
    return values[:, prompt_width - 1 : prompt_width + response_width - 1].float()  # [B, T]
