"""What each role's worker is given: a typed spec of its role, built from the run config on the driver
(`worker_specs`), instead of the whole config.

A worker reads only its spec, so what it depends on is written down here: a trainer role gets its backend's
settings and its loss, the engine role its engine's arguments, the reward role its model rewards, the env role
its env section. The config errors a spec finds (a role that would run a model on a simulated cluster) come
from the driver, before Ray starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from rollflow.backends.settings import TrainerSettings
from rollflow.errors import ConfigError

# The roles whose workers hold a training backend.
TRAINER_ROLES = ("actor_train", "critic", "reference")


@dataclasses.dataclass(frozen=True)
class TrainerSpec:
    """A trainer role's worker (`actor_train`, `critic`, `reference`): the backend it builds and how it trains.

    Args:
        role: the role.
        backend: a `rollflow.backends` name; backend_kwargs: that backend's own keyword arguments.
        settings: what every backend takes (model, optimizer, schedule, device).
        seed: the run's seed (model init; each update's mini-batch split).
        device: `cluster.device` ("cpu", "gpu" or "sim").
        sim: `cluster.sim` on a simulated cluster (the backend's `simulation`, sized by the worker's devices),
            else None.
        temperature: the temperature logprobs are taken at (the engines sampled at it).
        mini_batches: optimizer steps per `train` call (`train.optimizer_steps_per_step`).
        loss: `loss_fn(output, micro_batch, normalizer) -> (loss, metrics)` the role trains (the actor's
            objective, the critic's value loss); None for a frozen reference.
        old_logprobs: `algorithm.old_logprobs` ("current" or "exact": actor_train keeps the weights of the
            last `kept_versions` versions, `rollflow.workers.old_logprobs`).
        kept_versions: `rollout.max_staleness + 1`.
    """

    role: str
    backend: str
    settings: TrainerSettings
    backend_kwargs: Mapping[str, Any]
    seed: int
    device: str = "cpu"
    sim: Any = None
    temperature: float = 1.0
    mini_batches: int = 1
    loss: Any = None
    old_logprobs: str = "current"
    kept_versions: int = 1


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """The `actor_infer` worker's engine: `create_engine(engine, model_path=..., ...)`.

    Args:
        engine: a `rollflow.engines` name; engine_kwargs: its own keyword arguments.
        model_path, dtype, trust_remote_code: the model.
        max_batch_size: sequences decoded together.
        seed: the run's seed (each engine worker samples from a seed derived from it and its index).
        device: `cluster.device`; sim: `cluster.sim` on a simulated cluster, else None.
    """

    engine: str
    model_path: str
    dtype: str
    max_batch_size: int
    seed: int
    trust_remote_code: bool = False
    engine_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    device: str = "cpu"
    sim: Any = None


@dataclasses.dataclass(frozen=True)
class HybridSpec:
    """The worker that serves `actor_train` and its engine in one process (`roles.actor_infer.hybrid`)."""

    trainer: TrainerSpec
    engine: EngineSpec


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """A `reward` worker: the model rewards it scores with (`model_rewards`: name -> `ModelReward`, options
    bound) and `cluster.device` (their models go on CUDA on a GPU cluster)."""

    rewards: Mapping[str, Any]
    device: str = "cpu"


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """An `env` worker: the `env` section (id, kwargs, time limits, fault injection), the run's seed and
    `cluster.device`."""

    env: Any
    seed: int
    device: str = "cpu"


def torch_device(device: str) -> str:
    """The torch device of a worker's model on a cluster of `device`s: "cuda" for GPUs, else "cpu"."""
    return "cuda" if device == "gpu" else "cpu"


def sampling_temperature(config) -> float:
    """The temperature the engines sampled at, which logprobs are taken at (1 for a pipeline without
    a rollout section, which samples nothing)."""
    rollout = getattr(config, "rollout", None)
    return rollout.temperature if rollout is not None else 1.0


def trainer_settings(config, **overrides) -> TrainerSettings:
    """The backend settings every trainer role shares, from the run config; `overrides` are the role's own
    (the critic's LR, the reference's frozen weights and model path, ...)."""
    train = config.train
    rollout = getattr(config, "rollout", None)  # the generation limit, for seq_mean_token_sum_norm
    settings = dict(
        model_path=config.model.path, dtype=config.model.dtype, trust_remote_code=config.model.trust_remote_code,
        lr=train.lr, betas=tuple(train.betas), weight_decay=train.weight_decay, warmup_steps=train.warmup_steps,
        lr_schedule=train.lr_schedule, total_steps=train.steps * train.optimizer_steps_per_step,
        max_grad_norm=train.max_grad_norm, micro_batch_size=train.train_micro_batch_size,
        max_response_length=rollout.max_new_tokens if rollout is not None else None,
        device=torch_device(config.cluster.device), on_nonfinite=train.on_nonfinite,
        freeze_vision_tower=getattr(config.model, "freeze_vision_tower", False),
    )
    return TrainerSettings(**{**settings, **overrides})


def simulated(config, role: str, component: str):
    """`cluster.sim` when the cluster is simulated (`cluster.device: sim`), else None.

    Raises:
        ConfigError: a role that would run real model math on a simulated cluster.
    """
    if config.cluster.device != "sim":
        return None
    if component != "sim":
        kind = "engine" if role == "actor_infer" else "backend"
        raise ConfigError(f"cluster.device sim: roles.{role}.{kind} is {component}; set it to sim (a simulated "
                          "cluster runs no model)")
    return config.cluster.sim


def trainer_spec(config, role: str, objective: str = "policy_gradient") -> TrainerSpec:
    """The spec of trainer role `role` (`TRAINER_ROLES`); actor_train trains `objective` (an `OBJECTIVES`
    name)."""
    section, train = config.roles.of(role), config.train
    common = dict(role=role, backend=section.backend, backend_kwargs=dict(section.backend_kwargs), seed=config.seed,
                  device=config.cluster.device, sim=simulated(config, role, section.backend),
                  temperature=sampling_temperature(config), mini_batches=train.optimizer_steps_per_step)
    if role == "actor_train":
        from rollflow.workers.objectives import OBJECTIVES

        lora = section.lora.model_dump() if section.lora is not None else None
        settings = trainer_settings(config, lr=train.lr, lora=lora, total_steps=config.actor_optimizer_steps)
        algorithm, rollout = getattr(config, "algorithm", None), getattr(config, "rollout", None)
        old = dict(old_logprobs=getattr(algorithm, "old_logprobs", "current"),
                   kept_versions=(getattr(rollout, "max_staleness", 0) or 0) + 1)
        return TrainerSpec(settings=settings, loss=OBJECTIVES.get(objective)(config), **old, **common)
    if role == "critic":
        from rollflow.workers.objectives import CriticLoss

        algorithm = config.algorithm
        return TrainerSpec(settings=trainer_settings(config, lr=train.critic_lr, value_head=True),
                           loss=CriticLoss(algorithm.loss_aggregation, algorithm.value_clip), **common)
    if role == "reference":
        settings = trainer_settings(config, model_path=section.model_path or config.model.path, trainable=False)
        return TrainerSpec(settings=settings, **common)
    raise ValueError(f"{role} is not a trainer role ({', '.join(TRAINER_ROLES)})")


def engine_spec(config) -> EngineSpec:
    """The spec of the `actor_infer` role's engine."""
    role, model = config.roles.actor_infer, config.model
    return EngineSpec(engine=role.engine, model_path=model.path, dtype=model.dtype, max_batch_size=role.max_batch_size,
                      seed=config.seed, trust_remote_code=model.trust_remote_code,
                      engine_kwargs=dict(role.engine_kwargs), device=config.cluster.device,
                      sim=simulated(config, "actor_infer", role.engine))


def reward_spec(config) -> RewardSpec:
    """The spec of the `reward` role: the configured model rewards.

    Raises:
        RewardLoadError: a reward that does not resolve, or one model reward configured with two sets of
            options.
    """
    from rollflow.rewards import model_rewards

    return RewardSpec(model_rewards(config.reward), config.cluster.device)


def env_spec(config) -> EnvSpec:
    """The spec of the `env` role."""
    return EnvSpec(config.env, config.seed, config.cluster.device)


def worker_specs(config, roles: Sequence[str], objective: str = "policy_gradient") -> dict[str, Any]:
    """Each of `roles`' worker spec, from the run config; actor_train trains `objective`."""
    specs: dict[str, Any] = {}
    for role in roles:
        if role in TRAINER_ROLES:
            specs[role] = trainer_spec(config, role, objective)
        elif role == "actor_infer":
            specs[role] = engine_spec(config)
        elif role == "reward":
            specs[role] = reward_spec(config)
        elif role == "env":
            specs[role] = env_spec(config)
        else:
            raise ValueError(f"no worker spec for role {role!r}")
    return specs
