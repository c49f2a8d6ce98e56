"""`sim` engine: a simulated GPU behind the engine protocol. No model runs; time passes as a cost model says.

It schedules like the `hf` engine (and vLLM): continuous batching, requests admitted first come first served
at token boundaries while the running rows stay within `max_running` (a request's `n` rows join together; a
request larger than that runs alone), and every running row gains one token per step. What a step costs comes
from the run's hardware profile (`rollflow.sim.profiles`): `decode_step_s + decode_s_per_kv_token * tokens in
the KV cache`, after a prefill stall of `prefill_s_per_token * prompt tokens` for the rows that join. Time is
simulated by sleeping on the event loop, `time_scale` times faster than the profile's seconds, from one event
(an arrival, a finish, an abort, a weight load) to the next: no per-token wake-ups, so dozens of simulated GPUs
fit on two cores.

A sample's length is drawn from the run's length distribution (seeded per sample when the request is), at
least `min_new_tokens` and at most `max_new_tokens` simulated tokens per payload token (`token_scale`), and at
most `max_new_simulated_tokens` when that is set (a limit `token_scale` does not divide: `rollflow plan` passes
the config's own); its payload holds one random token id per `token_scale` simulated tokens or part of them,
EOS last when it stopped, each with a logprob and the policy version of the weights that were loaded when its
first simulated token was sampled.
A sample aborted part-way and sent again as a new request whose prompt is its prompt plus its payload so far (the
core's `resubmit`) continues the same sample: it decodes what was left of its drawn length (within the new
request's limit) instead of drawing a length afresh, as a real engine continuing the text would.
A weight load pauses decoding for the profile's sync time (vLLM pauses its scheduler too) and later tokens
carry the new version; `sleep` / `wake` cost the profile's offload / onload time.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollflow.engines.base import Completion, CompletionOutput, GenerationRequest, sample_seed
from rollflow.engines.lifecycle import EngineLifecycle
from rollflow.models import load_tokenizer, resolve_model_path
from rollflow.sim.profiles import SimSettings, length_distribution

MAX_CONTINUATIONS = 65_536  # aborted samples remembered for a resubmission (the oldest forgotten first)


@dataclass(eq=False)
class _Pending:
    request: GenerationRequest
    future: asyncio.Future
    submitted: float
    submitted_step: int  # the engine's decode steps when it was queued (`admit_wait_steps` counts from it)
    outputs: list[CompletionOutput] = field(default_factory=list)
    unfinished: int = 0
    admitted: float | None = None


@dataclass(eq=False)
class _Row:
    """One sample being decoded: `done` of its `target` simulated tokens so far."""

    pending: _Pending
    slot: int
    target: int
    reason: str  # "stop" or "length" once it reaches `target`
    prompt: int  # simulated prompt tokens in its KV
    rng: random.Random
    done: int = 0
    versions: list[tuple[int, int]] = field(default_factory=list)  # (first simulated token, version)


@dataclass
class _Segment:
    """Decoding in flight since `started` (monotonic): a prefill stall, then up to `steps` steps of `running`
    rows holding `kv_tokens` at the first."""

    started: float
    stall: float
    steps: int
    kv_tokens: int
    running: int


class SimEngine:
    """A simulated GPU inference engine (see the module docstring).

    Args:
        model_path: the run's model: only its tokenizer is loaded (token ids to sample, EOS).
        dtype, trust_remote_code: as for every engine (the tokenizer's `trust_remote_code`; `dtype` unused).
        max_batch_size: unused (the profile's `max_running` bounds the batch; `cluster.sim.overrides` sets it).
        seed: the engine's generator, for requests without a seed.
        simulation: `SimSettings` fields (`cluster.sim`: profile, time_scale, token_scale, overrides).
        lengths: the response-length distribution (`rollflow.sim.profiles.length_distribution`).
        admit_wait_steps: token boundaries a queued request lets pass before it joins a running batch (the hf
            engine's knob; 0, vLLM's behaviour, admits at the next boundary).
        max_new_simulated_tokens: the response limit in simulated tokens, below the request's `max_new_tokens`
            x `token_scale` (None: that); a sample that reaches it ends with "length".

    `batch_trace`: set it to a list and every decode step appends its running rows (the honesty test compares
    it with the hf engine's).
    """

    def __init__(self, model_path: str, dtype: str = "float32", max_batch_size: int = 256, seed: int = 0,
                 trust_remote_code: bool = False, simulation: dict[str, Any] | None = None,
                 lengths: dict[str, Any] | None = None, admit_wait_steps: int = 0,
                 max_new_simulated_tokens: int | None = None):
        self.settings = SimSettings(**(simulation or {}))
        self.max_new_simulated_tokens = max_new_simulated_tokens
        self.hardware = self.settings.hardware()
        self.lengths = length_distribution(lengths)
        self.max_running = self.hardware.max_running
        self.admit_wait_steps = admit_wait_steps
        self.eos_id, self.vocabulary = token_space(model_path, trust_remote_code)
        self.rng = random.Random(seed)
        self.batch_trace: list[int] | None = None
        self.stats = {"tokens": 0, "decode_steps": 0, "simulated_seconds": 0.0, "prefill_tokens": 0}
        self._lifecycle = EngineLifecycle()
        self._queue: deque[_Pending] = deque()
        self._rows: list[_Row] = []
        self._segment: _Segment | None = None
        self._changed: asyncio.Event | None = None
        self._runner: asyncio.Task | None = None
        # samples aborted part-way, by the hash of their prompt + payload so far (a few bytes each, however long):
        # (simulated tokens left, how they end)
        self._continuations: OrderedDict[int, tuple[int, str]] = OrderedDict()

    @property
    def version(self) -> int:
        return self._lifecycle.version

    # ---- protocol ------------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> Completion:
        """Simulate `request.params.n` samples; RuntimeError while asleep or closed."""
        self._lifecycle.check_can_generate()
        loop = asyncio.get_running_loop()
        pending = _Pending(request, loop.create_future(), time.perf_counter(), self.stats["decode_steps"])
        self._queue.append(pending)
        if self._runner is None or self._runner.done():
            self._changed = asyncio.Event()
            self._runner = loop.create_task(self._run())
        self._changed.set()
        return await pending.future

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests: they resolve with the tokens simulated so far (`abort`)."""
        ids = set(request_ids)
        self._advance()
        for pending in [p for p in self._queue if p.request.request_id in ids]:
            self._queue.remove(pending)
            self._resolve(pending, unstarted_outputs(pending))
        for row in [r for r in self._rows if r.pending.request.request_id in ids]:
            self._finish(row, "abort")
        if self._changed is not None:
            self._changed.set()

    def update_weights(self, named_tensors: dict, version: int) -> None:
        """Take the new version: decoding pauses for the profile's sync time, later tokens carry `version`."""
        self._lifecycle.check_open()
        self._advance()
        time.sleep(self.settings.wall(self.hardware.sync_seconds()))
        self._lifecycle.version = version
        for row in self._rows:
            row.versions.append((row.done, version))
        if self._segment is not None:  # the pause is no decoding time
            self._restart_segment()

    def sleep(self) -> None:
        self._lifecycle.sleep(lambda: time.sleep(self.settings.wall(self.hardware.offload_s)), weights_released=True)

    def wake(self) -> None:
        self._lifecycle.wake(lambda: time.sleep(self.settings.wall(self.hardware.onload_s)))

    def close(self) -> None:
        """Resolve every unfinished request ("abort" for unfinished samples) and stop (idempotent)."""
        if not self._lifecycle.close():
            return
        if self._runner is not None and not self._runner.done() and not self._runner.get_loop().is_closed():
            self._runner.cancel()
        for row in list(self._rows):
            self._finish(row, "abort")
        for pending in list(self._queue):
            self._resolve(pending, unstarted_outputs(pending))
        self._queue.clear()

    # ---- simulation ----------------------------------------------------------------------------------
    async def _run(self) -> None:
        """From event to event: apply what the segment in flight simulated, finish rows, admit, and sleep until
        the next finish (or until something arrives, aborts or loads)."""
        while self._queue or self._rows:
            self._advance()
            self._admit()
            if not self._rows:
                await self._changed.wait()
                self._changed.clear()
                continue
            if self._segment is None:
                self._start_segment(stall=0.0)
            segment = self._segment
            remaining = segment.stall + self.hardware.decode_seconds(segment.steps, segment.kv_tokens,
                                                                      segment.running)
            due = segment.started + self.settings.wall(remaining)
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=max(0.0, due - time.monotonic()))
            except asyncio.TimeoutError:
                pass

    def _start_segment(self, stall: float, carried: float = 0.0) -> None:
        """Decode the current rows from now on, `carried` simulated seconds into their first step."""
        rows = self._rows
        steps = min(row.target - row.done for row in rows)
        kv_tokens = sum(row.prompt + row.done for row in rows)
        started = time.monotonic() - self.settings.wall(carried)
        self._segment = _Segment(started, stall, steps, kv_tokens, len(rows))

    def _restart_segment(self) -> None:
        """The same rows from now on (after a pause), with what is left of the stall."""
        stall = self._segment.stall
        self._segment = None
        if self._rows:
            self._start_segment(stall)

    def _advance(self) -> None:
        """Apply what the segment in flight has simulated by now: the stall spent, the whole steps taken (the
        rows that reached their target finish). The rest goes on in a new segment that keeps what is left of
        the stall and the time already spent in the step under way."""
        segment = self._segment
        if segment is None:
            return
        elapsed = (time.monotonic() - segment.started) * self.settings.time_scale
        if elapsed < segment.stall:
            self._segment = None
            self._start_segment(segment.stall - elapsed)
            return
        spent = elapsed - segment.stall
        steps = min(segment.steps, self.hardware.decode_steps_within(spent, segment.kv_tokens, segment.running))
        carried = spent - self.hardware.decode_seconds(steps, segment.kv_tokens, segment.running)
        self._segment = None
        if steps:
            self.stats["decode_steps"] += steps
            self.stats["tokens"] += steps * segment.running
            self.stats["simulated_seconds"] += segment.stall + spent - carried
            if self.batch_trace is not None:
                self.batch_trace.extend([segment.running] * steps)
            for row in self._rows:
                row.done += steps
            for row in [r for r in self._rows if r.done >= r.target]:
                self._finish(row, row.reason)
        if self._rows:
            self._start_segment(0.0, carried)

    def _admit(self) -> None:
        """Queued requests join first come first served while the rows stay within `max_running` (a larger
        request runs alone), after `admit_wait_steps` boundaries when others are decoding; their prefill
        stalls the batch."""
        running = len(self._rows)
        admitted: list[_Pending] = []
        while self._queue:
            pending = self._queue[0]
            n = pending.request.params.n
            if (admitted or running) and running + n > self.max_running:
                break
            if running and self.stats["decode_steps"] - pending.submitted_step < self.admit_wait_steps:
                break
            admitted.append(self._queue.popleft())
            running += n
        if not admitted:
            return
        scale = self.settings.token_scale
        prompt_tokens = 0
        for pending in admitted:
            params = pending.request.params
            prompt = len(pending.request.prompt_ids) * scale
            prompt_tokens += prompt
            pending.admitted = time.perf_counter()
            pending.unfinished = params.n
            pending.outputs = unstarted_outputs(pending)  # "abort" until each row finishes
            continued = self._continuations.pop(hash(tuple(pending.request.prompt_ids)), None) if params.n == 1 \
                else None
            for slot in range(params.n):
                rng = random.Random(sample_seed(params.seed, slot)) if params.seed is not None \
                    else random.Random(self.rng.getrandbits(63))
                limit = params.max_new_tokens * scale
                if self.max_new_simulated_tokens is not None:
                    limit = min(limit, self.max_new_simulated_tokens)
                if continued is not None:  # the rest of an aborted sample (see the module docstring)
                    left, ending = continued
                    target, reason = (left, ending) if left < limit else (limit, "length")
                else:
                    drawn = max(self.lengths.draw(rng), params.min_new_tokens * scale)
                    target, reason = (drawn, "stop") if drawn < limit else (limit, "length")
                self._rows.append(_Row(pending, slot, target, reason, prompt, rng,
                                       versions=[(0, self._lifecycle.version)]))
        self.stats["prefill_tokens"] += prompt_tokens
        stall = self.hardware.prefill_s_per_token * prompt_tokens
        if self._segment is not None:  # `_advance` just ran: the segment started at most a part-step ago
            stall += self._segment.stall
        self._segment = None
        self._start_segment(stall)

    def _finish(self, row: _Row, reason: str) -> None:
        """Row `row` ends (`reason`): its payload is written; its request resolves once all its rows ended."""
        self._rows.remove(row)
        scale = self.settings.token_scale
        length = math.ceil(row.done / scale)
        token_ids = [row.rng.choice(self.vocabulary) for _ in range(length)]
        if reason == "stop" and length:
            token_ids[-1] = self.eos_id
        marks = row.versions
        versions = []
        for index in range(length):
            first = index * scale  # a payload token carries the version of its first simulated token
            versions.append(next(v for start, v in reversed(marks) if start <= first))
        logprobs = [-row.rng.uniform(0.01, 3.0) for _ in range(length)]
        if reason == "abort" and row.done < row.target:  # a resubmission of it continues from here
            self._continuations[hash((*row.pending.request.prompt_ids, *token_ids))] = (
                max(1, row.target - length * scale), row.reason)
            while len(self._continuations) > MAX_CONTINUATIONS:  # cut samples that nobody continues
                self._continuations.popitem(last=False)
        row.pending.outputs[row.slot] = CompletionOutput(token_ids, logprobs, versions, reason)
        row.pending.unfinished -= 1
        if row.pending.unfinished == 0:
            self._resolve(row.pending, row.pending.outputs)

    def _resolve(self, pending: _Pending, outputs: list[CompletionOutput]) -> None:
        if pending.future.done() or pending.future.get_loop().is_closed():
            return
        now = time.perf_counter()
        admitted = now if pending.admitted is None else pending.admitted
        pending.future.set_result(Completion(pending.request.request_id, outputs, {
            "seconds": now - pending.submitted, "queue_seconds": admitted - pending.submitted,
            "version": self._lifecycle.version, "prefill_tokens": len(pending.request.prompt_ids),
            "prefix_reused_tokens": 0}))


def unstarted_outputs(pending: _Pending) -> list[CompletionOutput]:
    """One empty "abort" output per sample of `pending`: what it resolves with before any of its rows ran."""
    return [CompletionOutput(finish_reason="abort") for _ in range(pending.request.params.n)]


def token_space(model_path: str, trust_remote_code: bool = False) -> tuple[int, list[int]]:
    """(the EOS id, the ids a sample may hold: the vocabulary without special tokens) of a model.

    A local model is read from its `config.json` and `tokenizer.json` without transformers, whose import costs
    each engine process ~190 MB (64 simulated engines are 64 processes); other models load their tokenizer.
    """
    resolved = Path(resolve_model_path(model_path))
    config_file, tokenizer_file = resolved / "config.json", resolved / "tokenizer.json"
    if config_file.is_file() and tokenizer_file.is_file():
        eos = json.loads(config_file.read_text(encoding="utf-8")).get("eos_token_id")
        tokenizer = json.loads(tokenizer_file.read_text(encoding="utf-8"))
        vocabulary = tokenizer.get("model", {}).get("vocab")
        if isinstance(vocabulary, dict) and eos is not None:
            special = {token["id"] for token in tokenizer.get("added_tokens", []) if token.get("special")}
            eos = eos[0] if isinstance(eos, list) else eos
            return int(eos), sorted(i for i in vocabulary.values() if i not in special and i != eos)
    tokenizer = load_tokenizer(model_path, trust_remote_code)
    special = set(tokenizer.all_special_ids)
    return tokenizer.eos_token_id, [i for i in range(len(tokenizer)) if i not in special]
