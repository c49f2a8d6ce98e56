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


def create_role_workers(config: RunConfig, with_reference: bool) -> RoleWorkers:
    """Start the workers of every role this run needs and wait until they are ready."""
    from rollflow.workers.actor_train import ActorTrainWorker
    from rollflow.workers.reference import ReferenceWorker
    from rollflow.workers.rollout import RolloutWorker

    roles = config.roles
    if roles.actor_train.num_workers != 1:
        raise NotImplementedError("data-parallel actor_train (num_workers > 1) needs the fsdp2 backend")
    actor_train = ray.remote(num_cpus=0)(ActorTrainWorker).options(name=None).remote(
        config, roles.actor_train.num_cpus)
    actor_infer = [
        ray.remote(num_cpus=0)(RolloutWorker).remote(config, roles.actor_infer.num_cpus, index)
        for index in range(roles.actor_infer.num_workers)
    ]
    reference = (ray.remote(num_cpus=0)(ReferenceWorker).remote(config, roles.reference.num_cpus)
                 if with_reference else None)
    # Surface construction errors (bad model path, ...) now, not at the first call.
    ray.get([actor_train.__ray_ready__.remote(), *[w.__ray_ready__.remote() for w in actor_infer],
             *([reference.__ray_ready__.remote()] if reference else [])])
    return RoleWorkers(actor_train, actor_infer, reference)
