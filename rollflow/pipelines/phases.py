"""Phases of a step that more than one pipeline runs, as functions of explicit arguments: weight sync from
the trainer to the engines, and greedy evaluation through the rollout core (its metrics, broken down by
`eval.group_by` columns, and its samples written to `eval_samples.jsonl`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from rollflow.cluster.colocation import ColocationManager
from rollflow.cluster.groups import WorkerGroups
from rollflow.data.prompts import EncodedPrompt
from rollflow.data.sample import Sample
from rollflow.engines.base import SamplingParams
from rollflow.errors import ConfigError
from rollflow.rollout.core import RolloutCore, Source
from rollflow.rollout.filters import check_some_succeeded
from rollflow.rollout.metrics import is_correct, rollout_metrics
from rollflow.rollout.prompt_groups import PromptGroups
from rollflow.rollout.settings import core_settings
from rollflow.spans import span
from rollflow.trackers.samples import write_samples
from rollflow.workers.reward import build_reward_fn
from rollflow.workers.roles import forward_rows


def prompt_rollout(config, groups: WorkerGroups, tokenizer, sampler: Source | None = None,
                   sampling: SamplingParams | None = None) -> RolloutCore:
    """The run's rollout core over its engine workers, playing prompt groups scored with its rewards (model
    rewards on the `reward` group, plain ones on a reward pool).

    For RLVR (`sampler` and `sampling` given) it draws training groups per `rollout.*` (staleness, refills,
    over-provisioning, long rounds, determinism) and `algorithm.difficulty_mask`; for a pipeline without a
    rollout section it only evaluates (deterministic).
    """
    rollout = getattr(config, "rollout", None)
    reward_fn = build_reward_fn(config.reward, groups.get("reward"))

    def decode(token_ids: list[int]) -> str:
        return tokenizer.decode(token_ids, skip_special_tokens=True)

    settings = core_settings(config, eval_only=sampler is None)
    if rollout is None or sampler is None:
        program = PromptGroups(reward_fn, decode, sampling or SamplingParams(), tag="eval")
        return RolloutCore(groups["actor_infer"].handles, program, None, settings)
    domains = config.data.domains or {}

    def params_for(prompt: EncodedPrompt, params: SamplingParams) -> SamplingParams:
        """A domain's own response lengths (`data.domains.NAME.{max,min}_new_tokens`)."""
        domain = domains.get(prompt.row.get("domain"))
        if domain is None:
            return params
        return replace(params, max_new_tokens=domain.max_new_tokens or params.max_new_tokens,
                       min_new_tokens=domain.min_new_tokens)

    program = PromptGroups(reward_fn, decode, sampling, params_for, config.algorithm.difficulty_mask)
    return RolloutCore(groups["actor_infer"].handles, program, sampler, settings)


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


def evaluate(core: RolloutCore, colocation: ColocationManager, prompts: list[EncodedPrompt],
             greedy: SamplingParams, step: int = 0, group_by: Sequence[str] = (),
             samples_path: Path | None = None) -> dict[str, float]:
    """Greedy completions of the eval prompts, scored with the run's rewards: `eval/` metrics.

    Args:
        core: the run's rollout core (`prompt_rollout`); its prompt program, greedy, plays the eval.
        colocation: moves roles for the `rollout` phase.
        prompts: the eval prompts (`PromptInputs.eval_prompts`).
        greedy: the eval's sampling (temperature 0).
        step: the step the eval follows (0: before training); seeds the eval and keys its samples.
        group_by: `eval.group_by`: columns whose values each get `eval/C=V/accuracy` and `eval/C=V/samples`.
        samples_path: append every decoded sample here (`eval_samples.jsonl`), one record per prompt with
            `step` and the `group_by` columns; None writes nothing.

    Returns:
        `rollout_metrics(..., prefix="eval")` and the `group_by` breakdown (`eval_group_metrics`).

    Raises:
        ConfigError: an eval row without a `group_by` column (`check_group_by`), before anything generates.
    """
    if not prompts:
        return {}
    check_group_by(prompts, group_by)
    colocation.enter("rollout")
    with span("eval"):
        samples = core.evaluate(prompts, core.program.for_eval(greedy), seed_key=("eval", step))
    if samples_path is not None:  # failed ones too, with their error: what to read when every sample failed
        write_samples(samples_path, step, samples, len(samples), columns=group_by)
    check_some_succeeded(samples, f"eval at step {step}")
    return {**rollout_metrics(samples, prefix="eval"), **eval_group_metrics(samples, group_by)}


def check_group_by(prompts: Sequence[EncodedPrompt], group_by: Sequence[str]) -> None:
    """Every eval row has every `eval.group_by` column (a null value is a group of its own, `C=null`).

    Raises:
        ConfigError: one line naming the first row without a column, and the columns it has.
    """
    for column in group_by:
        for number, prompt in enumerate(prompts, start=1):
            if column not in prompt.row:
                domain = prompt.row.get("domain")
                where = f"row {number} of the eval set" + (f" (domain {domain})" if domain is not None else "")
                raise ConfigError(f"eval.group_by: {where} has no column {column!r}; its columns: "
                                  f"{', '.join(sorted(prompt.row))}")


def eval_group_metrics(samples: Sequence[Sample], group_by: Sequence[str],
                       prefix: str = "eval") -> dict[str, float]:
    """Greedy accuracy (`rollflow.rollout.metrics.is_correct`) and sample count per value of each column.

    Args:
        samples: the eval's samples (one per eval row).
        group_by: the columns (`eval.group_by`).
        prefix: the metrics' first part.

    Returns:
        `{prefix}/C=V/accuracy` and `{prefix}/C=V/samples` for each column C and each value V it takes
        (`group_value` writes V).
    """
    metrics: dict[str, float] = {}
    for column in group_by:
        groups: dict[str, list[Sample]] = {}
        for sample in samples:
            groups.setdefault(group_value(sample.row.get(column)), []).append(sample)
        for value in sorted(groups):
            members = groups[value]
            metrics[f"{prefix}/{column}={value}/samples"] = float(len(members))
            metrics[f"{prefix}/{column}={value}/accuracy"] = statistics.fmean(is_correct(s) for s in members)
    return metrics


def group_value(value: Any) -> str:
    """A column value as the `V` of a metric name `eval/C=V/accuracy`: its text, `/` written `_` (a metric
    name's parts are split at `/`), `null` for None and `""` for the empty string."""
    if value is None:
        return "null"
    text = str(value).replace("/", "_")
    return text if text else '""'


def eval_summary_lines(final: Mapping[str, float], steps: int) -> list[str]:
    """The last lines of a run: eval accuracy at the start and after `steps`, overall and per `eval.group_by`
    value (the `eval/C=V/accuracy` keys of `final`; `initial_` prefixes the first eval's). Empty without an
    eval at both ends.

    Args:
        final: the run's final metrics, the first eval's under `initial_eval/...`.
        steps: `train.steps`.
    """
    lines = []
    for key in ["eval/accuracy", *sorted(k for k in final if _is_group_accuracy(k))]:
        initial = final.get(f"initial_{key}")
        if key not in final or initial is None:
            continue
        what = "" if key == "eval/accuracy" else f" {key.removeprefix('eval/').removesuffix('/accuracy')}"
        lines.append(f"eval accuracy{what}: {initial:.3f} at start -> {final[key]:.3f} after {steps} steps")
    return lines


def _is_group_accuracy(key: str) -> bool:
    """`eval/C=V/accuracy` (not a domain's `eval/D/accuracy`: a domain name has no `=`)."""
    parts = key.split("/")
    return len(parts) == 3 and parts[0] == "eval" and "=" in parts[1] and parts[2] == "accuracy"
