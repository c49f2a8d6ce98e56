"""Phases of a step that more than one pipeline runs, as functions of explicit arguments: weight sync from
the trainer to the engines, and greedy evaluation through the rollout scheduler."""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from rollflow.cluster.colocation import ColocationManager
from rollflow.cluster.groups import WorkerGroups
from rollflow.config import RLVRConfig
from rollflow.data.prompts import EncodedPrompt
from rollflow.engines.base import SamplingParams
from rollflow.rollout.filters import check_some_succeeded
from rollflow.rollout.metrics import rollout_metrics
from rollflow.rollout.scheduler import RolloutScheduler
from rollflow.rollout.stream import RolloutStream, Sampler, StreamSettings
from rollflow.spans import span
from rollflow.workers.reward import build_reward_fn
from rollflow.workers.roles import forward_rows


def rollout_scheduler(config: RLVRConfig, groups: WorkerGroups, tokenizer) -> RolloutScheduler:
    """The run's scheduler over its engine workers, scoring with its rewards (model rewards on the `reward`
    group, plain ones on a reward pool), deterministic per `rollout.deterministic` (always, for a pipeline
    without a rollout section: its greedy eval)."""
    rollout = getattr(config, "rollout", None)
    reward_fn = build_reward_fn(config.reward, groups.get("reward"))

    def decode(token_ids: list[int]) -> str:
        return tokenizer.decode(token_ids, skip_special_tokens=True)

    return RolloutScheduler(groups["actor_infer"].handles, reward_fn, decode,
                            config.roles.actor_infer.max_in_flight_requests, seed=config.seed,
                            deterministic=rollout is None or rollout.deterministic, watchdog_s=config.cluster.watchdog_s)


def rollout_stream(config: RLVRConfig, scheduler: RolloutScheduler, sampler: Sampler,
                   sampling: SamplingParams) -> RolloutStream:
    """The run's training batches: the stream of prompt groups over `scheduler`, per `rollout.*` (staleness,
    refills, over-provisioning, long rounds) and `algorithm.difficulty_mask`."""
    rollout = config.rollout
    # no sample can be more versions old than the run has steps: a larger bound only draws prompts past the end
    settings = StreamSettings(rollout.prompts_per_step, min(rollout.max_staleness, config.train.steps),
                              rollout.refill_bound, rollout.overprovision, rollout.long_round_every,
                              config.algorithm.difficulty_mask, rollout.partial_rollout)
    domains = config.data.domains or {}

    def params_for(prompt: EncodedPrompt, params: SamplingParams) -> SamplingParams:
        """A domain's own response lengths (`data.domains.NAME.{max,min}_new_tokens`)."""
        domain = domains.get(prompt.row.get("domain"))
        if domain is None:
            return params
        return replace(params, max_new_tokens=domain.max_new_tokens or params.max_new_tokens,
                       min_new_tokens=domain.min_new_tokens)

    return RolloutStream(scheduler, sampler, sampling, settings, params_for)


def reference_logprobs(batch, groups: WorkerGroups, colocation: ColocationManager, reference_backend: str,
                       lora_phase: str = "old_logprobs") -> torch.Tensor:
    """[B, T] log-probs of the batch's responses under the frozen reference: the `reference` role's workers,
    or, when the run has none (LoRA), the base model inside `actor_train` with its adapters off, in the
    pipeline's phase `lora_phase` (one that onloads actor_train)."""
    if "reference" not in groups:
        colocation.enter(lora_phase)
        return groups["actor_train"].call("compute_reference_logprobs", batch)
    colocation.enter("reference")
    return forward_rows(groups["reference"], reference_backend, "compute_logprobs", batch)


def sync_weights(groups: WorkerGroups, colocation: ColocationManager, bucket_bytes: int, checksum: str,
                 corrupt: bool = False) -> dict[str, float]:
    """Publish the trainer's weights and load them into every engine worker (`weight_sync` phase).

    Args:
        groups: the run's workers (`actor_train`, `actor_infer`).
        colocation: moves roles for the phase.
        bucket_bytes: transfer piece size.
        checksum: "bucket" | "full" | "off" (`checks.weight_checksum`).
        corrupt: flip one byte after the checksum is taken (`checks.fault_injection_flip_sync_byte_at`).

    Returns:
        sync/ metrics. Raises `WeightSyncError` when an engine worker receives corrupted weights.
    """
    colocation.enter("weight_sync")
    trainer, engines = groups["actor_train"], groups["actor_infer"]
    if engines.host == "actor_train":  # a hybrid worker: the engine is in the trainer's process
        with span("weight_sync"):
            started = time.perf_counter()
            synced = trainer.call("sync_engine", bucket_bytes, checksum, corrupt)
        return {"sync/seconds": time.perf_counter() - started, "sync/bytes": synced["nbytes"],
                "sync/buckets": synced["num_buckets"], "sync/version": synced["version"],
                "sync/fetch_seconds_max": 0.0}
    with span("weight_sync"):
        started = time.perf_counter()
        manifest = trainer.call("weights_for_sync", bucket_bytes, checksum, corrupt)
        # broadcast transport: the trainer sends while the engines receive (the object store needs no call)
        sending = trainer.handles[0].send_weights.remote() if manifest.transport == "broadcast" else None
        loaded = engines.get(engines.call_async("update_weights", manifest), "update_weights")
        if sending is not None:
            trainer.get([sending], "send_weights")
    return {"sync/seconds": time.perf_counter() - started, "sync/bytes": manifest.nbytes,
            "sync/buckets": manifest.num_buckets, "sync/version": manifest.version,
            "sync/fetch_seconds_max": max(r["fetch_seconds"] for r in loaded)}


def evaluate(scheduler: RolloutScheduler, colocation: ColocationManager, prompts: list[EncodedPrompt],
             greedy: SamplingParams, step: int = 0) -> dict[str, float]:
    """Greedy completions of the eval prompts, scored with the run's rewards: `eval/` metrics."""
    if not prompts:
        return {}
    colocation.enter("rollout")
    with span("eval"):
        samples = scheduler.generate(prompts, greedy, seed_key=("eval", step)).samples
    check_some_succeeded(samples, f"eval at step {step}")
    return rollout_metrics(samples, prefix="eval")
