"""Multi-turn rollout against environments, with environment-level asynchrony.

`EnvRollout` plays episodes on the env workers with the engine workers' policy. Every episode is a coroutine
of its own on one event loop (a thread of the driver): reset its env, then turn after turn ask an engine for
the model's tokens (the episode stays on one engine worker, which can reuse its cached prefix) and step the
env with their text. No barrier between envs: a slow env holds up only its own episode.

Groups: every episode of a group plays the same seed. A group starts `group_size + group_redundancy`
episodes and keeps the first `group_size` that finish; the rest are aborted. An episode whose env raised,
hung past its limit or died is failed (counted) and a spare takes its place; a group that cannot reach
`group_size` is dropped and a new group starts in its place (at most `refill_bound` per step).

Across steps (`max_staleness` = K > 0) groups keep being started while the trainer trains, at most K steps
ahead, and a group holding a token more than K policy versions older than the trainer's is dropped when
handed out (`stale`). With K = 0 a step's groups start when the step asks for them. `lockstep` plays a step's
episodes turn by turn together (the synchronous batch-of-envs baseline).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
import time
from dataclasses import dataclass, field, replace

from rollflow.data.multiturn import TurnEncoder
from rollflow.data.sample import SampleStatus
from rollflow.data.seeds import derive_seed
from rollflow.engines.base import GenerationRequest, SamplingParams
from rollflow.errors import StalledError
from rollflow.rollout.episodes import Episode, Turn

ENV_CALL_MARGIN_S = 10.0  # the driver's bound on an env call beyond the worker's own time limit


@dataclass(frozen=True)
class EnvRolloutSettings:
    groups_per_step: int
    group_size: int
    group_redundancy: int = 0
    refill_bound: int = 0
    samples: str = "trajectory"  # or "step"
    history_turns: int = 0
    max_turns: int = 8
    max_context_tokens: int = 256
    max_staleness: int = 0
    lockstep: bool = False
    step_timeout_s: float = 30.0
    watchdog_s: float = 900.0
    train_seed_bound: int = 1_000_000  # training seeds are drawn below the eval seeds


@dataclass
class EpisodeGroup:
    index: int
    seed: int
    episodes: list[Episode]  # the kept ones, in slot order
    size: int = 0  # episodes it needs; fewer kept: the group is dropped
    failed: list[Episode] = field(default_factory=list)  # episodes that failed (their `error` says why)
    aborted: int = 0  # spares still playing when the group filled
    oldest_version: int | None = None

    @property
    def complete(self) -> bool:
        return len(self.episodes) >= self.size


@dataclass
class EnvRolloutResult:
    """What one step trains on (`groups`, complete), and the groups dropped since the last step because too
    many of their episodes failed (`dropped`), for the logs and the step's checks."""

    groups: list[EpisodeGroup]
    metrics: dict[str, float]
    dropped: list[EpisodeGroup] = field(default_factory=list)

    @property
    def failed(self) -> list[Episode]:
        """Every episode that failed (its `error` says why): in dropped groups, and spares' places."""
        return [episode for group in [*self.groups, *self.dropped] for episode in group.failed]


class _Lockstep:
    """A turn barrier for the lockstep baseline: an episode's next turn waits until every episode still
    playing has arrived. Lives on the rollout's event loop (no locking needed)."""

    def __init__(self):
        self.active = self.arrived = 0
        self.released = asyncio.Event()

    def join(self, count: int) -> None:
        self.active += count

    def leave(self) -> None:
        self.active -= 1
        self._release()

    async def arrive(self) -> None:
        released = self.released
        self.arrived += 1
        self._release()
        await released.wait()

    def _release(self) -> None:
        if self.arrived and self.arrived >= self.active:
            self.released.set()
            self.released, self.arrived = asyncio.Event(), 0


class EnvRollout:
    """Plays env groups for training steps and eval.

    Args:
        engines: `RolloutWorker` handles; `env_workers`: `EnvWorker` handles.
        encoder: renders observations as tokens.
        settings: see `EnvRolloutSettings`.
        sampling: training sampling (per turn); `seed`: the run's seed.
    """

    def __init__(self, engines: list, env_workers: list, encoder: TurnEncoder, settings: EnvRolloutSettings,
                 sampling: SamplingParams, seed: int):
        self.engines, self.env_workers, self.encoder = engines, env_workers, encoder
        self.settings, self.sampling, self.seed = settings, sampling, seed
        self.engine_load = [0] * len(engines)
        self.env_load = [0] * len(env_workers)
        self.next_group = 0  # index of the next group started (its seed key)
        self.request_counter = itertools.count()
        self.slot_counter = itertools.count()
        self.ready: list[EpisodeGroup] = []
        self.dropped: list[EpisodeGroup] = []  # groups dropped since the last step (too many failed)
        self.running: set[asyncio.Task] = set()
        self.started_groups = 0  # groups started by admission (refills come on top)
        self.steps_requested = 0
        self.counts = dict.fromkeys(("groups_dropped", "groups_stale", "failed", "aborted", "refills"), 0)
        self.refills_this_step = 0
        self.error: BaseException | None = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="env-rollout", daemon=True)
        self.thread.start()
        self.changed = asyncio.Event()  # set (on the loop) whenever a group ends

    # ---- driver side -------------------------------------------------------------------------------------

    def next_batch(self, step: int, version: int) -> EnvRolloutResult:
        """The groups step `step` trains on (`groups_per_step`, fewer when the refill bound was hit)."""
        future = asyncio.run_coroutine_threadsafe(self._collect(step, version), self.loop)
        return future.result()

    def evaluate(self, seeds: list[int], greedy: SamplingParams) -> list[Episode]:
        """One greedy episode per seed (eval envs), in seed order."""
        future = asyncio.run_coroutine_threadsafe(self._evaluate(seeds, greedy), self.loop)
        return future.result()

    def state(self) -> dict:
        """What a checkpoint keeps: the next group index (so a resumed run never replays a seed)."""
        return {"next_group": self.next_group}

    def load_state(self, state: dict, step: int) -> None:
        """Continue after `step`: its groups count as started, and groups played ahead then are played again
        (with new seeds) when the next step asks for them."""
        self.next_group = state["next_group"]
        self.started_groups = step * self.settings.groups_per_step

    def close(self) -> None:
        """Abort what is running and stop the loop."""
        if not self.loop.is_running():
            return

        try:
            asyncio.run_coroutine_threadsafe(_cancel_all(list(self.running)), self.loop).result(timeout=30)
        except Exception:  # noqa: BLE001  (closing: nothing left to report to)
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    # ---- the loop ----------------------------------------------------------------------------------------

    async def _collect(self, step: int, version: int) -> EnvRolloutResult:
        settings = self.settings
        started = time.perf_counter()
        self.steps_requested = step
        self.refills_this_step = 0
        counts_before = dict(self.counts)
        self._admit()
        last_progress = time.monotonic()
        while True:
            self._raise_error()
            self._drop_stale(version)
            if len(self.ready) >= settings.groups_per_step or not self.running:
                break
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=1.0)
                last_progress = time.monotonic()
            except asyncio.TimeoutError:
                if time.monotonic() - last_progress > settings.watchdog_s:
                    raise StalledError(f"no env group finished for {settings.watchdog_s:g} s in phase rollout "
                                       f"({len(self.running)} groups playing; cluster.watchdog_s)") from None
        groups, self.ready = self.ready[:settings.groups_per_step], self.ready[settings.groups_per_step:]
        dropped, self.dropped = self.dropped, []
        if settings.max_staleness:
            self._admit()  # the next steps' groups play while this one trains
        elapsed = time.perf_counter() - started
        episodes = [e for group in groups for e in group.episodes]
        metrics = {f"rollout/{key}": float(self.counts[key] - counts_before[key]) for key in self.counts}
        metrics.update({
            "time/rollout": elapsed,
            "rollout/groups": float(len(groups)),
            "rollout/trajectories_per_second": len(episodes) / max(elapsed, 1e-9),
        })
        return EnvRolloutResult(groups, metrics, dropped)

    def _admit(self) -> None:
        """Start groups up to the admission bound: (steps asked for + K) x groups_per_step."""
        settings = self.settings
        bound = (self.steps_requested + settings.max_staleness) * settings.groups_per_step
        lockstep = _Lockstep() if settings.lockstep else None
        while self.started_groups < bound:
            self.started_groups += 1
            self._start_group(lockstep)

    def _start_group(self, lockstep: _Lockstep | None) -> None:
        index, self.next_group = self.next_group, self.next_group + 1
        seed = derive_seed(self.seed, "env_group", index) % self.settings.train_seed_bound
        if lockstep is not None:
            lockstep.join(self.settings.group_size + self.settings.group_redundancy)
        task = self.loop.create_task(self._play_group(index, seed, lockstep))
        self.running.add(task)
        task.add_done_callback(self._group_done)

    def _group_done(self, task: asyncio.Task) -> None:
        self.running.discard(task)
        self.changed.set()
        if task.cancelled():
            return
        if task.exception() is not None:
            self.error = self.error or task.exception()
            return
        group = task.result()
        if group.complete:
            self.ready.append(group)
            return
        self.dropped.append(group)
        self.counts["groups_dropped"] += 1
        self._refill()

    def _refill(self) -> None:
        """A dropped group is replaced by a new one while the step's refill bound allows."""
        if self.refills_this_step < self.settings.refill_bound:
            self.refills_this_step += 1
            self.counts["refills"] += 1
            self._start_group(_Lockstep() if self.settings.lockstep else None)

    def _drop_stale(self, version: int) -> None:
        limit = self.settings.max_staleness
        if not limit:
            return
        fresh = []
        for group in self.ready:
            if group.oldest_version is not None and version - group.oldest_version > limit:
                self.counts["groups_stale"] += 1
                self._refill()
            else:
                fresh.append(group)
        self.ready = fresh

    def _raise_error(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    async def _play_group(self, index: int, seed: int, lockstep: _Lockstep | None,
                          sampling: SamplingParams | None = None, size: int | None = None,
                          eval_mode: bool = False) -> EpisodeGroup:
        """Play `size + redundancy` episodes of `seed`; the group of the first `size` that finish (incomplete
        when too many failed)."""
        settings = self.settings
        size = size or settings.group_size
        launched = size + (0 if eval_mode else settings.group_redundancy)
        episodes = [Episode(index, slot, seed) for slot in range(launched)]
        tasks = {asyncio.ensure_future(self._play_episode(e, sampling or self.sampling, lockstep, eval_mode)): e
                 for e in episodes}
        if lockstep is not None:
            for task in tasks:
                task.add_done_callback(lambda _: lockstep.leave())
        kept: list[Episode] = []
        group = EpisodeGroup(index, seed, kept, size)
        try:
            pending = set(tasks)
            while pending and len(kept) < size:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # an engine error ends the run: it propagates
                    episode = tasks[task]
                    if episode.status == SampleStatus.FAILED or not episode.turns:
                        if episode.status != SampleStatus.FAILED:
                            episode.fail("the episode ended before the model's first turn")
                        self.counts["failed"] += 1
                        group.failed.append(episode)
                    elif len(kept) < size:
                        kept.append(episode)
            for task in pending:  # the spares still playing
                task.cancel()
                group.aborted += 1
            self.counts["aborted"] += len(pending)
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        except BaseException:  # cancelled, or an episode's error ends the run: no episode is left playing
            await _cancel_all(tasks)
            raise
        if not group.complete:
            return group
        kept.sort(key=lambda e: e.slot)
        versions = [v for v in (e.oldest_version for e in kept) if v is not None]
        group.oldest_version = min(versions) if versions else None
        return group

    async def _play_episode(self, episode: Episode, sampling: SamplingParams, lockstep: _Lockstep | None,
                            eval_mode: bool) -> None:
        """Play one episode to its end (env done, turn or context limit, failure); fills `episode`."""
        settings, encoder = self.settings, self.encoder
        env_index = min(range(len(self.env_workers)), key=self.env_load.__getitem__)
        engine_index = min(range(len(self.engines)), key=self.engine_load.__getitem__)
        env_worker, engine = self.env_workers[env_index], self.engines[engine_index]
        slot = f"e{next(self.slot_counter)}"
        self.env_load[env_index] += 1
        self.engine_load[engine_index] += 1
        request_id = None
        try:
            reply = await self._env_call(env_worker.reset.remote(slot, episode.seed, eval_mode), env_index, "reset")
            if "error" in reply:
                episode.fail(reply["error"], reply.get("traceback", ""))
                return
            observation, info = reply["observation"], reply["info"]
            episode.env_seconds += reply["seconds"]
            episode.prompt_ids = encoder.first_prompt(observation)
            history: list[tuple[str, str]] = []
            for number in range(settings.max_turns):
                if settings.samples == "trajectory":
                    prompt = episode.prompt_ids + episode.response_ids
                else:
                    prompt = encoder.step_prompt(history[len(history) - settings.history_turns:]
                                                 if settings.history_turns else [], observation)
                if len(prompt) + sampling.max_new_tokens > settings.max_context_tokens:
                    if not episode.turns:
                        episode.fail(f"the first prompt has {len(prompt)} tokens: with rollout.max_new_tokens = "
                                     f"{sampling.max_new_tokens} that is over the context limit of "
                                     f"{settings.max_context_tokens} tokens (rollout.max_context_tokens)")
                        return
                    episode.status = SampleStatus.TRUNCATED
                    break
                if lockstep is not None:
                    await lockstep.arrive()
                request_id = f"env-{next(self.request_counter)}"
                params = sampling if sampling.temperature == 0 else replace(
                    sampling, seed=derive_seed(self.seed, "turn", episode.group, episode.slot, number))
                completion = await self._generate(engine, engine_index, GenerationRequest(request_id, prompt, params))
                request_id = None
                output = completion.outputs[0]
                text = encoder.decode(output.token_ids)
                turn = Turn(prompt, list(output.token_ids), list(output.logprobs), list(output.policy_versions),
                            text, str(info.get("anchor", observation)),
                            prefix_reused_tokens=int(completion.metadata.get("prefix_reused_tokens", 0)))
                episode.add_turn(turn)
                reply = await self._env_call(env_worker.step.remote(slot, text), env_index, "step")
                if "error" in reply:
                    episode.fail(reply["error"], reply.get("traceback", ""))
                    return
                episode.env_seconds += reply["seconds"]
                turn.reward, info = reply["reward"], reply["info"]
                turn.invalid = bool(info.get("invalid_action", False))
                episode.info = info
                if reply["terminated"] or reply["truncated"]:
                    episode.status = SampleStatus.TRUNCATED if reply["truncated"] and not reply["terminated"] \
                        else SampleStatus.FINISHED
                    break
                history.append((observation, text))
                observation = reply["observation"]
                if settings.samples == "trajectory" and number + 1 < settings.max_turns:  # a next turn follows
                    episode.add_observation(encoder.observation_turn(observation, output.token_ids))
            else:
                episode.status = SampleStatus.TRUNCATED  # the turn limit
        except asyncio.CancelledError:
            episode.status = SampleStatus.ABORTED
            if request_id is not None:
                engine.abort.remote([request_id])
            raise
        finally:
            self.env_load[env_index] -= 1
            self.engine_load[engine_index] -= 1
            env_worker.close_slot.remote(slot)

    async def _env_call(self, ref, env_index: int, what: str) -> dict:
        """An env worker's reply (an error record when the env failed: that fails one episode), or an error
        record when the worker did not answer in time.

        Raises:
            WorkerDiedError: the env worker died (killed, out of memory): every later episode on it would
                fail, so the run stops (the last checkpoint is intact).
            WorkerError: the worker itself raised (a bug of the worker, not of the env).
        """
        limit = self.settings.step_timeout_s + ENV_CALL_MARGIN_S
        try:
            return await asyncio.wait_for(_awaitable(ref), timeout=limit)
        except asyncio.TimeoutError:
            return {"error": f"env worker {env_index} did not answer {what} within {limit:g} s"}
        except asyncio.CancelledError:
            raise
        except Exception as err:
            from rollflow.cluster.calls import map_ray_error

            raise map_ray_error(err, "env", env_index, what) from None

    async def _generate(self, engine, engine_index: int, request: GenerationRequest):
        try:
            return await asyncio.wait_for(_awaitable(engine.generate.remote(request)),
                                          timeout=self.settings.watchdog_s)
        except asyncio.TimeoutError:
            raise StalledError(f"actor_infer worker {engine_index} did not answer a turn within "
                               f"{self.settings.watchdog_s:g} s (cluster.watchdog_s)") from None
        except asyncio.CancelledError:
            raise
        except Exception as err:
            from rollflow.cluster.calls import map_ray_error

            raise map_ray_error(err, "actor_infer", engine_index, "generate") from None

    async def _evaluate(self, seeds: list[int], greedy: SamplingParams) -> list[Episode]:
        tasks = [asyncio.ensure_future(self._play_group(-1 - i, seed, None, greedy, 1, eval_mode=True))
                 for i, seed in enumerate(seeds)]
        try:
            groups = await asyncio.gather(*tasks)
        except BaseException:
            await _cancel_all(tasks)
            raise
        return [group.episodes[0] if group.complete else group.failed[0] for group in groups]


async def _cancel_all(tasks) -> None:
    """Cancel `tasks` and wait until each has ended (none is left to be destroyed pending, whose `finally`
    would then call a worker after Ray has shut down)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _awaitable(ref):
    """A Ray ObjectRef as an awaitable (ObjectRefs are awaitable in an asyncio loop)."""
    async def wait():
        return await ref
    return wait()


def episode_metrics(episodes: list[Episode], prefix: str) -> dict[str, float]:
    """Success rate (failed episodes count as failures), and the mean return, turns, invalid actions and env
    time of the episodes that did not fail (`rollout/` or `eval/`). Failed training episodes are counted by
    `EnvRollout` (`rollout/failed`): groups hand out only episodes that did not fail."""
    if not episodes:
        return {}
    usable = [e for e in episodes if e.status != SampleStatus.FAILED]
    turns = [t for e in usable for t in e.turns]
    count = max(len(usable), 1)
    metrics = {
        f"{prefix}/success": sum(e.success for e in usable) / max(len(episodes), 1),
        f"{prefix}/return": sum(e.episode_return for e in usable) / count,
        f"{prefix}/turns": sum(len(e.turns) for e in usable) / count,
        f"{prefix}/invalid_action_frac": sum(t.invalid for t in turns) / max(len(turns), 1),
        f"{prefix}/truncated_frac": sum(e.status == SampleStatus.TRUNCATED for e in usable) / count,
        f"{prefix}/env_seconds_per_turn": sum(e.env_seconds for e in usable) / max(len(turns), 1),
        f"{prefix}/prefix_reused_frac": (sum(t.prefix_reused_tokens for t in turns)
                                         / max(sum(len(t.prompt_ids) for t in turns), 1)),
    }
    return {k: v for k, v in metrics.items() if math.isfinite(v)}

