"""`reward` role: Ray actors that run model rewards (LLM judge, reward model), a whole group per call.

A reward becomes a worker only when it needs a model or a service (`rollflow.rewards.ModelReward`); plain
reward functions stay on the driver. `RemoteReward` is the driver's handle: it starts the workers on first
use and returns each group's scores as a Ray future, so the rollout scheduler keeps collecting other
groups' completions while a judge works.
"""

from __future__ import annotations

import os
import re
from typing import Any

import ray

from rollflow.cluster.runtime import pin_threads
from rollflow.rewards.registry import ModelReward, Row


class RewardWorkerError(RuntimeError):
    """A reward worker could not start (bad model path, missing API key, ...). One-line message."""


class RewardWorker:
    """One reward worker: builds the scorer once (loads the judge or reward model), then scores groups.

    An async actor: groups sent while one is being scored are served concurrently (an `hf` judge decodes
    them in one wave; an HTTP judge overlaps their requests).

    Args:
        reward: a `ModelReward` with bound options.
        num_cpus: this worker's CPU share; its torch / OpenMP thread count.
        device: torch device for the model ("cpu", "cuda").
        gpus: on "cuda", the GPU indices this worker may see (set as CUDA_VISIBLE_DEVICES before CUDA starts);
            () leaves the process's GPUs as they are.
    """

    def __init__(self, reward: ModelReward, num_cpus: float = 1.0, device: str = "cpu",
                 gpus: tuple[int, ...] = ()):
        if gpus and device.startswith("cuda"):
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        self.threads = pin_threads(num_cpus)
        self.scorer = reward.build(device=device)

    async def score_group(self, completions: list[str], rows: list[Row]) -> list[Any]:
        """One value per completion: a float, a dict of floats, or a `ScoreError`."""
        return await self.scorer.score_group(completions, rows)


class RemoteReward:
    """The driver's handle on one model reward's workers (a `rollflow.rewards.GroupReward`).

    Args:
        name: the reward's name (for messages).
        reward: the `ModelReward` from `resolve_reward`, options bound.
        num_workers: workers to start (`roles.reward.num_workers`); groups go to the least-loaded one.
        num_cpus: each worker's CPU share (`roles.reward.num_cpus`); it reserves 0 Ray CPUs, like the other
            roles' workers, and pins its threads to this share.
        device: torch device of the model ("cpu", or "cuda" on a GPU cluster).
        gpus: on "cuda", each worker's GPU indices (`num_workers` tuples; see `RewardWorker`).
        actor_options: extra Ray options for every worker (e.g. a placement-group scheduling strategy).
    """

    def __init__(self, name: str, reward: ModelReward, num_workers: int = 1, num_cpus: float = 1.0,
                 device: str = "cpu", gpus: list[tuple[int, ...]] | None = None,
                 actor_options: dict[str, Any] | None = None):
        if num_workers < 1:
            raise ValueError(f"reward {name!r}: num_workers must be >= 1, got {num_workers}")
        if gpus is not None and len(gpus) != num_workers:
            raise ValueError(f"reward {name!r}: {len(gpus)} GPU sets for {num_workers} workers")
        self.name = name
        self.reward = reward
        self.num_workers = num_workers
        self.num_cpus = num_cpus
        self.device = device
        self.gpus = gpus or [() for _ in range(num_workers)]
        self.actor_options = {"num_cpus": 0, **(actor_options or {})}
        self.workers: list[ray.actor.ActorHandle] = []
        self._in_flight: list[list[ray.ObjectRef]] = []
        self._ready = False

    def start(self, wait: bool = True) -> None:
        """Start the workers. `wait`: block until each has loaded its model (raises `RewardWorkerError`);
        without it they load in the background and the first `submit` waits (and raises) instead."""
        if not self.workers:
            actor = ray.remote(RewardWorker).options(**self.actor_options)
            self.workers = [actor.remote(self.reward, self.num_cpus, self.device, gpus) for gpus in self.gpus]
            self._in_flight = [[] for _ in self.workers]
            self._ready = False
        if wait and not self._ready:
            try:
                ray.get([worker.__ray_ready__.remote() for worker in self.workers])
            except ray.exceptions.RayError as error:
                self.close()
                raise RewardWorkerError(f"reward {self.name!r}: its reward worker failed to start: "
                                        f"{_root_cause(error)}") from None
            self._ready = True

    def submit(self, completions: list[str], rows: list[Row]) -> ray.ObjectRef:
        """Score a group on the least-loaded worker (starting the workers on first use).

        Returns:
            A future of one value per completion (float, dict of floats or `ScoreError`).
        """
        self.start()
        for refs in self._in_flight:  # forget finished calls; what is left is each worker's load
            if refs:
                done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                for ref in done:
                    refs.remove(ref)
        index = min(range(len(self.workers)), key=lambda i: len(self._in_flight[i]))
        ref = self.workers[index].score_group.remote(completions, rows)
        self._in_flight[index].append(ref)
        return ref

    def wait(self, future: ray.ObjectRef) -> list[Any]:
        return ray.get(future)

    def close(self) -> None:
        """Kill the workers (their processes); a later `submit` starts new ones."""
        for worker in self.workers:
            ray.kill(worker)
        self.workers, self._in_flight, self._ready = [], [], False


def _root_cause(error: BaseException) -> str:
    """The exception a failed actor constructor raised, as `Type: first line of its message`.

    Ray reports it as text: a traceback whose first unindented line after the last `File "..."` frame is
    the original `module.Type: message`.
    """
    lines = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).splitlines()
    frames = [i for i, line in enumerate(lines) if line.lstrip().startswith('File "')]
    for line in lines[frames[-1] + 1:] if frames else []:
        if line and not line[0].isspace():
            return re.sub(r"^[\w.]+\.(?=\w+: )", "", line)  # drop the module path of the type
    return lines[0] if lines else type(error).__name__
