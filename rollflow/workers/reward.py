"""`reward` role: workers that run model rewards (LLM judge, reward model), a whole group per call.

A reward becomes a worker only when it needs a model or a service (`rollflow.rewards.ModelReward`); plain
reward functions stay on the driver. The `reward` role is placed, validated and offloaded like every other
role (`roles.reward`): each of its workers holds every model reward of the run. `RemoteReward` is the
driver's handle on one model reward: it sends each group to the least-loaded worker and returns the scores
as a Ray future, so the rollout core keeps collecting other groups' completions while a judge works.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from rollflow.cluster.groups import WorkerGroup
from rollflow.cluster.placement import WorkerPlacement
from rollflow.rewards import (
    CombinedReward,
    DomainRewards,
    ModelReward,
    combine_rewards,
    resolve_reward,
)
from rollflow.rewards.pool import RewardPool
from rollflow.rewards.registry import Row
from rollflow.workers.base import PlacedWorker, move_report
from rollflow.workers.specs import RewardSpec, torch_device


class RewardWorker(PlacedWorker):
    """One reward worker: builds every model reward's scorer once (loads the judge or reward model), then
    scores groups. An async actor: groups sent while one is being scored are served concurrently (an `hf`
    judge decodes them in one wave; an HTTP judge overlaps their requests).

    Args:
        placement: where this worker runs (its CPU share is its torch thread count).
        spec: the model rewards, name -> `ModelReward` with bound options (`model_rewards`), and the cluster's
            device (the scorers' models go on CUDA on a GPU cluster).
    """

    def __init__(self, placement: WorkerPlacement, spec: RewardSpec):
        super().__init__(placement, spec.device)
        device = torch_device(spec.device)
        self.scorers = {name: reward.build(device=device) for name, reward in spec.rewards.items()}

    async def score_group(self, name: str, completions: list[str], rows: list[Row]) -> list[Any]:
        """One value per completion of reward `name`: a float, a dict of floats, or a `ScoreError`."""
        self.require_resident("score_group")
        return await self.scorers[name].score_group(completions, rows)

    def offload(self) -> dict[str, float]:
        """Move the scorers' models off the device while a colocated role runs (no-op on CPU)."""
        return self._move("offload", resident=False)

    def onload(self) -> dict[str, float]:
        return self._move("onload", resident=True)

    def _move(self, action: str, resident: bool) -> dict[str, float]:
        started = time.perf_counter()
        if self.resident != resident:
            for scorer in self.scorers.values():
                move = getattr(scorer, action, None)  # a scorer with no model (an HTTP judge) has nothing
                if move is not None:
                    move()
        self.resident = resident
        return move_report(started)

    def close(self) -> None:
        for scorer in self.scorers.values():
            close = getattr(scorer, "close", None)
            if close is not None:
                close()


class RemoteReward:
    """The driver's handle on one model reward's workers (a `rollflow.rewards.GroupReward`).

    Args:
        name: the reward's name (its scorer's key on the workers).
        group: the `reward` role's worker group.
    """

    def __init__(self, name: str, group: WorkerGroup):
        self.name = name
        self.group = group
        self._in_flight: list[list[ray.ObjectRef]] = [[] for _ in group.handles]

    def submit(self, completions: list[str], rows: list[Row]) -> ray.ObjectRef:
        """Score a group on the least-loaded worker.

        Returns:
            A future of one value per completion (float, dict of floats or `ScoreError`).
        """
        for refs in self._in_flight:  # forget finished calls; what is left is each worker's load
            if refs:
                done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                for ref in done:
                    refs.remove(ref)
        index = min(range(len(self.group.handles)), key=lambda i: len(self._in_flight[i]))
        ref = self.group.handles[index].score_group.remote(self.name, completions, rows)
        self._in_flight[index].append(ref)
        return ref

    def wait(self, future: ray.ObjectRef) -> list[Any]:
        """The scores of a `submit`, bounded by the group's watchdog (`StalledError` past it)."""
        index = next((i for i, refs in enumerate(self._in_flight) if future in refs), 0)
        return self.group.get([future], "score_group", [index])[0]

    def close(self) -> None:
        """Nothing to release here: the workers belong to the run's `reward` group, shut down with it."""


def build_reward_fn(reward_config, group: WorkerGroup | None = None) -> CombinedReward | DomainRewards:
    """The weighted sum of the configured reward functions: `(completion, **row) -> (total, parts)`.

    Plain functions run on the driver; each model reward is scored by the `reward` role's workers. With
    `reward.domains`, a `DomainRewards` of one combination per domain listed there and `reward.functions`
    for the others; they share the reward pool and each model reward's handle.

    Args:
        reward_config: the `reward` config section.
        group: the started `reward` worker group; needed when a reward is a model reward.

    Raises:
        RewardLoadError: a reward that does not resolve, or a bad weight / name (one line).
    """
    pool = RewardPool(reward_config.num_threads, reward_config.timeout_s)
    remotes: dict[str, RemoteReward] = {}

    def combination(functions) -> CombinedReward:
        rewards = []
        for function in functions:
            fn = resolve_reward(function.name, function.kwargs)
            if isinstance(fn, ModelReward):
                if group is None:
                    raise ValueError(f"reward {function.name!r} is a model reward: start the reward role "
                                     "first")
                fn = remotes.setdefault(function.name, RemoteReward(function.name, group))
            rewards.append((function.name, fn, function.weight))
        return combine_rewards(rewards, pool)

    default = combination(reward_config.functions)
    if not reward_config.domains:
        return default
    return DomainRewards({name: combination(functions) for name, functions in reward_config.domains.items()},
                         default)
