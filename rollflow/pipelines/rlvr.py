"""RLVR pipeline: generate -> reward -> advantage -> train -> sync -> eval, one step at a time.

The driver (single controller) owns the loop; each role runs in its own Ray actor. Optional roles:
`reference` (KL terms, the opd teacher) and `critic` (values for GAE).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import ray
import torch

from rollflow.cluster.colocation import ColocationManager
from rollflow.cluster.groups import RoleWorkers, cluster_shape, create_role_workers, roles_needed
from rollflow.cluster.placement import plan_placement
from rollflow.cluster.runtime import pin_threads, start_ray, stop_ray
from rollflow.config import RunConfig, dump_config
from rollflow.data.prompts import PromptEncoder, PromptSampler
from rollflow.data.sample import Batch, collate
from rollflow.engines.base import SamplingParams
from rollflow.models import load_tokenizer
from rollflow.pipelines.rlvr_steps import (
    AdvantageStage,
    build_reward_fn,
    check_logprob_parity,
    drop_groups,
    load_dataset,
    rollout_metrics,
    usable,
    write_samples,
)
from rollflow.rollout.scheduler import RolloutScheduler
from rollflow.trackers import MetricsTracker
from rollflow.trackers.plots import plot_curves


def run_rlvr(config: RunConfig, manage_ray: bool = True) -> dict[str, float]:
    """Train with RL on verifiable rewards. Returns the final metrics (incl. initial/final eval accuracy).

    Args:
        config: the run config.
        manage_ray: start Ray (per `config.cluster`) and shut it down at the end. False runs in the caller's
            Ray session and leaves it up (tests run many short runs in one session).
    """
    pin_threads(1)  # the driver only routes and scores; workers do the heavy lifting
    tokenizer = load_tokenizer(config.model.path, config.model.trust_remote_code)
    data = config.data
    train_rows = load_dataset(data.train, data, config.seed)
    eval_rows = load_dataset(data.eval, data, config.seed) if data.eval else []
    encoder = PromptEncoder(tokenizer, data.prompt_key, data.apply_chat_template, data.max_prompt_tokens)
    eval_prompts = [encoder.encode(row) for row in eval_rows]
    reward_fn = build_reward_fn(config.reward, config.roles.reward, config.cluster.device)
    sampler = PromptSampler(train_rows, config.rollout.prompts_per_step, config.seed, data.shuffle)

    run_dir = config.run_dir
    checkpoints = run_dir / "checkpoints"
    resume_from = _latest_checkpoint(checkpoints) if config.resume else None
    if not resume_from and run_dir.exists():
        for stale in ("metrics.jsonl", "samples.jsonl"):
            (run_dir / stale).unlink(missing_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(config))

    with _running(config, manage_ray, reward_fn) as workers:
        algorithm, checks, output = config.algorithm, config.checks, config.output
        tracker = MetricsTracker(run_dir, config.output.trackers, config.train.steps)
        tracker.print(workers.plan.describe())
        write_placement(run_dir / "placement.json", workers)
        colocation = ColocationManager(workers.plan, {g.role: g for g in workers.groups})
        advantages = AdvantageStage(algorithm, config.rollout.max_new_tokens)
        scheduler = RolloutScheduler(workers.actor_infer.handles, reward_fn, _decoder(tokenizer),
                                     config.roles.actor_infer.max_in_flight_requests)
        rollout = config.rollout
        sampling = SamplingParams(rollout.max_new_tokens, rollout.temperature, rollout.top_p, rollout.top_k,
                                  n=rollout.samples_per_prompt)
        greedy = SamplingParams(config.eval.max_new_tokens or rollout.max_new_tokens, temperature=0.0)
        bucket_bytes = int(config.cluster.weight_sync_bucket_mb * 2**20)
        syncs = 0

        def sync_weights() -> dict[str, float]:
            nonlocal syncs
            syncs += 1
            colocation.enter("weight_sync")
            started = time.perf_counter()
            corrupt = syncs == checks.fault_injection_flip_sync_byte_at
            manifest = workers.actor_train.call("weights_for_sync", bucket_bytes, corrupt)
            sending = workers.actor_train.handles[0].send_weights.remote()  # broadcast transport only
            # each engine checks the checksum: a corrupted transfer raises WeightSyncError, stopping the run
            loaded = ray.get(workers.actor_infer.call_async("update_weights", manifest))
            ray.get(sending)
            return {"sync/seconds": time.perf_counter() - started, "sync/bytes": manifest.nbytes,
                    "sync/buckets": manifest.num_buckets, "sync/version": manifest.version,
                    "sync/fetch_seconds_max": max(r["fetch_seconds"] for r in loaded)}

        def train_on(batch: Batch, step: int) -> dict[str, float]:
            """Reference logprobs and values as needed, advantages, then the critic and actor updates."""
            if algorithm.needs_reference and workers.reference is None:  # LoRA: the base model, adapters off
                colocation.enter("old_logprobs")
                batch.extras["ref_logprobs"] = workers.actor_train.call("compute_reference_logprobs", batch)
            elif workers.reference is not None:
                colocation.enter("reference")
                batch.extras["ref_logprobs"] = workers.reference.map_rows("compute_logprobs", batch)
            if advantages.needs_policy_logprobs:
                colocation.enter("old_logprobs")
                batch.extras["old_logprobs"] = workers.actor_train.call("compute_logprobs", batch)
            if workers.critic is not None:
                colocation.enter("values")
                batch.extras["values"] = workers.critic.call("compute_values", batch)
            metrics = advantages(batch)
            if workers.critic is not None:
                colocation.enter("critic_train")
                metrics.update(workers.critic.call("train", batch))
            if step > config.train.critic_warmup_steps:
                colocation.enter("actor_train")
                metrics.update(workers.actor_train.call("train", batch))
            return metrics

        def evaluate() -> dict[str, float]:
            if not eval_prompts:
                return {}
            colocation.enter("rollout")
            return rollout_metrics(scheduler.generate(eval_prompts, greedy).samples, prefix="eval")

        first_step, initial_eval = 0, {}
        if resume_from:
            state = json.loads((resume_from / "driver_state.json").read_text())
            workers.actor_train.call("load", str(resume_from / "model"), state["step"])
            if workers.critic is not None:
                workers.critic.call("load", str(resume_from / "critic"))
            sampler.load_state(state["sampler"])
            advantages.load_state(state.get("advantage_stage"))
            first_step, initial_eval = state["step"], state.get("initial_eval", {})
            sync_weights()
            tracker.print(f"resumed from {resume_from} at step {first_step}")
        if not initial_eval:
            initial_eval = evaluate()
            tracker.log(first_step, initial_eval)
            tracker.print(f"initial eval accuracy {initial_eval.get('eval/accuracy', float('nan')):.3f}")

        metrics: dict[str, float] = {}
        for step in range(first_step + 1, config.train.steps + 1):
            step_started = time.perf_counter()
            prompts = [encoder.encode(row) for row in sampler.next_batch()]
            colocation.enter("rollout")
            result = scheduler.generate(prompts, sampling)
            samples = usable(result.samples)
            batch = collate(samples, tokenizer.pad_token_id)
            metrics = {**result.metrics, **rollout_metrics(result.samples)}
            if step == first_step + 1 and checks.logprob_parity_samples:
                probe = batch.select(torch.tensor(parity_probe(samples, checks.logprob_parity_samples)))
                colocation.enter("old_logprobs")
                trainer_logprobs = workers.actor_train.call("compute_logprobs", probe)
                metrics["check/logprob_max_abs_diff"] = check_logprob_parity(
                    probe, trainer_logprobs, checks.logprob_parity_tolerance)
            batch, filter_metrics = drop_groups(batch, algorithm)  # difficulty mask; may drop every group
            metrics.update(filter_metrics)
            if batch.size:
                metrics.update(train_on(batch, step))
            metrics.update(sync_weights())
            metrics.update(colocation.pop_metrics())
            if config.eval.every_steps and step % config.eval.every_steps == 0 or step == config.train.steps:
                metrics.update(evaluate())
            metrics["time/step"] = time.perf_counter() - step_started
            tracker.log(step, metrics)
            write_samples(run_dir / "samples.jsonl", step, result.samples, output.samples_logged_per_step)
            if step == config.train.steps or output.save_every_steps and step % output.save_every_steps == 0:
                _save_checkpoint(checkpoints / f"step_{step}", workers, step, sampler, advantages,
                                 initial_eval)

        final = {**{f"initial_{k}": v for k, v in initial_eval.items()}, **metrics}
        if "eval/accuracy" in final and "initial_eval/accuracy" in final:
            tracker.print(f"eval accuracy: {final['initial_eval/accuracy']:.3f} at start -> "
                          f"{final['eval/accuracy']:.3f} after {config.train.steps} steps")
        tracker.close()
        plot_curves(run_dir)
    return final


@contextlib.contextmanager
def _running(config: RunConfig, manage_ray: bool, reward_fn):
    """Start Ray (if managed), the model rewards' workers and every role's workers; on the way out, normal
    or not, stop them all."""
    if manage_ray:
        start_ray(config.cluster.address, config.cluster.num_cpus)
    workers = None
    try:
        reward_fn.start(wait=False)  # a judge model loads while the other workers start
        workers = create_role_workers(config)
        yield workers
    finally:
        reward_fn.close()
        if workers is not None:
            workers.shutdown()
        if manage_ray:
            stop_ray()


def describe_plan(config: RunConfig) -> str:
    """The placement plan of `config` as `rollflow train --print-plan` prints it. Joins the Ray cluster
    when `cluster.address` is set (to count its nodes); otherwise plans for this machine without Ray."""
    if config.cluster.address:
        start_ray(config.cluster.address)
        try:
            devices_per_node, num_nodes = cluster_shape(config)
        finally:
            stop_ray()
    else:
        local = len(os.sched_getaffinity(0)) if config.cluster.device == "cpu" else torch.cuda.device_count()
        devices_per_node, num_nodes = config.cluster.num_devices or config.cluster.num_cpus or local, 1
    return plan_placement(config, roles_needed(config), devices_per_node, num_nodes).describe()


def _save_checkpoint(path: Path, workers: RoleWorkers, step: int, sampler: PromptSampler,
                     advantages: AdvantageStage, initial_eval: dict) -> None:
    """Model (HF format) + optimizer/RNG from the trainer (and critic); step, data position, reward and KL
    statistics from the driver."""
    path.mkdir(parents=True, exist_ok=True)
    workers.actor_train.call("save", str(path / "model"))
    if workers.critic is not None:
        workers.critic.call("save", str(path / "critic"))
    state = {"step": step, "sampler": sampler.state(), "advantage_stage": advantages.state(),
             "initial_eval": initial_eval}
    (path / "driver_state.json").write_text(json.dumps(state))


def _latest_checkpoint(checkpoints: Path) -> Path | None:
    done = [p for p in checkpoints.glob("step_*") if (p / "driver_state.json").is_file()]
    return max(done, key=lambda p: int(p.name.removeprefix("step_")), default=None)


def parity_probe(samples: list, count: int) -> list[int]:
    """Row indices of up to `count` samples per inference-engine worker, so the step-0 logprob check
    covers every engine."""
    taken: dict[int, int] = {}
    rows = []
    for row, sample in enumerate(samples):
        worker = sample.metadata.get("worker", 0)
        if taken.get(worker, 0) < count:
            taken[worker] = taken.get(worker, 0) + 1
            rows.append(row)
    return rows


def write_placement(path: Path, workers: RoleWorkers) -> None:
    """Where each worker of each role actually runs (node ids from Ray), next to the plan's devices."""
    placement = {group.role: [{"worker": p.index, "node": node, "devices": list(p.devices)}
                              for p, node in zip(group.placements, group.nodes())]
                 for group in workers.groups}
    path.write_text(json.dumps(placement, indent=1))


def _decoder(tokenizer):
    def decode(token_ids: list[int]) -> str:
        return tokenizer.decode(token_ids, skip_special_tokens=True)

    return decode
