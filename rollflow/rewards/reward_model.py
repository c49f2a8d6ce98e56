"""`reward_model`: a sequence-classification reward model scores prompt + completion, batched, in a worker.

The model is any `AutoModelForSequenceClassification` with one label (a Bradley-Terry reward model, e.g.
`Skywork/Skywork-Reward-V2-Qwen3-0.6B`). The text it scores is the prompt as a user turn and the completion
as the assistant turn, rendered with the reward model's own chat template when its tokenizer has one (and
`chat_template` is on), else `prompt + completion`. Its scalar output is returned as is (`normalize: none`)
or squashed to (0, 1) (`normalize: sigmoid`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollflow.registry import Registry
from rollflow.rewards.registry import REWARD_FUNCTIONS, MissingColumnError, ModelReward, Row, ScoreError

# torch is imported in the worker only: `rollflow.rewards` is also imported by light helper processes.
# Each maps a [B] float tensor of raw scores to [B] rewards.
SCORE_NORMALIZATIONS: Registry[Callable[[Any], Any]] = Registry("reward-model normalization")
SCORE_NORMALIZATIONS.register("none")(lambda scores: scores)
SCORE_NORMALIZATIONS.register("sigmoid")(lambda scores: scores.sigmoid())


@dataclass(frozen=True, kw_only=True)
class RewardModelOptions:
    """Options of `reward_model` (the `kwargs` of its entry in `reward.functions`).

    Attributes:
        model_path: bundled name, local HF directory or hub id of the reward model (required).
        prompt_key: the row column holding the prompt (a string or a list of chat messages).
        chat_template: render (prompt, completion) as a user / assistant exchange with the model's template.
        normalize: a `SCORE_NORMALIZATIONS` name: "none" (raw score) or "sigmoid".
        batch_size: sequences per forward pass.
        max_tokens: longer inputs fail their sample; None = the model's `max_position_embeddings`.
        dtype, trust_remote_code: how to load the model.
    """

    model_path: str | None = None
    prompt_key: str = "prompt"
    chat_template: bool = True
    normalize: str = "none"
    batch_size: int = 16
    max_tokens: int | None = None
    dtype: str = "float32"
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("needs model_path: the reward model (local directory or hub id)")
        from rollflow.errors import ModelLoadError
        from rollflow.models import DTYPES, resolve_model_path

        try:
            resolve_model_path(self.model_path)
        except ModelLoadError as error:
            raise ValueError(str(error)) from None
        if self.normalize not in SCORE_NORMALIZATIONS:
            raise ValueError(SCORE_NORMALIZATIONS.unknown_message(self.normalize))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("batch_size", "max_tokens"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")


def reward_model_text(tokenizer, prompt, completion: str, chat_template: bool) -> str:
    """The text a reward model scores for one sample.

    Args:
        tokenizer: the reward model's tokenizer.
        prompt: the prompt: a string (one user turn) or a list of chat messages.
        completion: the policy's completion (the assistant turn).
        chat_template: use the tokenizer's chat template when it has one.

    Returns:
        The rendered conversation, or `prompt + completion` without a template.
    """
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        messages.append({"role": "assistant", "content": completion})
        return tokenizer.apply_chat_template(messages, tokenize=False)
    if isinstance(prompt, list):
        prompt = "".join(str(m.get("content", "")) for m in prompt)
    return str(prompt) + completion


class RewardModelScorer:
    """`reward_model`'s scorer.

    Args:
        options: the bound `RewardModelOptions`.
        device: torch device ("cpu", "cuda").
    """

    def __init__(self, options: RewardModelOptions, device: str = "cpu"):
        import torch
        from transformers import AutoModelForSequenceClassification

        from rollflow.models import DTYPES, load_tokenizer, resolve_model_path

        self.options = options
        self.device = torch.device(device)
        self.tokenizer = load_tokenizer(options.model_path, options.trust_remote_code)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            resolve_model_path(options.model_path), dtype=DTYPES[options.dtype],
            trust_remote_code=options.trust_remote_code).to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward_model: {options.model_path!r} has num_labels={self.model.config.num_labels}; "
                             "a reward model has one scalar output (num_labels=1)")
        if self.model.config.pad_token_id is None:  # the model finds each row's last token by the pad id
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.max_tokens = options.max_tokens or getattr(self.model.config, "max_position_embeddings", None)
        self.normalize = SCORE_NORMALIZATIONS.get(options.normalize)

    def offload(self) -> None:
        """Move the model to host memory while a colocated role runs (nothing moves on CPU)."""
        if self.device.type != "cpu":
            import torch

            self.model.to("cpu")
            torch.cuda.empty_cache()

    def onload(self) -> None:
        if self.device.type != "cpu":
            self.model.to(self.device)

    def encode(self, completion: str, row: Row) -> list[int]:
        prompt = row.get(self.options.prompt_key)
        if prompt is None:
            raise MissingColumnError(f"reward 'reward_model' needs the dataset column {self.options.prompt_key!r}, "
                                     f"but the row has: {', '.join(sorted(row)) or 'none'}")
        text = reward_model_text(self.tokenizer, prompt, completion, self.options.chat_template)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def scores(self, sequences: list[list[int]]) -> list[float]:
        """Normalized scalar scores of token sequences, `batch_size` at a time (right-padded)."""
        import torch

        pad = self.tokenizer.pad_token_id
        out: list[float] = []
        for start in range(0, len(sequences), self.options.batch_size):
            chunk = sequences[start:start + self.options.batch_size]
            width = max(len(ids) for ids in chunk)
            input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)  # [b, L]
            attention = torch.zeros((len(chunk), width), dtype=torch.long)  # [b, L]
            for row, ids in enumerate(chunk):
                input_ids[row, :len(ids)] = torch.tensor(ids)
                attention[row, :len(ids)] = 1
            with torch.no_grad():
                logits = self.model(input_ids=input_ids.to(self.device),
                                    attention_mask=attention.to(self.device)).logits  # [b, 1]
            out.extend(self.normalize(logits[:, 0].float()).tolist())
        return out

    async def score_group(self, completions: list[str], rows: list[Row]) -> list[float | ScoreError]:
        """One score per completion; a missing prompt column or an over-long input fails its sample."""
        results: list[float | ScoreError] = []
        valid: dict[int, list[int]] = {}
        for index, (completion, row) in enumerate(zip(completions, rows)):
            try:
                ids = self.encode(completion, row)
            except MissingColumnError as error:
                results.append(ScoreError(str(error)))
                continue
            if not ids or (self.max_tokens is not None and len(ids) > self.max_tokens):
                results.append(ScoreError(f"reward-model input has {len(ids)} tokens (limit {self.max_tokens})"))
                continue
            valid[index] = ids
            results.append(0.0)  # placeholder, filled below
        for index, score in zip(valid, self.scores(list(valid.values()))):
            results[index] = score
        return results


REWARD_FUNCTIONS.register("reward_model")(
    ModelReward("rollflow.rewards.reward_model:RewardModelScorer", RewardModelOptions))
