"""The env-group program of the rollout core: episodes of one env seed, played turn by turn (agentic RL).

Every episode is a coroutine of its own: reset its env, then turn after turn ask an engine for the model's
tokens (an episode keeps one engine worker, whose prefix cache holds its turns) and step the env with their
text. No barrier between envs (unless the run plays in rounds: `lockstep`, `deterministic`): a slow env holds
up only its own episode.

A group starts `group_size + group_redundancy` episodes of its seed and keeps the first `group_size` that
finish; the spares still playing are aborted. An episode whose env raised, hung past its limit or died is
failed (counted) and a spare takes its place; a group that cannot reach `group_size` fails, and the core
starts a new one in its place. What the group hands on is `Sample`s (rollflow/rollout/episodes.py): one per
episode (`trajectory`) or per turn (`step`), with their turn spans, step rewards and anchor states.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from dataclasses import dataclass

from rollflow.data.multiturn import TurnEncoder
from rollflow.data.sample import Sample, SampleStatus
from rollflow.data.seeds import derive_seed
from rollflow.data.vision import join_vision
from rollflow.engines.base import SamplingParams
from rollflow.rollout.core import Group, GroupState, Play
from rollflow.rollout.episodes import Episode, Turn, episode_samples, failed_samples
from rollflow.rollout.router import await_worker, fire

ENV_CALL_MARGIN_S = 10.0  # the bound on an env call beyond the worker's own time limit


@dataclass(frozen=True)
class EpisodeSettings:
    group_size: int
    group_redundancy: int = 0
    samples: str = "trajectory"  # or "step"
    history_turns: int = 0
    max_turns: int = 8
    max_context_tokens: int = 256
    step_timeout_s: float = 30.0


def turns_that_fit(first_prompt: int, later_turn: int, settings: EpisodeSettings, max_new_tokens: int) -> int:
    """How many turns of an episode surely fit the context when every turn takes all its `max_new_tokens`, as
    `EnvGroups` checks a turn: its prompt (the first prompt and the turns before it, each `max_new_tokens` plus
    `later_turn` tokens of markers and observation; step-wise, only the `history_turns` kept) plus
    `max_new_tokens` within `settings.max_context_tokens`. 0: not even the first turn fits."""
    for turn in range(settings.max_turns):
        earlier = turn if settings.samples == "trajectory" else min(turn, settings.history_turns)
        if first_prompt + earlier * (max_new_tokens + later_turn) + max_new_tokens > settings.max_context_tokens:
            return turn
    return settings.max_turns


class SeedSource:
    """The training keys of an env run: group `i` plays the seed `derive_seed(seed, "env_group", i) % bound`
    (training seeds are drawn below the eval seeds, which start at `bound`)."""

    def __init__(self, seed: int, bound: int):
        self.seed, self.bound, self.next = seed, bound, 0

    def take(self, count: int) -> list[int]:
        seeds = [derive_seed(self.seed, "env_group", i) % self.bound for i in range(self.next, self.next + count)]
        self.next += count
        return seeds

    def state(self) -> dict:
        return {"next": self.next}

    def load_state(self, state: dict) -> None:
        self.next = state["next"]


class EnvGroups:
    """Plays env groups (see the module docstring).

    Args:
        env_workers: `EnvWorker` handles.
        encoder: renders observations as tokens.
        settings: group size, spares, sample mode, turn and context limits, env time limit.
        sampling: the sampling of one turn.
        evaluating: the eval program: one episode per seed on the eval envs, no spares.
    """

    def __init__(self, env_workers: list, encoder: TurnEncoder, settings: EpisodeSettings, sampling: SamplingParams,
                 evaluating: bool = False):
        self.env_workers, self.encoder, self.settings, self.sampling = env_workers, encoder, settings, sampling
        self.evaluating = evaluating
        self.tag = "eval" if evaluating else "env"
        self.size = 1 if evaluating else settings.group_size
        self.launched = self.size + (0 if evaluating else settings.group_redundancy)
        self.env_load = [0] * len(env_workers)
        self.slots = itertools.count()
        self.counts: collections.Counter = collections.Counter()

    def for_eval(self, sampling: SamplingParams) -> EnvGroups:
        """The eval program on the same env workers: `sampling` (greedy), one episode per seed."""
        return EnvGroups(self.env_workers, self.encoder, self.settings, sampling, evaluating=True)

    def participants(self, group: Group) -> int:
        return self.launched

    async def play(self, group: Group, play: Play) -> GroupState:
        """Play `size + redundancy` episodes of the group's seed; keep the first `size` that finish."""
        episodes = [Episode(group.index, slot, group.key) for slot in range(self.launched)]
        tasks = {asyncio.ensure_future(self._episode(episode, play)): episode for episode in episodes}
        kept: list[Episode] = []
        failed: list[Episode] = []
        try:
            pending = set(tasks)
            while pending and len(kept) < self.size and not group.cut:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=lambda t: tasks[t].slot):
                    task.result()  # an engine error ends the run: it propagates
                    episode = tasks[task]
                    if episode.status == SampleStatus.ABORTED:
                        continue
                    if episode.status == SampleStatus.FAILED or not episode.turns:
                        if episode.status != SampleStatus.FAILED:
                            episode.fail("the episode ended before the model's first turn")
                        failed.append(episode)
                    elif len(kept) < self.size:
                        kept.append(episode)
            for task in pending:  # the spares still playing (or every episode of a cut group)
                task.cancel()
            self.counts["failed"] += len(failed)
            self.counts["aborted"] += len(pending)
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        except BaseException:  # cancelled, or an episode's error ends the run: no episode is left playing
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        kept.sort(key=lambda e: e.slot)
        group.samples = episode_samples(kept, group.group_id, self.settings.samples) + failed_samples(failed,
                                                                                                      group.group_id)
        if group.cut:
            return GroupState.ABORTED
        return GroupState.READY if len(kept) >= self.size else GroupState.FAILED

    async def _episode(self, episode: Episode, play: Play) -> None:
        """Play one episode to its end (env done, turn or context limit, failure, cut); fills `episode`."""
        settings, encoder, sampling = self.settings, self.encoder, self.sampling
        env_index = min(range(len(self.env_workers)), key=self.env_load.__getitem__)
        env_worker, engine = self.env_workers[env_index], play.lease()
        slot = f"e{next(self.slots)}"
        self.env_load[env_index] += 1
        try:
            reply = await self._env_call(env_worker.reset.remote(slot, episode.seed, self.evaluating), env_index,
                                         "reset", play)
            if "error" in reply:
                episode.fail(reply["error"], reply.get("traceback", ""))
                return
            observation, info = reply["observation"], reply["info"]
            episode.env_seconds += reply["seconds"]
            episode.count(info)
            seen_vision = episode.vision = encoder.vision(info.pop("images", None))  # the observation's images
            episode.prompt_ids = encoder.first_prompt(observation, episode.vision)
            seen: str | list[str] = observation  # what the model answers next: an observation or tool results
            history: list[tuple[str | list[str], str]] = []
            history_visions: list = []  # the images of each observation of `history`
            for number in range(settings.max_turns):
                if settings.samples == "trajectory":
                    prompt, vision = episode.prompt_ids + episode.response_ids, episode.vision
                else:
                    kept = -settings.history_turns if settings.history_turns else len(history)
                    visions = [*history_visions[kept:], seen_vision]
                    prompt = encoder.step_prompt(history[kept:], seen, visions)
                    vision = join_vision(visions)
                if len(prompt) + sampling.max_new_tokens > settings.max_context_tokens:
                    if not episode.turns:
                        episode.fail(f"the first prompt has {len(prompt)} tokens: with rollout.max_new_tokens = "
                                     f"{sampling.max_new_tokens} that is over the context limit of "
                                     f"{settings.max_context_tokens} tokens (rollout.max_context_tokens)")
                        return
                    episode.status, episode.context_full = SampleStatus.TRUNCATED, len(prompt)
                    break
                if play.group.cut:
                    episode.status = SampleStatus.ABORTED
                    return
                seed_key = None if sampling.temperature == 0 else ("turn", episode.group, episode.slot, number)
                completion, _ = await play.generate(prompt, sampling, worker=engine, vision=vision,
                                                    order=(episode.group, episode.slot), seed_key=seed_key)
                output = completion.outputs[0]
                if output.finish_reason == "abort":  # the group was cut
                    episode.status = SampleStatus.ABORTED
                    return
                text = encoder.decode(output.token_ids)
                turn = Turn(prompt, list(output.token_ids), list(output.logprobs), list(output.policy_versions),
                            text, str(info.get("anchor", observation)),
                            prefix_reused_tokens=int(completion.metadata.get("prefix_reused_tokens", 0)),
                            vision=vision)
                episode.add_turn(turn)
                reply = await self._env_call(env_worker.step.remote(slot, text), env_index, "step", play)
                if "error" in reply:
                    episode.fail(reply["error"], reply.get("traceback", ""))
                    return
                episode.env_seconds += reply["seconds"]
                turn.reward, info = reply["reward"], reply["info"]
                next_vision = encoder.vision(info.pop("images", None))
                turn.invalid = bool(info.get("invalid_action", False))
                episode.info = info
                episode.count(info)
                if reply["terminated"] or reply["truncated"]:
                    episode.status = SampleStatus.TRUNCATED if reply["truncated"] and not reply["terminated"] \
                        else SampleStatus.FINISHED
                    break
                if settings.samples == "trajectory" and encoder.holds_image_token(output.token_ids):
                    episode.status = SampleStatus.TRUNCATED  # the next turn's prefill would take it for an image
                    break
                history.append((seen, text))
                history_visions.append(seen_vision)
                observation = reply["observation"]
                tool_results = info.get("tool_results")
                seen, seen_vision = (tool_results if isinstance(tool_results, list) else observation), next_vision
                if settings.samples == "trajectory" and number + 1 < settings.max_turns:  # a next turn follows
                    episode.add_observation(encoder.next_turn(seen, output.token_ids, seen_vision))
                    episode.vision = join_vision([episode.vision, seen_vision])
            else:
                episode.status = SampleStatus.TRUNCATED  # the turn limit
        except asyncio.CancelledError:
            episode.status = SampleStatus.ABORTED
            raise
        finally:
            self.env_load[env_index] -= 1
            play.release(engine)
            play.leave()
            fire(env_worker.close_slot.remote(slot))

    async def _env_call(self, ref, env_index: int, what: str, play: Play) -> dict:
        """An env worker's reply (an error record when the env failed: that fails one episode), or an error
        record when the worker did not answer in time.

        Raises:
            WorkerDiedError: the env worker died (killed, out of memory): every later episode on it would
                fail, so the run stops (the last checkpoint is intact).
            WorkerError: the worker itself raised (a bug of the worker, not of the env).
        """
        limit = self.settings.step_timeout_s + ENV_CALL_MARGIN_S
        try:
            reply = await await_worker(ref, "env", env_index, what, limit)
        except asyncio.TimeoutError:
            reply = {"error": f"env worker {env_index} did not answer {what} within {limit:g} s"}
        play.progress()
        return reply

    def batch_metrics(self, samples: list[Sample], ended: collections.Counter) -> dict[str, float]:
        metrics = {f"rollout/{key}": float(self.counts[key]) for key in ("failed", "aborted")}
        metrics["rollout/groups"] = float(ended[GroupState.CONSUMED])
        self.counts.clear()
        return metrics

    def key_state(self, key: int) -> int:
        return key

    def load_key(self, state: int) -> int:
        return int(state)
