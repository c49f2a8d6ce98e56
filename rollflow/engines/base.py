"""The inference-engine protocol and its request / completion records.

Every engine (`hf`, `vllm`, `sglang`) takes token ids in and gives token ids out, with the logprob of each
sampled token and the policy version that sampled it, so nothing is re-tokenized between rollout and
training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `temperature == 0` means greedy decoding.

    Reported logprobs are log-softmax(logits / temperature) of the sampled token (temperature 1 when
    greedy), before top-k / top-p filtering — the quantity the trainer recomputes.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1  # completions for this prompt (a GRPO group)
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's EOS ids
    seed: int | None = None  # per-request seed (reproducible sampling); None: engine's generator


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = SamplingParams()


@dataclass
class CompletionOutput:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason = "stop"


@dataclass
class Completion:
    request_id: str
    outputs: list[CompletionOutput]
    metadata: dict = field(default_factory=dict)  # engine timings, worker id


class InferenceEngine(Protocol):
    """What a rollout worker needs from an engine.

    Engines load weights they are handed and know nothing of how they travelled: the rollout worker
    verifies each bucket's checksum as it arrives, before the tensors reach `update_weights`.
    """

    async def generate(self, request: GenerationRequest) -> Completion:
        """Sample `request.params.n` completions; RuntimeError while asleep or after `close()`."""
        ...

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests; they resolve with what was generated so far (`abort`)."""
        ...

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Load these (already verified) weights, by HF parameter name; later tokens carry `version`."""
        ...

    def sleep(self) -> None:
        """Free accelerator memory between rollout phases (idempotent)."""
        ...

    def wake(self) -> None:
        """Undo `sleep()` (idempotent)."""
        ...

    def close(self) -> None:
        """Release the engine for good (idempotent): pending requests resolve or fail, none keeps waiting."""
        ...

    @property
    def version(self) -> int:
        """Policy version of the loaded weights."""
        ...
