"""Reward workers in a Ray session: the `reward` role is spawned, placed and offloaded like every role; a
model reward scores a whole group per call, off the driver, and the rollout core keeps collecting other
groups' completions while a group is being scored."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass

import pytest
import ray
import ray.cloudpickle

from rollflow.cluster.colocation import ColocationManager
from rollflow.cluster.groups import WorkerGroup, WorkerStartError, spawn_group
from rollflow.cluster.placement import WorkerPlacement
from rollflow.config import load_config
from rollflow.data.prompts import EncodedPrompt, PromptSampler
from rollflow.data.sample import SampleStatus
from rollflow.engines.base import Completion, CompletionOutput, GenerationRequest, SamplingParams
from rollflow.errors import WorkerError
from rollflow.pipelines.rl_step import PHASES
from rollflow.rewards import (
    CombinedReward,
    DomainRewards,
    ModelReward,
    RewardLoadError,
    ScoreError,
    combine_rewards,
    model_rewards,
    resolve_reward,
)
from rollflow.rewards.judge import LLMJudge
from rollflow.rollout.core import RolloutCore
from rollflow.rollout.prompt_groups import PromptGroups
from rollflow.rollout.settings import CoreSettings
from rollflow.workers.base import PlacedWorker
from rollflow.workers.reward import RemoteReward, RewardWorker, build_reward_fn
from rollflow.workers.roles import plan_roles
from rollflow.workers.specs import RewardSpec, reward_spec, torch_device

# Actors of this module's classes get them by value: their processes then skip this module's imports (torch
# among them, ~3 s of CPU on 2 cores), which importing the class from here would cost each of them.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ---- test doubles, imported by the Ray workers from this module ---------------------------------------
@dataclass(frozen=True, kw_only=True)
class RecordingOptions:
    delay_s: float = 1.0
    signals: str = ""  # the name of a `Signals` actor: scoring group k sets "scoring k"


class RecordingScorer:
    """A model reward that takes `delay_s` per group and reports when it started and finished (wall clock).
    With `signals`, it says when it starts scoring group k, and group 0's scores come only once groups 1-3
    are being scored too.

    Completion "2-1" cannot be scored (a `ScoreError`) and group 3 crashes the scorer, to exercise per-sample
    and per-group failures."""

    def __init__(self, options: RecordingOptions, device: str = "cpu"):
        self.delay_s = options.delay_s
        self.signals = ray.get_actor(options.signals) if options.signals else None
        self.moves: list[str] = []

    def offload(self):
        self.moves.append("offload")

    def onload(self):
        self.moves.append("onload")

    async def score_group(self, completions, rows):
        started = time.time()
        group = completions[0].split("-")[0]
        if self.signals is not None:
            await self.signals.set.remote(f"scoring {group}")
            if group == "0":
                await self.signals.wait.remote("scoring 1", "scoring 2", "scoring 3")
        await asyncio.sleep(self.delay_s)
        finished = time.time()
        if completions[0].startswith("3-"):
            raise RuntimeError("scorer crashed")
        return [ScoreError("cannot judge") if c == "2-1" else
                {"reward": float(c.endswith("-0")), "started": started, "finished": finished}
                for c in completions]


RECORDING = ModelReward(f"{__name__}:RecordingScorer", RecordingOptions)


class Signals:
    """Named events shared by the actors of a test: `set` one, `wait` for several."""

    def __init__(self):
        self.seen: set[str] = set()

    async def set(self, name: str) -> None:
        self.seen.add(name)

    async def wait(self, *names: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s  # a hang guard: the tests' waits take well under a second
        while not set(names) <= self.seen:
            assert time.monotonic() < deadline, f"waited {timeout_s:g} s for {sorted(set(names) - self.seen)}"
            await asyncio.sleep(0.01)


class StaggeredRolloutWorker:
    """A rollout worker whose group 0 (prompt ids [0]) is ready at once and group k > 0 once group 0 is being
    scored, then after k * `step_s` seconds."""

    def __init__(self, step_s: float, signals):
        self.step_s, self.signals = step_s, signals

    async def generate(self, request: GenerationRequest) -> Completion:
        group = request.prompt_ids[0]
        if group:
            await self.signals.wait.remote("scoring 0")
        await asyncio.sleep(group * self.step_s)
        outputs = [CompletionOutput([group, i], [0.0, 0.0], [0, 0]) for i in range(request.params.n)]
        return Completion(request.request_id, outputs, {"generated_at": time.time()})


class MovesRewardWorker(RewardWorker):
    """A real reward worker that also reports the moves its scorers were asked to make."""

    def moves(self, name: str) -> list[str]:
        return self.scorers[name].moves


class RecordingWorker(PlacedWorker):
    """Stands in for a trainer or engine worker: records offload / onload, holds no model."""

    def __init__(self, placement, config):
        super().__init__(placement)
        self.record: list[str] = []

    def offload(self):
        self.record.append("offload")
        return super().offload()

    def onload(self):
        self.record.append("onload")
        return super().onload()

    def moves(self):
        return self.record


# ---- tests ----------------------------------------------------------------------------------------------
JUDGE_OPTIONS = {"model_path": "tiny", "template": "{completion}+{offset}", "max_score": 200, "max_new_tokens": 4}
PLACEMENT = WorkerPlacement("reward", 0, (), None, (), threads=1)


def _config(*overrides):
    return load_config(None, ["rollout.groups_per_step=8", *overrides])


def _dead(group: WorkerGroup, timeout_s: float = 30.0) -> bool:
    """Whether the group's actor is gone within `timeout_s` (`ray.kill` returns before the actor is dead: a
    call made right after it may still be answered)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(group.handles[0].__ray_ready__.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.1)
    return False


def test_llm_judge_worker_scores_a_group_in_one_call(workers_not_kept):
    rewards = {"llm_judge": resolve_reward("llm_judge", JUDGE_OPTIONS)}
    group = spawn_group("reward", RewardWorker, [PLACEMENT], None, RewardSpec(rewards))
    try:
        group.wait_ready()
        remote = RemoteReward("llm_judge", group)
        completions = ["12", "40", "7", "33"]
        rows = [{"offset": str(k)} for k in (10, 20, 30, 40)]
        first = remote.submit(completions, rows)  # one call for the whole group ...
        second = remote.submit(completions[:2], rows[:2])  # ... and a second group while it runs
        assert isinstance(first, ray.ObjectRef)
        scores, scores_second = remote.wait(first), remote.wait(second)
        expected = asyncio.run(LLMJudge(rewards["llm_judge"].options).score_group(
            completions, rows))  # the same judge in this process
        assert scores == expected and scores_second == expected[:2]
        assert all(s["parse_failed"] == 0.0 for s in scores)
    finally:
        group.close()
    assert _dead(group)


def test_a_worker_that_cannot_start_is_a_one_line_error(ray_session, tmp_path):
    broken = tmp_path / "broken_judge"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "not_a_model"}))
    reward = resolve_reward("llm_judge", {"model_path": str(broken)})  # passes the driver-side path check
    started = time.perf_counter()
    group = spawn_group("reward", RewardWorker, [PLACEMENT], None, RewardSpec({"judge": reward}))
    assert time.perf_counter() - started < 5 and len(group) == 1  # loads in the background (~0.05 s) ...
    try:
        with pytest.raises(WorkerStartError, match=r"reward: a worker failed to start: .*") as info:
            group.wait_ready()  # ... and waiting for it finds out
    finally:
        group.close()
    assert "\n" not in str(info.value)
    # The constructor's own error, not Ray's wrapper and traceback.
    assert f"failed to start: cannot load model from '{broken}': " in str(info.value)
    assert "not_a_model" in str(info.value)
    assert _dead(group)  # the dead worker was let go


def test_scheduler_keeps_collecting_while_a_group_is_scored(ray_session):
    """Group 0 is generated first, and groups 1-3 only once it is being scored; its scores come only once
    groups 1-3 are being scored too: a core that waited for a group's scores before collecting or scoring
    the next would wait forever (the order is fixed, whatever the machine's speed)."""
    step_s, delay_s = 0.1, 2.0
    signals = ray.remote(num_cpus=0)(Signals).options(name="test_reward_worker_signals").remote()
    rollout = ray.remote(num_cpus=0)(StaggeredRolloutWorker).remote(step_s, signals)
    group = spawn_group("reward", RewardWorker, [PLACEMENT], None,
                        RewardSpec({"slow": RECORDING.bind({"delay_s": delay_s, "signals": "test_reward_worker_signals"},
                                                           "slow")}))
    remote = RemoteReward("slow", group)
    combined = combine_rewards([("exact", lambda c, **row: float(c == row["answer"]), 1.0), ("slow", remote, 0.5)])
    program = PromptGroups(combined, lambda ids: "-".join(map(str, ids)), SamplingParams(n=2))
    prompts = [EncodedPrompt({"answer": f"{k}-0"}, str(k), [k]) for k in range(4)]
    sampler = PromptSampler(prompts, 4, seed=0, shuffle=False)
    core = RolloutCore([rollout], program, sampler, CoreSettings(groups_per_step=4))
    group.wait_ready()  # model load is not what this test measures
    try:
        result = core.next_batch(1, 0)
    finally:
        group.close()
        core.close()
        ray.kill(signals)
        ray.kill(rollout)
    by_group = {k: [s for s in result.samples if s.prompt_ids == [k]] for k in range(4)}  # group k: prompt [k]
    assert len(result.samples) == 8 and all(len(samples) == 2 for samples in by_group.values())

    failed = [s for s in result.samples if s.status == SampleStatus.FAILED]
    assert sorted(s.response_text for s in failed) == ["2-1", "3-0", "3-1"]
    assert next(s for s in failed if s.response_text == "2-1").metadata["error"] == \
        "RewardScoreError: reward 'slow': cannot judge"  # one sample the scorer could not judge
    crashed = [s.metadata["error"] for s in by_group[3]]  # the whole group fails with the scorer
    # what the scorer raised first, then Ray's text with the worker's traceback
    assert all(e.splitlines()[0] == "RuntimeError: scorer crashed" and "RayTaskError(RuntimeError)" in e
               for e in crashed)
    scored = [s for s in result.samples if s.status != SampleStatus.FAILED]
    for sample in scored:  # exact: 1 for "k-0"; slow: 1 for "k-0"; total = 1.0 * exact + 0.5 * slow
        hit = float(sample.response_text.endswith("-0"))
        assert sample.rewards["exact"] == hit and sample.rewards["slow"] == hit
        assert sample.reward == pytest.approx(1.5 * hit)

    generated = [by_group[k][0].metadata["generated_at"] for k in range(4)]
    started = [scored_sample(by_group[k]).rewards["slow/started"] for k in range(3)]
    finished = [scored_sample(by_group[k]).rewards["slow/finished"] for k in range(3)]
    # Group 0 is scored while groups 1-3 are still generating ...
    assert finished[0] > generated[3]
    # ... and the core sends each group as it arrives instead of waiting for group 0's scores.
    assert max(started) < finished[0]
    assert result.metrics["time/reward"] < 0.5 * delay_s  # time the rollout's loop spent on rewards (~ms)
    # Serial scoring cannot finish (see above); overlapped it is about 0.3 s of generation + 2 s of scoring.
    assert delay_s <= result.metrics["time/rollout"] < 60  # (the upper bound: a hang guard)
    # after the last group's generation the loop only waits for scores: its scorer's 2 s, of which the loop's
    # waits count all but the one under way when generation ended (up to 1 s: the core checks then)
    assert result.metrics["time/reward_wait"] >= delay_s - 1.5


def scored_sample(samples):
    return next(s for s in samples if s.status != SampleStatus.FAILED)


def test_build_reward_fn_puts_model_rewards_on_workers_and_plain_ones_on_the_driver():
    config = _config("reward.functions=[{name: math_answer, weight: 1.0}, {name: llm_judge, weight: 0.5, "
                     "kwargs: {model_path: tiny, max_new_tokens: 4}}]")
    assert list(model_rewards(config.reward)) == ["llm_judge"]  # only what needs a model gets a worker
    group = WorkerGroup("reward", [], [])
    combined = build_reward_fn(config.reward, group)
    assert combined.kinds == ["plain", "group"]
    remote = combined.group_rewards[0]
    assert isinstance(remote, RemoteReward) and (remote.name, remote.group) == ("llm_judge", group)
    with pytest.raises(ValueError, match="model reward"):
        build_reward_fn(config.reward)  # no reward workers started
    # On GPUs the reward role's device_mapping is split over its workers like any role's.
    gpu = _config("cluster.device=gpu", "roles.actor_train.device_mapping=[0, 1]",
                  "roles.actor_infer.device_mapping=[2, 3]", "roles.reward.num_workers=2",
                  "roles.reward.device_mapping=[4, 5, 6, 7]")
    plan = plan_roles(gpu, ["actor_train", "actor_infer", "reward"], devices_per_node=8)
    assert [w.local_devices for w in plan.workers["reward"]] == [(4, 5), (6, 7)]
    assert torch_device(reward_spec(gpu).device) == "cuda"  # its scorers go on CUDA


JUDGE = "{name: llm_judge, weight: 0.5, kwargs: {model_path: tiny, max_new_tokens: 4}}"


def test_build_reward_fn_gives_each_domain_its_own_rewards():
    config = load_config("examples/multi_domain.yaml",
                         [f"reward.domains={{sum3: [{{name: exact_match}}, {JUDGE}]}}"])
    assert list(model_rewards(config.reward)) == ["llm_judge"]  # a domain's model reward starts workers too
    group = WorkerGroup("reward", [], [])
    rewards = build_reward_fn(config.reward, group)
    assert isinstance(rewards, DomainRewards)
    assert rewards.of("add2") is rewards.default and rewards.default.names == ["math_answer"]
    assert rewards.of("sum3").names == ["exact_match", "llm_judge"]
    assert rewards.of("sum3").kinds == ["plain", "group"]
    assert rewards.of("sum3").pool is rewards.default.pool  # one reward pool for the run
    pending = rewards.submit_group(["6"], [{"prompt": "1+2+3", "answer": "6", "domain": "add2"}])
    assert pending.futures == [] and pending.finish([]) == [(1.0, {"math_answer": 1.0})]
    rewards.close()
    plain = build_reward_fn(load_config("examples/multi_domain.yaml").reward)  # no reward.domains
    assert isinstance(plain, CombinedReward)
    plain.close()


def test_a_model_reward_must_have_one_configuration_across_domains():
    other = JUDGE.replace("max_new_tokens: 4", "max_new_tokens: 5")
    config = load_config("examples/multi_domain.yaml", [f"reward.functions=[{{name: math_answer}}, {JUDGE}]",
                                                        f"reward.domains={{sum3: [{other}]}}"])
    with pytest.raises(RewardLoadError, match="'llm_judge' has different kwargs in reward.functions and "
                                              "reward.domains.sum3"):
        model_rewards(config.reward)


@pytest.mark.slow  # three worker processes of this module's classes, each importing torch (~10 s on 2 cores)
def test_reward_workers_sharing_the_trainers_devices_are_offloaded_while_it_trains(ray_session):
    """The reward role is planned like the others: a device_mapping that overlaps actor_train's is reported
    as colocated, and its workers are offloaded while the trainer trains and onloaded for the rollout."""
    config = _config("roles.actor_train.device_mapping=[0]", "roles.actor_infer.device_mapping=[1]",
                     "roles.reward.device_mapping=[0]")
    roles = ["actor_train", "actor_infer", "reward"]
    plan = plan_roles(config, roles, devices_per_node=2)
    assert plan.colocated("reward", "actor_train") and not plan.colocated("reward", "actor_infer")
    assert "colocated (time-share, offload between phases): actor_train + reward" in plan.describe()
    groups = {role: spawn_group(role, RecordingWorker, plan.workers[role], None, config)
              for role in ("actor_train", "actor_infer")}
    groups["reward"] = spawn_group("reward", MovesRewardWorker, plan.workers["reward"], None,
                                   RewardSpec({"slow": RECORDING.bind({"delay_s": 0.0}, "slow")}, "cpu"))
    try:
        for group in groups.values():
            group.wait_ready()
        manager = ColocationManager(plan, groups, PHASES)
        manager.enter("rollout")  # the reward workers score during the rollout: the trainer leaves device 0
        assert groups["actor_train"].call("moves") == ["offload"]
        manager.enter("actor_train")  # the trainer needs device 0 back: the reward workers leave it
        assert groups["reward"].call("moves", "slow") == ["offload"]
        assert groups["actor_infer"].call("moves") == []  # disaggregated: never moves
        assert manager.resident["reward"] is False
        with pytest.raises(WorkerError, match="called while offloaded"):
            RemoteReward("slow", groups["reward"]).wait(
                RemoteReward("slow", groups["reward"]).submit(["x"], [{}]))
        manager.enter("rollout")  # back for the next rollout, and the trainer steps aside
        assert groups["reward"].call("moves", "slow") == ["offload", "onload"]
        assert groups["actor_train"].call("moves") == ["offload", "onload", "offload"]
        assert "offload/reward_seconds" in manager.pop_metrics()
    finally:
        for group in groups.values():
            group.close()
