"""Creating each role's workers as Ray actors.

Colocated roles (the CPU default) time-share their CPU slots: the pipeline runs one phase at a time, so a
worker reserves no Ray CPUs for scheduling but pins its torch threads to its role's `num_cpus`.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray

from rollflow.config import RunConfig


@dataclass
class RoleWorkers:
    actor_train: ray.actor.ActorHandle
    actor_infer: list[ray.actor.ActorHandle]
    reference: ray.actor.ActorHandle | None
    critic: ray.actor.ActorHandle | None = None


def create_role_workers(config: RunConfig, with_reference: bool, with_critic: bool = False) -> RoleWorkers:
    """Start the workers of every role this run needs and wait until they are ready.

    Args:
        config: the run config.
        with_reference: start the frozen `reference` worker (KL terms, the opd teacher).
        with_critic: start the `critic` worker (value model for GAE).
    """
    from rollflow.workers.actor_train import ActorTrainWorker
    from rollflow.workers.critic import CriticWorker
    from rollflow.workers.reference import ReferenceWorker
    from rollflow.workers.rollout import RolloutWorker

    roles = config.roles
    for name in ("actor_train", "critic"):
        if getattr(roles, name).num_workers != 1:
            raise NotImplementedError(f"data-parallel {name} (num_workers > 1) needs the fsdp2 backend")
    actor_train = ray.remote(num_cpus=0)(ActorTrainWorker).options(name=None).remote(
        config, roles.actor_train.num_cpus)
    actor_infer = [
        ray.remote(num_cpus=0)(RolloutWorker).remote(config, roles.actor_infer.num_cpus, index)
        for index in range(roles.actor_infer.num_workers)
    ]
    reference = critic = None
    if with_reference:
        reference = ray.remote(num_cpus=0)(ReferenceWorker).remote(_reference_config(config),
                                                                   roles.reference.num_cpus)
    if with_critic:
        critic = ray.remote(num_cpus=0)(CriticWorker).remote(config, roles.critic.num_cpus)
    # Surface construction errors (bad model path, ...) now, not at the first call.
    optional = [worker for worker in (reference, critic) if worker is not None]
    ray.get([actor_train.__ray_ready__.remote(), *[w.__ray_ready__.remote() for w in actor_infer],
             *[w.__ray_ready__.remote() for w in optional]])
    return RoleWorkers(actor_train, actor_infer, reference, critic)


def _reference_config(config: RunConfig) -> RunConfig:
    """The config the reference worker sees: `model.path` replaced by `roles.reference.model_path` if set."""
    teacher = config.roles.reference.model_path
    if teacher is None:
        return config
    return config.model_copy(update={"model": config.model.model_copy(update={"path": teacher})})
