"""The inference-engine protocol and its request / completion records.

Every engine (`hf`, `vllm`, `sglang`) takes token ids in and gives token ids out, with the logprob of each
sampled token and the policy version that sampled it, so nothing is re-tokenized between rollout and
training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from rollflow.data.vision import VisionInputs
from rollflow.errors import EngineError

if TYPE_CHECKING:  # an annotation only: a process that just passes these records need not import torch (~3 s)
    import torch

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `temperature == 0` means greedy decoding.

    Reported logprobs are log-softmax(logits / temperature) of the sampled token (temperature 1 when
    greedy), before top-k / top-p filtering and before the `min_new_tokens` mask — the quantity the
    trainer recomputes.

    `min_new_tokens` (vLLM's `min_tokens`, SGLang's `min_new_tokens`): until a sample has that many
    tokens, EOS and `stop_token_ids` cannot be sampled, so no sample ends by a stop before it.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1  # completions for this prompt (a GRPO group)
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's EOS ids
    seed: int | None = None  # per-request seed (reproducible sampling); None: engine's generator
    min_new_tokens: int = 0  # no EOS / stop id before this many tokens

    def __post_init__(self):
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                             f"got {self.min_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not self.temperature >= 0:  # also refuses NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


# Sample seeds stay inside torch's `manual_seed` range (and a signed 64-bit integer) for any request seed.
SEED_MODULUS = 2**63


def sample_seed(seed: int, slot: int) -> int:
    """The seed of sample `slot` of a request seeded with `seed` (every engine that seeds per sample)."""
    return (seed * 1_000_003 + slot) % SEED_MODULUS


def first_line(error: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def decoding_failed(engine: str, cause: BaseException) -> EngineError:
    """The one-line error every request an engine held fails with when its decoding raised `cause`."""
    error = EngineError(f"{engine} engine: decoding failed: {first_line(cause)}")
    error.__cause__ = cause  # the full story for a traceback; the message stays one line
    return error


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to complete `params.n` times.

    `vision`: the prompt's images as the processor made them (`rollflow.data.vision.VisionInputs`), for a
    vision-language model; `prompt_ids` then hold each image's placeholder tokens, already expanded.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = SamplingParams()
    vision: VisionInputs | None = None


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
        """Sample `request.params.n` completions; RuntimeError while asleep or after `close()`.

        Raises EngineError when decoding fails (every request the engine held fails with it, none keeps
        waiting); the engine serves later requests.
        """
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
