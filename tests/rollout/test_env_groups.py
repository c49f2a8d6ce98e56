"""The env-group program on the rollout core, against a scripted engine and real `EnvWorker`s (called
in-process): token-exact trajectories, step-wise samples, groups with redundancy, failed and hung envs, and
the core's policy on env groups: staleness, resume, rounds (lockstep and deterministic), tail batching."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch
from ray.exceptions import ActorDiedError
from transformers import AutoTokenizer

from rollflow.cluster.placement import WorkerPlacement
from rollflow.config.agentic import AgenticConfig
from rollflow.data.multiturn import TurnEncoder
from rollflow.data.sample import SampleStatus, TurnSpan, collate
from rollflow.data.seeds import derive_seed
from rollflow.engines.base import Completion, CompletionOutput, SamplingParams
from rollflow.errors import WorkerDiedError
from rollflow.models import resolve_model_path
from rollflow.rollout.core import RolloutCore
from rollflow.rollout.env_groups import EnvGroups, EpisodeSettings, SeedSource
from rollflow.rollout.episode_advantages import EpisodeAdvantages
from rollflow.rollout.episodes import episode_metrics, no_episodes_error
from rollflow.rollout.settings import CoreSettings
from rollflow.workers.env import EnvWorker
from rollflow.workers.specs import env_spec

TOKENIZER = AutoTokenizer.from_pretrained(resolve_model_path("tiny"))
EOS = TOKENIZER.eos_token_id


class Remote:
    """`handle.method.remote(...)` for an in-process object: the call's coroutine (or value)."""

    def __init__(self, target):
        self.target = target

    def __getattr__(self, name):
        method = getattr(self.target, name)
        return SimpleNamespace(remote=method)


class ScriptedEngine:
    """Answers every turn with `action` (+ EOS), logprob -0.5 per token, tagged with its version; records
    every prompt it was given. `delay(request)` seconds before answering; `held(request)`: not before that
    request is aborted (slower than any other, whatever the machine's speed)."""

    def __init__(self, action: str = "Right", delay=lambda request: 0.0, held=lambda request: False):
        self.action_ids = TOKENIZER(action, add_special_tokens=False)["input_ids"] + [EOS]
        self.delay, self.held, self.version = delay, held, 0
        self.prompts: list[list[int]] = []
        self.outputs: list[list[int]] = []
        self.aborted: list[str] = []
        self.batches: list[list[int]] = []

    async def generate(self, request):
        self.prompts.append(list(request.prompt_ids))
        await asyncio.sleep(self.delay(request))
        if self.held(request):
            await until(lambda: request.request_id in self.aborted)
        ids = list(self.action_ids)
        self.outputs.append(ids)
        return Completion(request.request_id, [CompletionOutput(ids, [-0.5] * len(ids), [self.version] * len(ids))])

    async def generate_batch(self, requests):
        self.batches.append([len(r.prompt_ids) for r in requests])
        return [await self.generate(request) for request in requests]

    def abort(self, request_ids):
        self.aborted += request_ids


async def until(condition, timeout_s: float = 60.0) -> None:
    """Poll `condition` on the running loop until it holds (a hang guard: the waits take well under 1 s)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s:g} s"
        await asyncio.sleep(0.005)


def env_worker(env: dict, index: int = 0) -> EnvWorker:
    config = AgenticConfig.model_validate({"env": env})
    placement = WorkerPlacement("env", index, (), None, (), 1)
    return EnvWorker(placement, env_spec(config))


CORE = ("groups_per_step", "max_refill_groups", "max_staleness", "lockstep", "deterministic", "overprovision",
        "long_round_every")


def rollout(engine, env: dict, workers: int = 1, env_workers=None, **settings) -> RolloutCore:
    """A core playing env groups of `env` with `engine`; `settings`: the core's and the episodes' knobs."""
    core = {"groups_per_step": 2, "watchdog_s": 60.0, **{k: v for k, v in settings.items() if k in CORE}}
    episodes = {"group_size": 2, "max_turns": 8, "max_context_tokens": 256, "step_timeout_s": 5.0,
                **{k: v for k, v in settings.items() if k not in CORE}}
    envs = env_workers or [Remote(env_worker(env, i)) for i in range(workers)]
    program = EnvGroups(envs, TurnEncoder(TOKENIZER), EpisodeSettings(**episodes), SamplingParams(6))
    return RolloutCore([Remote(engine)], program, SeedSource(0, 1_000_000), CoreSettings(**core))


def evaluate(envs: RolloutCore, seeds: list[int]):
    return envs.evaluate(seeds, envs.program.for_eval(SamplingParams(6, temperature=0.0)))


def played(result) -> list:
    """The samples a step trains on (failed episodes' samples left out)."""
    return [s for s in result.samples if s.status not in (SampleStatus.FAILED, SampleStatus.FILTERED)]


def failed(result) -> list:
    return [s for s in result.samples if s.status == SampleStatus.FAILED]


# A map where "Right" x3 then "Down" x3 reaches the goal; "Right" alone walks into the wall and stays there.
CORRIDOR = ["P___", "OOO_", "OOO_", "OOOG"]


def test_trajectories_train_on_exactly_the_tokens_the_engine_sampled():
    engine = ScriptedEngine("Right")
    envs = rollout(engine, {"id": "frozenlake", "kwargs": {"fixed_map": CORRIDOR, "max_turns": 5}})
    try:
        result = envs.next_batch(1, 0)
    finally:
        envs.close()
    samples = played(result)
    assert len(samples) == 4 and all(s.metadata["turns"] == 5 for s in samples)  # truncated at max_turns
    batch = collate(samples, TOKENIZER.pad_token_id)
    for row, sample in enumerate(samples):
        full = sample.prompt_ids + sample.response_ids
        spans = [(span.start, span.end) for span in sample.turn_spans]
        assert [span.turn for span in sample.turn_spans] == list(range(5))
        for start, end in spans:
            # every turn's prompt is the trajectory so far (history is never re-tokenized), and its tokens follow
            assert full[:len(sample.prompt_ids) + start] in engine.prompts
            assert sample.response_ids[start:end] == engine.action_ids
        trained = batch.input_ids[row, batch.prompt_length:][batch.response_mask[row] > 0].tolist()
        assert trained == engine.action_ids * 5  # only the sampled tokens
        assert batch.rollout_logprobs[row][batch.response_mask[row] > 0].eq(-0.5).all()
        versions = batch.policy_versions[row, :len(sample.response_ids)]
        assert (versions[batch.response_mask[row, :len(sample.response_ids)] == 0] == -1).all()
    # the text the engine saw is the chat template's rendering of the conversation
    conversation = []
    first = samples[0]
    for start in (span.start for span in first.turn_spans):
        prompt = first.prompt_ids + first.response_ids[:start]
        observation = TOKENIZER.decode(prompt, skip_special_tokens=False).split("<|user|>")[-1]
        conversation += [{"role": "user", "content": observation.removesuffix("<|assistant|>")},
                         {"role": "assistant", "content": "Right"}]
    rendered = TOKENIZER.apply_chat_template(conversation, tokenize=False)
    assert TOKENIZER.decode(first.prompt_ids + first.response_ids, skip_special_tokens=False) == rendered


def test_step_samples_carry_one_turn_each_and_the_advantages_land_on_their_tokens():
    engine = ScriptedEngine("Right")
    envs = rollout(engine, {"id": "frozenlake", "kwargs": {"fixed_map": CORRIDOR, "max_turns": 4}},
                   samples="step", history_turns=1, group_size=3, groups_per_step=1)
    try:
        result = envs.next_batch(1, 0)
    finally:
        envs.close()
    samples = played(result)
    assert len(samples) == 3 * 4 and all(s.loss_mask == [1] * len(s.response_ids) for s in samples)
    second = samples[1]  # turn 1 of episode 0: its prompt holds turn 0 (history_turns 1)
    assert second.turn_spans == [TurnSpan(1, 0, len(second.response_ids))]
    assert TOKENIZER.decode(second.prompt_ids, skip_special_tokens=False).count("<|user|>") == 2
    batch = collate(samples, TOKENIZER.pad_token_id)
    algorithm = AgenticConfig.model_validate({"algorithm": {"advantage": "step_reinforce"}}).algorithm
    EpisodeAdvantages(algorithm)(batch)
    # every step returns 0 (the wall): all step advantages are 0, on every token
    assert batch.extras["advantages"].abs().sum() == 0
    assert (batch.extras["segment_ids"][batch.response_mask > 0] == 0).all()


def test_redundant_groups_keep_the_first_finishers_and_abort_the_rest():
    slow = []

    def held(request):  # slot 0's first turn answers only once aborted (its seed names it; the resets race)
        if request.params.seed == derive_seed(0, "turn", 0, 0, 0):
            slow.append(request.request_id)
            return True
        return False

    engine = ScriptedEngine("Right", held=held)
    envs = rollout(engine, {"id": "frozenlake", "kwargs": {"fixed_map": CORRIDOR, "max_turns": 2}},
                   groups_per_step=1, group_size=2, group_redundancy=1)
    try:
        result = envs.next_batch(1, 0)
    finally:
        envs.close()
    assert [s.episode.key[1] for s in played(result)] == [1, 2]  # slot 0 was the slow one
    assert result.metrics["rollout/aborted"] == 1
    assert slow and engine.aborted == slow  # did not wait for the slow episode (held till then): aborted it


def test_failing_and_hanging_envs_fail_their_episodes_and_never_the_step():
    engine = ScriptedEngine("Right")
    faults = {"raise_fraction": 0.2, "hang_fraction": 0.05, "hang_s": 60.0}
    envs = rollout(engine, {"id": "frozenlake", "kwargs": {"fixed_map": CORRIDOR, "max_turns": 3},
                            "step_timeout_s": 0.5, "fault_injection": faults},
                   workers=2, groups_per_step=4, group_size=2, group_redundancy=2, max_refill_groups=32)
    try:
        started = time.perf_counter()
        results = [envs.next_batch(step, 0) for step in (1, 2)]
        elapsed = time.perf_counter() - started
    finally:
        envs.close()
    assert sum(r.metrics["rollout/failed"] for r in results) > 0  # with 20% + 5% faulty steps some episodes fail
    for result in results:
        assert result.metrics["rollout/groups/consumed"] == 4
        assert len({s.group_id for s in played(result)}) == 4 and len(played(result)) == 8
    assert elapsed < 30  # hangs cost their 0.5 s limit, not 60 s


def test_when_every_episode_fails_the_step_has_no_groups_and_each_failure_says_why():
    engine = ScriptedEngine("Right")
    envs = rollout(engine, {"id": "frozenlake", "kwargs": {"fixed_map": CORRIDOR, "max_turns": 3},
                            "fault_injection": {"raise_fraction": 1.0}}, groups_per_step=2, group_size=2,
                   max_refill_groups=1)
    try:
        result = envs.next_batch(1, 0)
        evaluated = evaluate(envs, [1_000_000])
    finally:
        envs.close()
    assert played(result) == [] and result.metrics["rollout/groups/failed"] == 3  # two and the one refill allowed
    assert len(failed(result)) == 6 and result.metrics["rollout/failed"] == 6
    assert {s.metadata["error"] for s in failed(result)} == \
        {"env step raised InjectedFault: injected fault: the env raised"}
    assert all("Traceback" in s.metadata["error_details"] for s in failed(result))
    error = no_episodes_error("step 1", failed(result), 0, 2)
    assert str(error) == ("step 1: all 6 episodes failed; the first failed with: env step raised InjectedFault: "
                          "injected fault: the env raised")
    assert error.details.startswith("episode errors:\n6 x env step raised InjectedFault") and "Traceback" in error.details
    assert evaluated[0].status.value != "failed"  # eval envs have no faults


def test_an_eval_episode_that_fails_keeps_its_own_error():
    engine = ScriptedEngine("Right")
    envs = rollout(engine, {"id": "frozenlake", "eval_kwargs": {"size": 3, "max_turns": 1}})
    try:
        [sample] = evaluate(envs, [1_000_000])
    finally:
        envs.close()
    assert sample.status.value == "failed"
    assert sample.metadata["error"] == \
        "env constructor raised ConfigError: frozenlake: a 3x3 map needs max_turns >= 4, got 1"


class DeadEnvWorker:
    """An env worker whose process is gone: every call fails as Ray says a dead actor's calls fail."""

    def __getattr__(self, name):
        async def dead(*args):
            raise ActorDiedError()
        return SimpleNamespace(remote=lambda *args: None if name == "close_slot" else dead(*args))


def test_a_dead_env_worker_stops_the_rollout_with_one_line():
    envs = rollout(ScriptedEngine("Right"), {}, env_workers=[DeadEnvWorker()])
    try:
        started = time.perf_counter()
        with pytest.raises(WorkerDiedError, match=r"^env worker 0 died during reset \(killed, or out of memory\?\)"):
            envs.next_batch(1, 0)
        assert time.perf_counter() - started < 30  # a hang guard (~0.1 s): the watchdog would take 60 s
    finally:
        envs.close()


def test_a_hung_env_step_returns_an_error_within_its_time_limit():
    worker = env_worker({"id": "frozenlake", "step_timeout_s": 0.3,
                         "fault_injection": {"hang_fraction": 1.0, "hang_s": 30.0}})

    async def play():
        reset = await worker.reset("a", 1)
        started = time.perf_counter()
        step = await worker.step("a", "Down")
        return reset, step, time.perf_counter() - started

    reset, step, elapsed = asyncio.run(play())
    assert "observation" in reset
    assert step["error"].startswith("env step ran past env.step_timeout_s")
    assert elapsed < 10  # its 0.3 s limit, not the 30 s hang (a hang guard: a loaded machine adds some)
    assert worker.stats()["stranded"] == 1 and "a" not in worker.slots
    assert asyncio.run(worker.step("a", "Down"))["error"].startswith("env slot 'a' is not open")


def test_lockstep_turns_wait_for_every_episode_of_the_step():
    order = []

    def delay(request):
        order.append(len(request.prompt_ids))
        return 0.0

    engine = ScriptedEngine("Right", delay)
    envs = rollout(engine, {"id": "frozenlake", "kwargs": {"fixed_map": CORRIDOR, "max_turns": 3}},
                   lockstep=True)
    try:
        envs.next_batch(1, 0)
    finally:
        envs.close()
    # 4 episodes x 3 turns; a turn's prompts are longer than the last turn's, and all 4 come before the next,
    # in one batch per turn
    assert len(order) == 12 and engine.batches == [order[:4], order[4:8], order[8:]]
    assert max(order[:4]) < min(order[4:8]) and max(order[4:8]) < min(order[8:])


def test_deterministic_env_rounds_give_the_same_batches_whatever_the_env_timings():
    """Deterministic rounds for env groups: each turn of the step's episodes goes out as one batch per engine,
    in (group, slot) order, so the engine sees the same batches whatever order the envs answer in."""
    seen = []
    for jitter in (0.0, 0.05):
        engine = ScriptedEngine("Right")
        env = {"id": "frozenlake", "kwargs": {"fixed_map": CORRIDOR, "max_turns": 3},
               "simulated_latency": {"median_s": 0.01 + jitter, "sigma": 1.0}}
        envs = rollout(engine, env, deterministic=True)
        try:
            result = envs.next_batch(1, 0)
        finally:
            envs.close()
        seen.append((engine.batches, [s.response_ids for s in played(result)]))
    assert seen[0] == seen[1] and len(seen[0][0]) == 3 and all(len(batch) == 4 for batch in seen[0][0])


def test_tail_batching_cuts_the_slowest_env_groups_and_plays_them_in_a_long_round():
    """Over-provisioned env groups: a step keeps the first groups that finish, cuts the rest (their turns are
    aborted) and plays them later in a long round."""
    slow_seed = SeedSource(0, 1_000_000).take(3)[2]
    engine = ScriptedEngine("Right")
    envs = rollout(engine, {"id": "frozenlake", "kwargs": {"fixed_map": CORRIDOR, "max_turns": 2},
                            "simulated_latency": {"median_s": 0.01, "sigma": 0.0}},
                   groups_per_step=2, overprovision=1.5, long_round_every=2)
    original = envs.program._episode

    async def slow_group_episode(episode, play):  # the third group's env is slow: it starts once cut
        if episode.seed == slow_seed and not play.group.long:
            await until(lambda: play.group.cut)
        return await original(episode, play)

    envs.program._episode = slow_group_episode
    try:
        first = envs.next_batch(1, 0)
        second = envs.next_batch(2, 1)
    finally:
        envs.close()
    assert slow_seed not in {s.metadata["seed"] for s in played(first)}
    assert first.metrics["rollout/groups/aborted"] == 1 and first.metrics["rollout/long_queue"] == 1
    assert second.metrics["rollout/long_round"] == 1 and slow_seed in {s.metadata["seed"] for s in played(second)}


def test_episode_metrics_count_success_and_invalid_actions():
    engine = ScriptedEngine("jump")
    envs = rollout(engine, {"id": "frozenlake", "kwargs": {"fixed_map": CORRIDOR, "max_turns": 2}})
    try:
        samples = evaluate(envs, [5, 6, 7])
    finally:
        envs.close()
    metrics = episode_metrics(samples, "eval")
    assert metrics["eval/success"] == 0 and metrics["eval/invalid_action_frac"] == 1.0
    assert metrics["eval/return"] == pytest.approx(-0.2)  # two invalid turns at -0.1
    assert torch.isfinite(torch.tensor(list(metrics.values()))).all()


def test_a_resumed_rollout_starts_only_the_next_steps_groups_with_new_seeds():
    env = {"id": "frozenlake", "kwargs": {"fixed_map": CORRIDOR, "max_turns": 2}}
    first = rollout(ScriptedEngine("Right"), env)
    try:
        before = first.next_batch(1, 0)
        state = first.state()
    finally:
        first.close()
    resumed = rollout(ScriptedEngine("Right"), env)
    try:
        resumed.load_state(state)
        after = resumed.next_batch(2, 0)
        left_over = len(resumed._ready) + len(resumed._live) + len(resumed._queue)
    finally:
        resumed.close()
    assert after.metrics["rollout/groups/consumed"] == 2 and left_over == 0  # step 2's groups only
    assert {s.metadata["seed"] for s in played(after)}.isdisjoint({s.metadata["seed"] for s in played(before)})


class PausingEngine(ScriptedEngine):
    """The first turn it is asked for stops after one token, mid-response, until it is aborted (it answers that
    token, sampled by the version it started with, finish reason `abort`) or released (the whole move); every
    other request is answered at once with the whole move."""

    def __init__(self):
        super().__init__("Right")
        self.holding, self.released = False, False

    async def generate(self, request):
        if self.holding:
            return await super().generate(request)
        self.prompts.append(list(request.prompt_ids))
        self.holding, version = True, self.version
        await until(lambda: request.request_id in self.aborted or self.released)
        if request.request_id in self.aborted:
            ids, versions, reason = self.action_ids[:1], [version], "abort"
        else:
            ids, versions, reason = list(self.action_ids), [version] * len(self.action_ids), "stop"
        return Completion(request.request_id, [CompletionOutput(ids, [-0.5] * len(ids), versions, reason)])


@pytest.mark.parametrize("mode", ["continue", "resubmit"])
def test_the_agentic_pipelines_core_honours_partial_rollout(mode):
    """`rollout.partial_rollout` reaches the agentic run's core (it once built its settings without it): with
    `resubmit`, new weights abort the turn in flight and it is sent again as its prompt and its first token,
    which keeps its version; with `continue` nothing is aborted."""
    import threading

    from rollflow.pipelines.agentic import env_rollout

    env = {"id": "frozenlake", "kwargs": {"fixed_map": CORRIDOR, "max_turns": 1}, "max_turns": 1}
    # one group in flight (synchronous: an asynchronous core would start the next step's group beside it)
    config = AgenticConfig.model_validate({
        "env": env, "rollout": {"partial_rollout": mode, "groups_per_step": 1, "group_size": 1}})
    engine = PausingEngine()
    settings = EpisodeSettings(group_size=1, max_turns=1, max_context_tokens=256, step_timeout_s=5.0)
    core = env_rollout(config, [Remote(engine)], [Remote(env_worker(env))], TurnEncoder(TOKENIZER), settings,
                       SamplingParams(8))
    results = []
    stepping = threading.Thread(target=lambda: results.append(core.next_batch(1, 0)))
    try:
        stepping.start()
        deadline = time.monotonic() + 60
        while not engine.holding:  # a hang guard: the first turn is asked for at once
            assert time.monotonic() < deadline, "the engine was never asked for a turn"
            time.sleep(0.01)
        engine.version = 1
        core.weights_updated()  # `resubmit`: the abort has reached the engine when this returns
        aborted = list(engine.aborted)
        engine.released = True  # `continue` (and a core that ignored the mode): the turn goes on
        stepping.join(timeout=60)
    finally:
        core.close()
    sample, = played(results[0])
    action = engine.action_ids
    if mode == "resubmit":
        assert aborted and results[0].metrics["rollout/resubmitted_samples"] == 1
        assert engine.prompts[1] == engine.prompts[0] + action[:1]  # prompt + its token so far
        assert sample.response_ids == action[:1] + action  # the scripted engine answers a whole move again
        assert sample.policy_versions == [0] + [1] * len(action)
    else:
        assert not aborted and results[0].metrics["rollout/resubmitted_samples"] == 0
        assert sample.response_ids == action and sample.policy_versions == [0] * len(action)
