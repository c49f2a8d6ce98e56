"""`rollflow eval`: greedy decoding of a model on an eval dataset, scored with the config's rewards.

It starts its workers the way every pipeline does (`rollflow.workers.roles.running_roles`): the
`actor_infer` role, and the `reward` role when a reward needs a model.
"""

from __future__ import annotations

from rollflow.cluster.runtime import pin_threads
from rollflow.config import RLVRConfig
from rollflow.engines.base import SamplingParams
from rollflow.errors import ConfigError
from rollflow.pipelines.phases import rollout_scheduler
from rollflow.pipelines.preflight import check_inputs
from rollflow.rollout.metrics import rollout_metrics
from rollflow.trackers.samples import write_samples
from rollflow.workers.reward import model_rewards
from rollflow.workers.roles import running_roles


def run_eval(config: RLVRConfig, manage_ray: bool = True) -> dict[str, float]:
    """Greedy accuracy and reward of `config.model` on `config.data.eval` (or every domain's `eval`, each also
    as `eval/NAME/accuracy`); writes eval samples to the run dir."""
    pin_threads(1)
    data = config.data
    if data.eval is None and not any(domain.eval for domain in (data.domains or {}).values()):
        raise ConfigError("no eval dataset: set data.eval, or a domain's eval (or pass --data FILE.jsonl)")
    rewards = model_rewards(config.reward)
    roles = ["actor_infer", "reward"] if rewards else ["actor_infer"]
    inputs = check_inputs(config, roles, train=False)
    tokenizer, prompts = inputs.tokenizer, inputs.eval_prompts
    with running_roles(config, roles, {"reward": (rewards,)}, manage_ray) as groups:
        scheduler = rollout_scheduler(config, groups, tokenizer)
        greedy = SamplingParams(config.eval.max_new_tokens or config.rollout.max_new_tokens, temperature=0.0)
        samples = scheduler.generate(prompts, greedy).samples
    config.run_dir.mkdir(parents=True, exist_ok=True)
    write_samples(config.run_dir / "eval_samples.jsonl", 0, samples, len(samples))
    return rollout_metrics(samples, prefix="eval")
