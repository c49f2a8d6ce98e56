"""RLVR pipeline: generate -> reward -> advantage -> train -> sync -> eval, one step at a time.

The driver (single controller) owns the loop; each role runs in its own Ray actor. Optional roles:
`reference` (KL terms, the opd teacher) and `critic` (values for GAE).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import ray

from rollflow.cluster.groups import RoleWorkers, create_role_workers
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
    reward_fn = build_reward_fn(config.reward)
    sampler = PromptSampler(train_rows, config.rollout.prompts_per_step, config.seed, data.shuffle)

    run_dir = config.run_dir
    checkpoints = run_dir / "checkpoints"
    resume_from = _latest_checkpoint(checkpoints) if config.resume else None
    if not resume_from and run_dir.exists():
        for stale in ("metrics.jsonl", "samples.jsonl"):
            (run_dir / stale).unlink(missing_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(config))

    if manage_ray:
        start_ray(config.cluster.address, config.cluster.num_cpus)
    algorithm = config.algorithm
    workers = create_role_workers(config, with_reference=algorithm.needs_reference,
                                  with_critic=algorithm.needs_critic)
    advantages = AdvantageStage(algorithm, config.rollout.max_new_tokens)
    scheduler = RolloutScheduler(workers.actor_infer, reward_fn, _decoder(tokenizer))
    tracker = MetricsTracker(run_dir, config.output.trackers, config.train.steps)
    rollout = config.rollout
    sampling = SamplingParams(rollout.max_new_tokens, rollout.temperature, rollout.top_p, rollout.top_k,
                              n=rollout.samples_per_prompt)
    greedy = SamplingParams(config.eval.max_new_tokens or rollout.max_new_tokens, temperature=0.0)

    def sync_weights() -> dict[str, float]:
        started = time.perf_counter()
        payload = workers.actor_train.weights_for_sync.remote()
        versions = ray.get([w.update_weights.remote(payload) for w in workers.actor_infer])
        nbytes = ray.get(payload)[3]
        return {"sync/seconds": time.perf_counter() - started, "sync/bytes": nbytes, "sync/version": versions[0]}

    def train_on(batch: Batch, step: int) -> dict[str, float]:
        """Reference logprobs and values as needed, advantages, then the critic and actor updates."""
        if workers.reference is not None:
            batch.extras["ref_logprobs"] = ray.get(workers.reference.compute_logprobs.remote(batch))
        if advantages.needs_policy_logprobs:
            batch.extras["old_logprobs"] = ray.get(workers.actor_train.compute_logprobs.remote(batch))
        if workers.critic is not None:
            batch.extras["values"] = ray.get(workers.critic.compute_values.remote(batch))
        metrics = advantages(batch)
        if workers.critic is not None:
            metrics.update(ray.get(workers.critic.train.remote(batch)))
        if step > config.train.critic_warmup_steps:
            metrics.update(ray.get(workers.actor_train.train.remote(batch)))
        return metrics

    def evaluate() -> dict[str, float]:
        if not eval_prompts:
            return {}
        return rollout_metrics(scheduler.generate(eval_prompts, greedy).samples, prefix="eval")

    first_step, initial_eval = 0, {}
    if resume_from:
        state = json.loads((resume_from / "driver_state.json").read_text())
        ray.get(workers.actor_train.load.remote(str(resume_from / "model"), state["step"]))
        if workers.critic is not None:
            ray.get(workers.critic.load.remote(str(resume_from / "critic")))
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
        result = scheduler.generate(prompts, sampling)
        samples = usable(result.samples)
        batch = collate(samples, tokenizer.pad_token_id)
        metrics = {**result.metrics, **rollout_metrics(result.samples)}
        if step == first_step + 1 and config.checks.logprob_parity_samples:
            probe = batch.select(slice(0, config.checks.logprob_parity_samples))
            trainer_logprobs = ray.get(workers.actor_train.compute_logprobs.remote(probe))
            metrics["check/logprob_max_abs_diff"] = check_logprob_parity(
                probe, trainer_logprobs, config.checks.logprob_parity_tolerance)
        batch, filter_metrics = drop_groups(batch, algorithm)  # difficulty mask; may drop every group
        metrics.update(filter_metrics)
        if batch.size:
            metrics.update(train_on(batch, step))
        metrics.update(sync_weights())
        if config.eval.every_steps and step % config.eval.every_steps == 0 or step == config.train.steps:
            metrics.update(evaluate())
        metrics["time/step"] = time.perf_counter() - step_started
        tracker.log(step, metrics)
        write_samples(run_dir / "samples.jsonl", step, result.samples, config.output.samples_logged_per_step)
        if step == config.train.steps or config.output.save_every_steps and step % config.output.save_every_steps == 0:
            _save_checkpoint(checkpoints / f"step_{step}", workers, step, sampler, advantages, initial_eval)

    final = {**{f"initial_{k}": v for k, v in initial_eval.items()}, **metrics}
    if "eval/accuracy" in final and "initial_eval/accuracy" in final:
        tracker.print(f"eval accuracy: {final['initial_eval/accuracy']:.3f} at start -> "
                      f"{final['eval/accuracy']:.3f} after {config.train.steps} steps")
    tracker.close()
    plot_curves(run_dir)
    if manage_ray:
        stop_ray()
    else:
        _kill_workers(workers)
    return final


def _save_checkpoint(path: Path, workers: RoleWorkers, step: int, sampler: PromptSampler,
                     advantages: AdvantageStage, initial_eval: dict) -> None:
    """Model (HF format) + optimizer/RNG from the trainer (and critic); step, data position, reward and KL
    statistics from the driver."""
    path.mkdir(parents=True, exist_ok=True)
    ray.get(workers.actor_train.save.remote(str(path / "model")))
    if workers.critic is not None:
        ray.get(workers.critic.save.remote(str(path / "critic")))
    state = {"step": step, "sampler": sampler.state(), "advantage_stage": advantages.state(),
             "initial_eval": initial_eval}
    (path / "driver_state.json").write_text(json.dumps(state))


def _latest_checkpoint(checkpoints: Path) -> Path | None:
    done = [p for p in checkpoints.glob("step_*") if (p / "driver_state.json").is_file()]
    return max(done, key=lambda p: int(p.name.removeprefix("step_")), default=None)


def _kill_workers(workers: RoleWorkers) -> None:
    """End this run's actors (their processes) when the Ray session outlives the run."""
    for worker in [workers.actor_train, *workers.actor_infer, workers.reference, workers.critic]:
        if worker is not None:
            ray.kill(worker)


def _decoder(tokenizer):
    def decode(token_ids: list[int]) -> str:
        return tokenizer.decode(token_ids, skip_special_tokens=True)

    return decode
