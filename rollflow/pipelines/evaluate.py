"""`rollflow eval`: greedy decoding of a model on an eval dataset, scored with the config's rewards."""

from __future__ import annotations

import ray

from rollflow.cluster.placement import WorkerPlacement
from rollflow.cluster.runtime import pin_threads, start_ray, stop_ray
from rollflow.config import RunConfig
from rollflow.data.prompts import PromptEncoder
from rollflow.engines.base import SamplingParams
from rollflow.errors import ConfigError
from rollflow.models import load_tokenizer
from rollflow.pipelines.rlvr_steps import build_reward_fn, load_dataset, rollout_metrics, write_samples
from rollflow.rollout.scheduler import RolloutScheduler
from rollflow.workers.rollout import RolloutWorker


def run_eval(config: RunConfig) -> dict[str, float]:
    """Greedy accuracy and reward of `config.model` on `config.data.eval`; writes eval samples to the run dir."""
    pin_threads(1)
    data = config.data
    if data.eval is None:
        raise ConfigError("no eval dataset: set data.eval (or pass --data FILE.jsonl)")
    tokenizer = load_tokenizer(config.model.path, config.model.trust_remote_code)
    rows = load_dataset(data.eval, data, config.seed)
    encoder = PromptEncoder(tokenizer, data.prompt_key, data.apply_chat_template, data.max_prompt_tokens)
    prompts = [encoder.encode(row) for row in rows]
    reward_fn = build_reward_fn(config.reward, config.roles.reward, config.cluster.device)
    start_ray(config.cluster.address, config.cluster.num_cpus)
    try:
        role = config.roles.actor_infer
        threads = max(1, int(role.num_cpus))
        placements = [WorkerPlacement("actor_infer", i, (), None, (), threads) for i in range(role.num_workers)]
        workers = [ray.remote(num_cpus=0)(RolloutWorker).remote(config, p) for p in placements]
        scheduler = RolloutScheduler(workers, reward_fn,
                                     lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        greedy = SamplingParams(config.eval.max_new_tokens or config.rollout.max_new_tokens, temperature=0.0)
        samples = scheduler.generate(prompts, greedy).samples
    finally:
        reward_fn.close()
        stop_ray()
    config.run_dir.mkdir(parents=True, exist_ok=True)
    write_samples(config.run_dir / "eval_samples.jsonl", 0, samples, len(samples))
    return rollout_metrics(samples, prefix="eval")
