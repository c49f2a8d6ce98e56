"""Workers get a typed spec of their role, built from the run config on the driver (`rollflow.workers.specs`):
what each role reads is in its spec, the run config is in none of them, and a config error a spec finds comes
before any worker starts."""

from __future__ import annotations

import dataclasses

import pytest
import ray.cloudpickle

from rollflow.config import RunConfigBase, load_config
from rollflow.errors import ConfigError
from rollflow.pipelines.plan import Candidate, simulated_overrides
from rollflow.workers.actor_loss import ActorLoss
from rollflow.workers.objectives import CriticLoss, NLLLoss
from rollflow.workers.specs import (
    EngineSpec,
    EnvSpec,
    RewardSpec,
    TrainerSpec,
    torch_device,
    trainer_spec,
    worker_specs,
)

JUDGE = "reward.functions=[{name: math_answer}, {name: llm_judge, weight: 0.5, kwargs: {model_path: tiny}}]"
ROLES = ["actor_train", "actor_infer", "reference", "critic", "reward"]


def _ppo(*overrides: str) -> RunConfigBase:
    return load_config("examples/ppo_gae.yaml", ["algorithm.kl_loss_coef=0.1", "train.critic_lr=3e-4",
                                                 "train.lr=1e-5", "train.steps=10", "train.critic_warmup_steps=2",
                                                 "roles.reference.model_path=tiny", JUDGE, *overrides])


def _holds_config(value, depth: int = 0) -> bool:
    """Whether `value` holds a run config anywhere in its fields (dataclasses, mappings, objects' attributes)."""
    if isinstance(value, RunConfigBase):
        return True
    if depth > 4:
        return False
    if dataclasses.is_dataclass(value):
        children = [getattr(value, field.name) for field in dataclasses.fields(value)]
    elif isinstance(value, dict):
        children = list(value.values())
    elif isinstance(value, (list, tuple)):
        children = list(value)
    else:
        children = list(getattr(value, "__dict__", {}).values())
    return any(_holds_config(child, depth + 1) for child in children)


def test_each_role_reads_its_own_spec_and_none_holds_the_run_config():
    config = _ppo()
    specs = worker_specs(config, ROLES)
    actor, critic, reference = specs["actor_train"], specs["critic"], specs["reference"]
    assert all(isinstance(specs[role], TrainerSpec) for role in ("actor_train", "critic", "reference"))
    # the actor: the run's LR over the optimizer steps it takes after the critic's warm-up, its policy loss
    assert actor.settings.lr == 1e-5 and actor.settings.total_steps == config.actor_optimizer_steps == (10 - 2) * 2
    assert isinstance(actor.loss, ActorLoss) and actor.loss.kl_coef == 0.1 and actor.mini_batches == 2
    # the critic: its own LR over every step, a value head, the clipped value loss
    assert critic.settings.lr == 3e-4 and critic.settings.value_head and critic.settings.total_steps == 10 * 2
    assert isinstance(critic.loss, CriticLoss) and critic.loss.value_clip == config.algorithm.value_clip
    # the reference: frozen, the model it is told to load, no loss
    assert not reference.settings.trainable and reference.settings.model_path == "tiny" and reference.loss is None
    assert {actor.temperature, reference.temperature} == {config.rollout.temperature}
    engine = specs["actor_infer"]
    assert isinstance(engine, EngineSpec) and (engine.engine, engine.model_path, engine.seed) == (
        config.roles.actor_infer.engine, config.model.path, config.seed)
    assert isinstance(specs["reward"], RewardSpec) and list(specs["reward"].rewards) == ["llm_judge"]
    assert not any(_holds_config(spec) for spec in specs.values())
    # they travel to the workers as they are (the losses included)
    for role, spec in specs.items():
        assert ray.cloudpickle.loads(ray.cloudpickle.dumps(spec)).__class__ is type(spec), role


def test_the_env_spec_is_the_env_section_and_the_seed():
    config = load_config("examples/agentic_frozenlake.yaml", ["seed=7"])
    spec = worker_specs(config, ["env"])["env"]
    assert spec == EnvSpec(config.env, 7, "cpu")


def test_the_objective_is_the_pipelines_and_an_unknown_one_is_named():
    config = _ppo()
    assert isinstance(trainer_spec(config, "actor_train", "nll").loss, NLLLoss)
    with pytest.raises(Exception, match="unknown training objective 'nl'. Did you mean 'nll'"):
        trainer_spec(config, "actor_train", "nl")


def test_a_gpu_cluster_puts_the_models_on_cuda():
    gpu = _ppo("cluster.device=gpu", "roles.actor_train.device_mapping=[0]", "roles.actor_infer.device_mapping=[1]")
    specs = worker_specs(gpu, ROLES)
    assert {specs[role].settings.device for role in ("actor_train", "critic", "reference")} == {"cuda"}
    assert {specs[role].device for role in ROLES} == {"gpu"} and torch_device(specs["reward"].device) == "cuda"


SIMULATED = simulated_overrides(Candidate(1, 1, False, 0), "h800-7b", 50.0, 16, 256, 2)


def test_a_simulated_cluster_gives_each_simulating_role_its_settings():
    config = load_config("examples/quickstart.yaml", SIMULATED)
    specs = worker_specs(config, ["actor_train", "actor_infer"])
    assert specs["actor_train"].sim == specs["actor_infer"].sim == config.cluster.sim
    assert worker_specs(load_config("examples/quickstart.yaml"), ["actor_train"])["actor_train"].sim is None


def test_a_role_that_would_run_a_model_on_a_simulated_cluster_is_a_config_error():
    # the config checks actor_train's backend and the engine; a reference's backend is known once it is a role
    config = load_config("examples/quickstart.yaml", [*SIMULATED, "algorithm.kl_loss_coef=0.1",
                                                      "roles.reference.backend=torch"])
    with pytest.raises(ConfigError, match="cluster.device sim: roles.reference.backend is torch; set it to sim"):
        worker_specs(config, ["actor_train", "actor_infer", "reference"])


def test_a_spec_error_is_one_line_before_any_worker_starts(cli, tmp_path):
    result = cli("train", "examples/quickstart.yaml", *SIMULATED, "algorithm.kl_loss_coef=0.1",
                 "roles.reference.backend=torch", f"output.dir={tmp_path}")
    assert result.returncode != 0
    assert result.stderr.strip() == ("rollflow: error: cluster.device sim: roles.reference.backend is torch; set it "
                                     "to sim (a simulated cluster runs no model)")
    assert "starting workers" not in result.stdout
