"""`Sample`, the one typed record that crosses the rollout -> trainer boundary, and `collate`.

Token-in, token-out: the token ids a sample carries are exactly the ones the engine produced, and
`collate` is the only place they become padded tensors.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from rollflow.data.vision import VisionInputs, stack_vision


class SampleStatus(str, enum.Enum):
    """How a sample's generation ended (or why it was dropped)."""

    FINISHED = "finished"  # stopped at EOS / a stop string
    TRUNCATED = "truncated"  # hit max_new_tokens
    ABORTED = "aborted"  # aborted by the scheduler (partial rollout, over-provisioning)
    FAILED = "failed"  # engine, env or reward error
    FILTERED = "filtered"  # dropped by a filter (the difficulty mask; dynamic sampling, length)


@dataclass(frozen=True)
class TurnSpan:
    """One turn of a multi-turn episode in a sample's response: the model's tokens of turn `turn` (0 first) are
    `response_ids[start:end]` (the observation tokens between turns belong to no span)."""

    turn: int
    start: int
    end: int


@dataclass(frozen=True)
class EpisodeInfo:
    """What the samples of one multi-turn episode share, beside their reward (the episode's return), group id
    and step rewards.

    Attributes:
        key: (group id, slot): the episode's samples (one, or one per turn) share it.
        anchors: each turn's state, turn by turn (GiGPO's step groups gather equal ones).
    """

    key: tuple[int, int]
    anchors: tuple[str, ...] = ()


@dataclass(frozen=True)
class EpisodeRow:
    """One episode of a batch (`Batch.episodes`): what the episode advantages need of it."""

    key: tuple[int, int]
    group_id: int
    episode_return: float
    step_rewards: tuple[float, ...]
    anchors: tuple[str, ...]


@dataclass
class Sample:
    """One generated sequence (RLVR) or trajectory (agentic).

    Attributes:
        prompt_ids: prompt token ids, as fed to the engine.
        response_ids: every token after the prompt (model tokens and, in multi-turn, env/tool tokens).
        response_logprobs: the engine's logprob of each response token (0.0 for env/tool tokens).
        loss_mask: 1 on model-generated tokens, 0 on env/tool tokens; same length as `response_ids`.
        policy_versions: policy version that sampled each response token (-1 for env/tool tokens).
        group_id: samples of one prompt / env seed share it.
        reward: the scalar training reward (weighted sum of `rewards`).
        rewards: each reward function's value, by name (logged separately).
        step_rewards: per-turn rewards for multi-turn trajectories. Reserved: nothing fills or reads it until
            the agentic pipeline (step-level advantages, GiGPO) does.
        domain: dataset domain / tag, for per-domain metrics and sampling.
        status: how generation ended.
        prompt_text / response_text: decoded text, for rewards and logs.
        row: the dataset row (answer and any extra columns), passed to reward functions.
        metadata: free-form extras for logs and metrics (request id, timings, finish reason, an episode's
            counters, ...); nothing that becomes a tensor.
        vision: the prompt's images as the processor made them (`VisionInputs`: pixel values, grids), the
            tensors the engine prefilled with and the trainer recomputes logprobs with; None: text only.
        episode: the multi-turn episode the sample is (part of); None for a single-turn sample.
        turn_spans: where each of the episode's turns this sample holds sits in `response_ids` (a trajectory:
            every turn; a step sample: its one turn, spanning the whole response).
        ce_mask: supervised distillation on prompts: 1 on the response tokens the cross-entropy term trains on
            (the original response's), 0 on the prompt moved into the response; empty: every trained token.
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    group_id: int = 0
    reward: float = 0.0
    rewards: dict[str, float] = field(default_factory=dict)
    step_rewards: list[float] = field(default_factory=list)
    domain: str = "default"
    status: SampleStatus = SampleStatus.FINISHED
    prompt_text: str = ""
    response_text: str = ""
    row: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    vision: VisionInputs | None = None
    episode: EpisodeInfo | None = None
    turn_spans: list[TurnSpan] = field(default_factory=list)
    ce_mask: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if not self.loss_mask:
            self.loss_mask = [1] * n
        for name in ("response_logprobs", "loss_mask", "policy_versions", "ce_mask"):
            value = getattr(self, name)
            if value and len(value) != n:
                raise ValueError(f"Sample.{name} has {len(value)} entries for {n} response tokens")

    @property
    def truncated(self) -> bool:
        return self.status == SampleStatus.TRUNCATED


@dataclass
class Batch:
    """Padded tensors for B samples: prompts left-padded to P tokens, responses right-padded to T.

    The sequence fed to the model is `input_ids = [prompt (left-padded) | response (right-padded)]`,
    so response token t of every row sits at column P + t and is predicted by the logits at P + t - 1.

    Attributes:
        input_ids: [B, P + T] token ids (pad positions hold `pad_token_id`).
        attention_mask: [B, P + T] 1 on real tokens.
        position_ids: [B, P + T] positions counted from each row's first real token.
        response_mask: [B, T] 1 on response tokens that are trained on (loss_mask and not padding).
        rollout_logprobs: [B, T] the engine's logprobs (0 on padding).
        policy_versions: [B, T] sampling policy version per token (-1 on padding / env tokens). The
            rollout stream bounds staleness on the samples' versions before collate; the trainer does not read
            it.
        rewards: [B] scalar reward per sample.
        group_ids: [B] group id per sample.
        response_lengths: [B] number of response tokens (model and env), before padding.
        truncated: [B] bool, the response hit the length limit.
        prompt_length: P.
        extras: other [B] / [B, T] tensors: those `collate` makes of multi-turn samples (`segment_ids` [B, T]:
            the index of each model token's turn among its sample's turns, -1 elsewhere, for `ipa_chunk`;
            `turn_ids` [B, T]: its turn's number in the episode, -1 elsewhere; `episode_index` [B]: each row's
            episode in `episodes`) and of distillation samples (`ce_mask` [B, T]), then those the step adds
            (advantages, old_logprobs, ref_logprobs, values).
        domain_ids: [B] long, each sample's domain as an index into `domain_names`; None: not known.
        domain_names: the domains of the batch, sorted (the names of `domain_ids`).
        vision: each row's `VisionInputs` (None for a row without images); None when no row has images.
            Rows select with the others; `vision_tensors` joins them for the model.
        episodes: the multi-turn episodes of the rows, in the order their first row comes
            (`extras["episode_index"]` indexes it; a selection of rows keeps them all); empty for single-turn
            samples.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    policy_versions: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    response_lengths: torch.Tensor
    truncated: torch.Tensor
    prompt_length: int
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    domain_ids: torch.Tensor | None = None
    domain_names: tuple[str, ...] = ()
    vision: list[VisionInputs | None] | None = None
    episodes: tuple[EpisodeRow, ...] = ()

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def __reduce__(self):
        """Pickle the tensors as numpy arrays: a batch crosses a process boundary (driver -> trainer) every
        step, and torch's own tensor pickling runs a `torch.load` per tensor when unpickled (~8 ms for a
        64-row batch on the development machine; numpy arrays ~1 ms, and Ray passes their buffers out of
        band)."""
        state = {f.name: _packed(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "extras"}
        state["extras"] = {name: _packed(value) for name, value in self.extras.items()}
        return _unpickle_batch, (state,)

    @property
    def response_width(self) -> int:
        return self.response_mask.shape[1]

    def to(self, device: torch.device | str) -> Batch:
        """The batch with every tensor (and extra) on `device`; the same object when already there."""
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        tensors = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **tensors, extras={k: v.to(device) for k, v in self.extras.items()})

    def select(self, index: torch.Tensor | slice) -> Batch:
        """Rows `index` of every tensor (used for micro-batching); padding columns are kept."""
        fields = {
            name: getattr(self, name)[index]
            for name in (
                "input_ids", "attention_mask", "position_ids", "response_mask", "rollout_logprobs",
                "policy_versions", "rewards", "group_ids", "response_lengths", "truncated",
            )
        }
        vision = None
        if self.vision is not None:
            if isinstance(index, slice):
                rows = range(self.size)[index]
            else:
                picked = torch.as_tensor(index)
                rows = (picked.nonzero().flatten() if picked.dtype == torch.bool else picked.reshape(-1)).tolist()
            vision = [self.vision[row] for row in rows]
        return Batch(**fields, prompt_length=self.prompt_length,
                     extras={k: v[index] for k, v in self.extras.items()},
                     domain_ids=None if self.domain_ids is None else self.domain_ids[index],
                     domain_names=self.domain_names, vision=vision, episodes=self.episodes)

    def vision_tensors(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """([patches, D] pixel values, [images, 3] grids) of the rows' images in row order (`stack_vision`);
        None when no row has an image."""
        return None if self.vision is None else stack_vision(self.vision)

    def trimmed(self) -> Batch:
        """The batch without the columns that are padding in every row: leading prompt columns and trailing
        response columns (a micro-batch is then only as wide as its own rows).

        Every [B, P + T] tensor loses the same leading and trailing columns, every [B, T] tensor (extras
        included) the same trailing ones; `prompt_length` shrinks by the leading columns dropped; [B] tensors
        are unchanged. Positions count from each row's first real token, so dropping columns that no row uses
        leaves every real token's position (and the model's output on it) unchanged. At least one prompt
        column (the logits of response token 0 are read there) and one response column are kept.

        Returns:
            The trimmed batch; the same object when no column is all padding.

        Raises:
            ValueError: columns are to be dropped and an extra with 2+ dimensions is not [B, T, ...].
        """
        real = self.attention_mask > 0  # [B, P + T]
        prompt_width, response_width = self.prompt_length, self.response_width
        used_prompt = real[:, :prompt_width].any(dim=0).nonzero()  # [p, 1] prompt columns some row uses
        start = min(int(used_prompt[0]) if len(used_prompt) else prompt_width, max(prompt_width - 1, 0))
        used_response = real[:, prompt_width:].any(dim=0).nonzero()  # [t, 1] response columns some row uses
        width = int(used_response[-1]) + 1 if len(used_response) else 1
        if start == 0 and width == response_width:
            return self
        for name, value in self.extras.items():
            if value.dim() >= 2 and value.shape[1] != response_width:
                raise ValueError(f"extras[{name!r}] has shape {tuple(value.shape)}; extras are [B] or "
                                 f"[B, T] with T = {response_width}")
        columns = slice(start, prompt_width + width)  # of the [B, P + T] tensors
        return dataclasses.replace(
            self,
            input_ids=self.input_ids[:, columns],
            attention_mask=self.attention_mask[:, columns],
            position_ids=self.position_ids[:, columns],
            response_mask=self.response_mask[:, :width],
            rollout_logprobs=self.rollout_logprobs[:, :width],
            policy_versions=self.policy_versions[:, :width],
            prompt_length=prompt_width - start,
            extras={k: v[:, :width] if v.dim() >= 2 else v for k, v in self.extras.items()},
        )


# dtypes numpy holds exactly (bfloat16 and the float8s are not among them: those pickle as torch tensors)
_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8, torch.bool})


def _packed(value: Any) -> Any:
    """A CPU tensor without autograd history as ("numpy", array); anything else as ("as is", value)."""
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dtype in _NUMPY_DTYPES \
            and not value.requires_grad:
        return "numpy", value.numpy()
    return "as is", value


def _unpacked(packed: tuple[str, Any]) -> Any:
    kind, value = packed
    # a copy: the unpickled array may be a read-only view of the sender's buffer (Ray's object store)
    return torch.from_numpy(value.copy()) if kind == "numpy" else value


def _unpickle_batch(state: dict[str, Any]) -> Batch:
    extras = {name: _unpacked(value) for name, value in state.pop("extras").items()}
    return Batch(**{name: _unpacked(value) for name, value in state.items()}, extras=extras)


def _response_row(values: list, n_response: int, width: int, fill: Any, name: str, optional: bool = True) -> list:
    """One value per response token, right-padded to `width` with `fill`; `optional` values may be left empty
    (the row is all `fill`). Any other length than the response's is a bug upstream (ValueError)."""
    if optional and not values:
        return [fill] * width
    if len(values) != n_response:
        raise ValueError(f"a sample's {name} has {len(values)} entries for {n_response} response tokens")
    return list(values) + [fill] * (width - n_response)


def collate(samples: list[Sample], pad_token_id: int) -> Batch:
    """Turn samples into one padded `Batch`. The only place samples become tensors.

    Args:
        samples: B samples; each needs at least one response token.
        pad_token_id: id written into padded positions (they are masked out everywhere).

    Returns:
        A `Batch` with prompts left-padded to the longest prompt and responses right-padded to the longest
        response.
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    prompt_width = max(len(s.prompt_ids) for s in samples)
    response_width = max(max(len(s.response_ids) for s in samples), 1)
    # padded Python rows, then one tensor per field: a per-row tensor and slice assignment costs ~30 us a row
    ids, attention, mask, logprobs, versions = [], [], [], [], []
    for sample in samples:
        n_prompt, n_response = len(sample.prompt_ids), len(sample.response_ids)
        left, right = prompt_width - n_prompt, response_width - n_response
        ids.append([pad_token_id] * left + list(sample.prompt_ids) + list(sample.response_ids)
                   + [pad_token_id] * right)
        attention.append([0] * left + [1] * (n_prompt + n_response) + [0] * right)
        mask.append(_response_row(sample.loss_mask if n_response else [], n_response, response_width, 0,
                                  "loss_mask", optional=n_response == 0))
        logprobs.append(_response_row(sample.response_logprobs, n_response, response_width, 0.0,
                                      "response_logprobs"))
        versions.append(_response_row(sample.policy_versions, n_response, response_width, -1, "policy_versions"))
    input_ids = torch.tensor(ids, dtype=torch.long)  # [B, P + T]
    attention_mask = torch.tensor(attention, dtype=torch.long)  # [B, P + T]
    response_mask = torch.tensor(mask, dtype=torch.float32)  # [B, T]
    rollout_logprobs = torch.tensor(logprobs, dtype=torch.float32)  # [B, T]
    policy_versions = torch.tensor(versions, dtype=torch.long)  # [B, T]
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # [B, P + T]
    domain_names = tuple(sorted({s.domain for s in samples}))
    extras, episodes = _turn_tensors(samples, response_width)
    if any(s.ce_mask for s in samples):
        extras["ce_mask"] = torch.tensor([_response_row(s.ce_mask, len(s.response_ids), response_width, 0, "ce_mask")
                                          for s in samples], dtype=torch.float32)  # [B, T]
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=response_mask,
        rollout_logprobs=rollout_logprobs,
        policy_versions=policy_versions,
        rewards=torch.tensor([float(s.reward) for s in samples], dtype=torch.float32),
        group_ids=torch.tensor([s.group_id for s in samples], dtype=torch.long),
        response_lengths=torch.tensor([len(s.response_ids) for s in samples], dtype=torch.long),
        truncated=torch.tensor([s.truncated for s in samples], dtype=torch.bool),
        prompt_length=prompt_width,
        domain_ids=torch.tensor([domain_names.index(s.domain) for s in samples], dtype=torch.long),
        domain_names=domain_names,
        vision=[s.vision for s in samples] if any(s.vision is not None for s in samples) else None,
        extras=extras,
        episodes=episodes,
    )


def _turn_tensors(samples: list[Sample], width: int) -> tuple[dict[str, torch.Tensor], tuple[EpisodeRow, ...]]:
    """The multi-turn extras of `collate` (`segment_ids`, `turn_ids` [B, T], `episode_index` [B]) and the
    batch's episodes; nothing when no sample is part of an episode."""
    if all(s.episode is None for s in samples):
        return {}, ()
    segments = torch.full((len(samples), width), -1, dtype=torch.long)  # [B, T]
    turns = torch.full((len(samples), width), -1, dtype=torch.long)  # [B, T]
    index: dict[tuple[int, int], int] = {}
    episodes, rows = [], []
    for row, sample in enumerate(samples):
        if sample.episode is None:
            raise ValueError("collate got single-turn samples beside multi-turn ones")
        key = sample.episode.key
        if key not in index:
            index[key] = len(episodes)
            episodes.append(EpisodeRow(key, sample.group_id, float(sample.reward), tuple(sample.step_rewards),
                                       sample.episode.anchors))
        rows.append(index[key])
        for number, span in enumerate(sample.turn_spans):
            segments[row, span.start:span.end] = number
            turns[row, span.start:span.end] = span.turn
    extras = {"segment_ids": segments, "turn_ids": turns, "episode_index": torch.tensor(rows, dtype=torch.long)}
    return extras, tuple(episodes)
