"""Cost models of simulated GPUs: named hardware profiles, response-length distributions, and the settings a
simulated run shares (`SimSettings`).

A profile's constants are what one GPU of that kind costs, as a real system spends it (docs/simulation.md
says where each number comes from):

* decoding (one engine instance on one GPU, continuous batching): a decode step of a batch costs
  `decode_step_s + decode_s_per_kv_token * tokens in the batch's KV cache` (memory-bound: the weights are read
  once per step, the KV cache once per step), a prefill `prefill_s_per_token * prompt tokens`;
* training: `train_gpu_s_per_token * tokens` GPU-seconds per optimizer step, split over the trainer's GPUs,
  plus `optimizer_step_s`; a logprob forward `forward_gpu_s_per_token * tokens`;
* weight sync: `model_bytes / sync_bytes_per_s + sync_fixed_s`; offload and onload `offload_s`, `onload_s`.

Simulated time runs `time_scale` times faster than the wall clock (sleeps, not CPU work), and a sample carries
one payload token per `token_scale` simulated tokens, so 16k samples of thousands of tokens fit the driver of
a laptop while the costs count every simulated token.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from rollflow.errors import ConfigError
from rollflow.registry import Registry


@dataclass(frozen=True)
class HardwareProfile:
    """What one simulated GPU costs (see the module docstring). Times in seconds, sizes in tokens / bytes."""

    description: str
    decode_step_s: float
    decode_s_per_kv_token: float
    prefill_s_per_token: float
    max_running: int  # sequences one engine decodes together (vLLM's max_num_seqs)
    kv_capacity_tokens: int  # KV cache of one engine; a request waits while it is full
    train_gpu_s_per_token: float
    forward_gpu_s_per_token: float
    optimizer_step_s: float
    model_bytes: int
    sync_bytes_per_s: float
    sync_fixed_s: float
    offload_s: float
    onload_s: float

    def decode_seconds(self, steps: int, kv_tokens: int, running: int) -> float:
        """Time of `steps` decode steps of `running` sequences holding `kv_tokens` at the first: each step adds
        one token per sequence, so step i holds kv_tokens + i * running."""
        if steps <= 0:
            return 0.0
        return steps * self.decode_step_s + self.decode_s_per_kv_token * (
            steps * kv_tokens + running * steps * (steps - 1) / 2)

    def decode_steps_within(self, seconds: float, kv_tokens: int, running: int) -> int:
        """The most whole decode steps (`decode_seconds`) that fit in `seconds`."""
        if seconds <= 0:
            return 0
        a, b = self.decode_step_s, self.decode_s_per_kv_token
        # solve b*r/2 * s^2 + (a + b*k - b*r/2) * s - seconds = 0 for s
        quadratic, linear = b * running / 2, a + b * kv_tokens - b * running / 2
        if quadratic == 0:
            steps = seconds / linear
        else:
            steps = (-linear + math.sqrt(linear * linear + 4 * quadratic * seconds)) / (2 * quadratic)
        steps = max(0, int(steps))
        while steps > 0 and self.decode_seconds(steps, kv_tokens, running) > seconds:  # float rounding
            steps -= 1
        while self.decode_seconds(steps + 1, kv_tokens, running) <= seconds:
            steps += 1
        return steps

    def sync_seconds(self) -> float:
        return self.model_bytes / self.sync_bytes_per_s + self.sync_fixed_s


PROFILES: Registry[HardwareProfile] = Registry("simulation profile")

# Qwen2.5-7B in bfloat16 (7.6e9 parameters, 28 layers, 4 KV heads of 128) on H800 / H100 SXM (80 GB HBM3 at
# 3.35 TB/s, ~990 dense bf16 TFLOP/s), vLLM with TP 1 for rollout, FSDP / Megatron for training.
PROFILES.register("h800-7b")(HardwareProfile(
    description="Qwen2.5-7B bf16 on H800/H100 80GB: vLLM TP1 rollout, FSDP training",
    # weights 15.2 GB read per step at ~2.5 TB/s achieved = 6.1 ms, plus ~2 ms of scheduling and kernel launch
    decode_step_s=8e-3,
    # KV per token 28 layers * 2 * 4 heads * 128 * 2 bytes = 57 KB, read per step at ~2.5 TB/s
    decode_s_per_kv_token=2.3e-8,
    # 2 * 7.6e9 FLOP per prompt token at ~400 TFLOP/s achieved
    prefill_s_per_token=3.8e-5,
    max_running=256,
    # (80 GB * 0.9 - 15.2 GB) / 57 KB
    kv_capacity_tokens=990_000,
    # 6 * 7.6e9 FLOP per token (forward and backward) at 40% MFU of 990 TFLOP/s
    train_gpu_s_per_token=1.15e-4,
    forward_gpu_s_per_token=3.8e-5,
    optimizer_step_s=0.5,
    model_bytes=15_200_000_000,
    # NCCL broadcast of bf16 weights across nodes at ~50 GB/s (400 Gb/s InfiniBand), plus the gather / reshard
    sync_bytes_per_s=50e9,
    sync_fixed_s=1.0,
    # vLLM sleep / wake level 1 and FSDP CPU offload of a 7B model: seconds each
    offload_s=2.0,
    onload_s=2.0,
))
# The same model on H200 (141 GB HBM3e at 4.8 TB/s, the H100's compute): faster decoding, a bigger KV cache.
PROFILES.register("h200-7b")(replace(
    PROFILES.get("h800-7b"),
    description="Qwen2.5-7B bf16 on H200 141GB: vLLM TP1 rollout, FSDP training",
    decode_step_s=6e-3, decode_s_per_kv_token=1.6e-8, kv_capacity_tokens=1_950_000,
))
DEFAULT_PROFILE = "h800-7b"


@dataclass(frozen=True)
class LengthDistribution:
    """Response lengths (simulated tokens) drawn per sample.

    Attributes:
        kind: "lognormal" (median `median`, 99th percentile `tail_ratio` x the median), "fixed" (every response
            `median` tokens: no tail) or "replay" (`values`, drawn uniformly: a real run's lengths).
        median: tokens.
        tail_ratio: the 99th percentile over the median (ROLL Flash and RollPacker describe ~20x).
        values: replayed lengths.
    """

    kind: str = "lognormal"
    median: float = 300.0
    tail_ratio: float = 20.0
    values: tuple[int, ...] = ()

    def draw(self, rng: random.Random) -> int:
        """One response length, at least 1."""
        if self.kind == "fixed":
            return max(1, round(self.median))
        if self.kind == "replay":
            return max(1, rng.choice(self.values))
        sigma = math.log(self.tail_ratio) / 2.3263  # z of the 99th percentile
        return max(1, round(self.median * math.exp(sigma * rng.gauss(0.0, 1.0))))


LENGTH_KINDS = ("lognormal", "fixed", "replay")


def length_distribution(spec: dict[str, Any] | None) -> LengthDistribution:
    """A `LengthDistribution` from its config form: `{kind, median, tail_ratio}` or `{replay: samples.jsonl}`
    (the response token counts a real run logged, `response_tokens`, or its responses' lengths).

    Raises:
        ConfigError: an unknown kind or key, a non-positive median, a tail ratio under 1, or a replay file
            without lengths.
    """
    spec = dict(spec or {})
    if "replay" in spec:
        path = Path(spec.pop("replay"))
        if spec:
            raise ConfigError(f"sim lengths: replay takes no other keys, got {sorted(spec)}")
        return LengthDistribution("replay", values=tuple(replayed_lengths(path)))
    known = {f.name for f in fields(LengthDistribution)} - {"values"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ConfigError(f"sim lengths: unknown keys {unknown}; valid: {sorted(known)} or replay")
    distribution = LengthDistribution(**spec)
    if distribution.kind not in LENGTH_KINDS[:2]:
        raise ConfigError(f"sim lengths: unknown kind {distribution.kind!r}; valid: {', '.join(LENGTH_KINDS[:2])} "
                          "or replay: PATH")
    if not distribution.median > 0 or not distribution.tail_ratio >= 1:
        raise ConfigError(f"sim lengths: median must be > 0 and tail_ratio >= 1, got {distribution.median} and "
                          f"{distribution.tail_ratio}")
    return distribution


def replayed_lengths(path: Path) -> list[int]:
    """The response lengths of a run's `samples.jsonl` (or `eval_samples.jsonl`): each record's
    `response_tokens`, else the length of its `response` text."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise ConfigError(f"sim lengths: cannot read {path}: {err.strerror}") from None
    lengths = []
    for line in lines:
        if line.strip():
            record = json.loads(line)
            lengths.append(int(record.get("response_tokens", len(record.get("response", "")))))
    if not any(lengths):
        raise ConfigError(f"sim lengths: {path} has no responses to replay")
    return [n for n in lengths if n > 0]


@dataclass(frozen=True)
class SimSettings:
    """What a simulated run's engines and trainers share (`cluster.sim`).

    Attributes:
        profile: a `PROFILES` name.
        time_scale: simulated seconds per wall-clock second.
        token_scale: simulated tokens per payload token.
        overrides: profile fields replaced (e.g. {"max_running": 128}).
        gpus: the simulated GPUs of this worker (a trainer's split its compute over them).
    """

    profile: str = DEFAULT_PROFILE
    time_scale: float = 20.0
    token_scale: int = 16
    overrides: dict[str, Any] = field(default_factory=dict)
    gpus: int = 1

    def hardware(self) -> HardwareProfile:
        """The profile with `overrides` applied.

        Raises:
            ConfigError: an unknown profile or profile field.
        """
        try:
            profile = PROFILES.get(self.profile)
        except KeyError as err:
            raise ConfigError(str(err)) from None
        known = {f.name for f in fields(HardwareProfile)} - {"description"}
        unknown = sorted(set(self.overrides) - known)
        if unknown:
            raise ConfigError(f"cluster.sim.overrides: unknown fields {unknown}; valid: {sorted(known)}")
        return replace(profile, **self.overrides)

    def wall(self, simulated_seconds: float) -> float:
        """Wall-clock seconds of `simulated_seconds`."""
        return simulated_seconds / self.time_scale
