"""`hf` engine: continuous-batching KV-cache decoding with plain transformers models, on CPU or GPU.

One decode batch runs while there is work. Requests queue up; at a token boundary the runner admits
queued requests while the batch has room (`max_batch_size` running sequences): it prefills their prompts
(once per request, shared by its `n` samples) and merges their KV cache into the running one, aligned by
left padding, so each row computes exactly what it would alone. A running batch takes arrivals once the
oldest has let `admit_wait_steps` token boundaries pass, so requests that arrive one by one (multi-turn
episodes, each on its own clock) join a few at a time instead of costing a prefill forward and a cache
merge at nearly every token. Rows leave the batch as they finish, and a request's future resolves as soon
as all of its samples finish, so its rewards can be computed early. The decode loop yields to the event
loop between tokens, so `abort`, `generate` and `update_weights` are served mid-generation. With
`continuous_batching=False` requests wait until the batch is empty (the "wave" baseline the benchmark
compares against).

Partial rollout: `update_weights` between tokens changes the weights the next token is sampled with;
samples in flight keep their tokens and continue, each token tagged with the version that sampled it.
Their KV cache (prompt and earlier tokens) stays as the old weights computed it.

With `prefix_cache_tokens > 0` the KV of finished single-sample sequences is kept, and a prompt that
extends one (the next turn of a conversation) prefills only its new tokens (`prefix_cache.py`); new
weights empty that cache.

When decoding raises (a CUDA error, NaN logits from non-finite weights), every request still queued or in
the batch fails with one `EngineError` and the next `generate` starts afresh.

The running batch (its KV cache and output buffers) is `kv_batch.DecodeBatch`; the choice of each token is
`sampling.sample_tokens`. This module admits requests, runs the model and hands finished samples back.

The engine runs on the caller's event loop (no thread of its own): call every method from that loop's
thread.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from rollflow.data.vision import stack_vision
from rollflow.engines.base import (
    Completion,
    CompletionOutput,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    decoding_failed,
    sample_seed,
)
from rollflow.engines.kv_batch import DecodeBatch, repeat_requests
from rollflow.engines.lifecycle import EngineLifecycle
from rollflow.engines.prefix_cache import PrefixCache, with_prefixes
from rollflow.engines.sampling import sample_tokens
from rollflow.models import (
    cache_keyword,
    eos_token_ids,
    load_causal_lm,
    load_tokenizer,
    use_cpu_attention,
    uses_mrope,
    vision_inputs,
)


@dataclass(eq=False)  # compared and hashed by identity: the engine keeps a set of them
class _Pending:
    request: GenerationRequest
    future: asyncio.Future
    outputs: list[CompletionOutput] = field(default_factory=list)
    unfinished: int = 0
    submitted: float = field(default_factory=time.perf_counter)
    submitted_step: int = 0  # the engine's decode steps when it was queued
    admitted: float | None = None  # when it left the queue for the batch
    cache_epoch: int = -1  # the prefix cache's epoch when the request was admitted
    reused_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prefill_tokens: int = 0  # prompt tokens prefilled


@dataclass
class _Row:
    """One sequence in the batch: output `slot` of its request."""

    pending: _Pending
    slot: int
    generator: torch.Generator | None

    @property
    def params(self) -> SamplingParams:
        return self.pending.request.params


class HFEngine:
    """Inference engine over a transformers causal LM.

    Args:
        model_path: bundled name, local HF directory or hub id.
        dtype: "float32" | "bfloat16" | "float16".
        max_batch_size: most sequences decoded together.
        seed: seed of the sampling generator.
        device: torch device ("cpu", "cuda").
        continuous_batching: admit queued requests into the running batch at every token (True), or only
            once the batch is empty (False: decoding in waves).
        prefix_cache_tokens: 0, or the most tokens whose KV the prefix cache keeps (least recently used
            evicted): single-sample sequences that finished keep their KV, and a later prompt extending
            one (the next turn of a conversation) prefills only its new tokens (`prefix_cache.py`).
        admit_wait_steps: token boundaries a queued request lets pass before it joins a running batch, so
            that arrivals join together: queued requests join once the oldest of them let this many pass
            (at once when the batch is empty). Each admission into a running batch costs a prefill forward
            and a merge of the KV cache, whose fixed cost dominates on a small model; with the default a
            running batch takes at most one admission per 5 decode steps (requests that waited for room
            aside), and an arrival starts at most 4 tokens later. Counted in tokens, not seconds, so the
            trade-off is the same however long a token takes (a loaded CPU, a larger model). 0: join at
            the next token boundary.

    `stats`: `tokens` sampled, `prefills` (one per admission, however many requests it admits),
    `prefill_tokens` (prompt tokens prefilled), `waves` (times decoding started on an empty batch; the
    other `prefills - waves` admissions merged into a running batch), `decode_steps` (forwards of one
    token per row: every forward is a prefill or a decode step), `decode_seconds` (wall time with a batch
    running). A completion's metadata carries `queue_seconds`, from `generate` to its admission.
    """

    def __init__(self, model_path: str, dtype: str = "float32", max_batch_size: int = 256, seed: int = 0,
                 device: str = "cpu", trust_remote_code: bool = False, continuous_batching: bool = True,
                 prefix_cache_tokens: int = 0, admit_wait_steps: int = 4):
        if admit_wait_steps < 0:
            raise ValueError(f"admit_wait_steps must be >= 0, got {admit_wait_steps}")
        self.device = torch.device(device)
        self.model = load_causal_lm(model_path, dtype, trust_remote_code).to(self.device)
        self._cache_kwarg = cache_keyword(self.model)
        self.mrope = uses_mrope(self.model)  # Qwen2-VL's family: three-axis positions, images in the prompt
        if self.device.type == "cpu":
            use_cpu_attention(self.model)
        tokenizer = load_tokenizer(model_path, trust_remote_code)
        self.eos_ids = eos_token_ids(self.model, tokenizer)
        self.pad_id = tokenizer.pad_token_id
        self.max_batch_size = max_batch_size
        self.continuous_batching = continuous_batching
        self.admit_wait_steps = admit_wait_steps
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self._lifecycle = EngineLifecycle()
        self._queue: deque[_Pending] = deque()
        self._unresolved: set[_Pending] = set()  # queued or in the batch; what close() must resolve
        self._aborted: set[str] = set()  # ids of requests in the batch that the next token step drops
        self._runner: asyncio.Task | None = None
        self.stats = {"tokens": 0, "prefills": 0, "prefill_tokens": 0, "waves": 0, "decode_steps": 0,
                      "decode_seconds": 0.0}
        self.batch_trace: list[int] | None = None  # a list: each token step appends its running rows

    @property
    def version(self) -> int:
        return self._lifecycle.version

    def prefix_cache_stats(self) -> dict:
        """`prefilled_tokens` and `reused_tokens` (prompt tokens computed / taken from the prefix cache),
        `lookups`, `hits`, `invalidations`, and the `entries` and `cached_tokens` held now."""
        cache = self.prefix_cache
        return {"prefilled_tokens": self.stats["prefill_tokens"], **cache.stats, "entries": len(cache),
                "cached_tokens": cache.cached_tokens}

    # ---- protocol ------------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> Completion:
        """Sample `request.params.n` completions of one prompt; RuntimeError while asleep or closed,
        EngineError when decoding fails (NaN logits, a device error)."""
        self._lifecycle.check_can_generate()
        pending = _Pending(request, asyncio.get_running_loop().create_future(),
                           submitted_step=self.stats["decode_steps"])
        self._queue.append(pending)
        self._unresolved.add(pending)
        if self._runner is None or self._runner.done():
            self._runner = asyncio.get_running_loop().create_task(self._run())
        return await pending.future

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests; their futures resolve with what was generated so far (`abort`).

        Queued requests resolve at once; requests in the batch at the next token boundary. Unknown or
        finished ids are ignored.
        """
        ids = set(request_ids)
        for pending in [p for p in self._queue if p.request.request_id in ids]:
            self._queue.remove(pending)
            outputs = [CompletionOutput(finish_reason="abort") for _ in range(pending.request.params.n)]
            self._resolve(pending, outputs)
        self._aborted.update(ids & {p.request.request_id for p in self._unresolved})

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Load trainer weights in place; KeyError, before any is loaded, for names the model lacks.

        May be called between tokens of running requests (partial rollout): their later tokens are
        sampled with the new weights and carry `version`; the KV cache of their earlier tokens is kept as
        the old weights computed it. The prefix cache is emptied (its KV is the old weights'), and those
        requests' sequences do not enter it.
        """
        self._lifecycle.check_open()
        params = dict(self.model.named_parameters())
        unknown = sorted(set(named_tensors) - set(params))
        if unknown:
            raise KeyError(f"weights for unknown parameters: {unknown[:5]}")
        self.prefix_cache.clear()
        with torch.no_grad():
            for name, tensor in named_tensors.items():
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))
        self._lifecycle.version = version

    def sleep(self) -> None:
        """Release memory between rollout phases (moves weights to CPU on an accelerator, empties the
        prefix cache)."""
        self.prefix_cache.clear()
        on_accelerator = self.device.type != "cpu"
        self._lifecycle.sleep(lambda: self.model.to("cpu") if on_accelerator else None,
                              weights_released=on_accelerator)

    def wake(self) -> None:
        """Undo `sleep()` (weights back on the accelerator)."""
        self._lifecycle.wake(lambda: self.model.to(self.device) if self.device.type != "cpu" else None)

    def close(self) -> None:
        """Stop decoding, resolve every unfinished request and drop the model (idempotent).

        Each unfinished request resolves at once: samples that already finished keep their output, the
        others end "abort" with no tokens (tokens of a running sample are not copied out of the batch's
        buffers). Later `generate` / `update_weights` / `sleep` / `wake` calls raise RuntimeError.
        """
        if not self._lifecycle.close():
            return
        if self._runner is not None and not self._runner.done() and not self._runner.get_loop().is_closed():
            self._runner.cancel()  # it stops at its next await, before touching the model again
        for pending in list(self._unresolved):
            if pending.future.get_loop().is_closed():  # its loop is gone, and whoever awaited it with it
                continue
            # In the batch, `outputs` holds finished samples and "abort" placeholders; queued, it is empty.
            outputs = pending.outputs or [CompletionOutput(finish_reason="abort")
                                          for _ in range(pending.request.params.n)]
            self._resolve(pending, outputs)
        self._unresolved.clear()
        self._queue.clear()
        self._aborted.clear()
        self.prefix_cache.clear()
        self.model = None

    # ---- decoding ------------------------------------------------------------------------------------
    async def _run(self) -> None:
        """Decode while requests are queued or running, admitting arrivals at token boundaries; a failure
        fails every unresolved request (none waits)."""
        batch: DecodeBatch | None = None
        try:
            while self._queue or batch is not None:
                if batch is None:
                    await self._gather_arrivals()
                admitted = self._admit(batch)
                if admitted:
                    batch = self._join(batch, admitted)
                if batch is not None and not self._sample_step(batch):
                    self.stats["decode_seconds"] += time.perf_counter() - batch.started
                    batch = None
                # abort / generate / update_weights calls land here, between a token's sampling and the
                # forward that computes the next one's logits: a token's version is that of the weights
                # that computed its logits.
                await asyncio.sleep(0)
                if batch is not None:
                    self._feed(batch)
        except asyncio.CancelledError:
            if not self._lifecycle.closed:  # close() resolves them itself; anyone else cancelling fails them
                self._fail_unresolved(RuntimeError("the decode loop was cancelled"))
            raise
        except Exception as err:  # the runner is nobody's awaitable: the error goes to each waiting request
            self._fail_unresolved(err)

    def _fail_unresolved(self, cause: BaseException) -> None:
        """Fail every queued or in-batch request with `decoding_failed(cause)`; later ones start afresh."""
        for pending in list(self._unresolved):
            if not pending.future.done() and not pending.future.get_loop().is_closed():
                pending.future.set_exception(decoding_failed("hf", cause))
        self._unresolved.clear()
        self._queue.clear()
        self._aborted.clear()

    async def _gather_arrivals(self, settle_s: float = 0.002, max_wait_s: float = 0.05) -> None:
        """Let requests that are arriving right now start decoding together instead of one by one.

        Waits, before decoding starts on an empty batch, while the queue keeps growing (at most
        `max_wait_s`): one prefill of 500 single-sample requests costs about what one request's does.
        """
        deadline = time.perf_counter() + max_wait_s
        size = -1
        while len(self._queue) != size and time.perf_counter() < deadline:
            size = len(self._queue)
            await asyncio.sleep(settle_s)

    def _admit(self, batch: DecodeBatch | None) -> list[_Pending]:
        """The queued requests that join the batch now, first come first served.

        Requests join while the running sequences stay within `max_batch_size` (a request larger than that
        runs alone). A running batch takes them once the oldest let `admit_wait_steps` token boundaries
        pass (`_arrivals_due`). They wait for an empty batch when continuous batching is off, or when the
        model's KV cache is not one this engine can merge (sliding-window or linear-attention layers).
        """
        running = 0 if batch is None else batch.running
        if batch is not None and not (self.continuous_batching and batch.mergeable and self._arrivals_due()):
            return []
        admitted = []
        while self._queue:
            n = self._queue[0].request.params.n
            if (admitted or running) and running + n > self.max_batch_size:
                break
            admitted.append(self._queue.popleft())
            running += n
        return admitted

    def _arrivals_due(self) -> bool:
        """Whether queued requests may join the running batch: the oldest let `admit_wait_steps` token
        boundaries pass.

        A request arrives while the loop yields between a token's sampling and the next decode step, so the
        first boundary it reaches finds one more decode step than it was queued with.
        """
        return bool(self._queue) and (self.stats["decode_steps"] - self._queue[0].submitted_step
                                      > self.admit_wait_steps)

    def _join(self, batch: DecodeBatch | None, admitted: list[_Pending]) -> DecodeBatch:
        """Prefill the admitted requests' prompts and add their rows to `batch` (or start one).

        One prefill per request, not per sample: the `n` rows of a request share their prompt's KV cache.
        A prompt that extends a sequence in the prefix cache prefills only the tokens past it.
        """
        rows = [_Row(pending, slot, self._row_generator(pending.request.params, slot))
                for pending in admitted for slot in range(pending.request.params.n)]
        for pending in admitted:
            # "abort" until the sample finishes (`_finish_row` sets the reason), so close() can resolve
            # a request mid-batch with the right reason on every sample.
            pending.outputs = [CompletionOutput(finish_reason="abort")
                               for _ in range(pending.request.params.n)]
            pending.unfinished = pending.request.params.n
            pending.cache_epoch = self.prefix_cache.epoch
            pending.admitted = time.perf_counter()
        # A multimodal rotary model's positions depend on the images of the whole prompt: no prefix reuse.
        hits = [None if self.mrope else self.prefix_cache.lookup(p.request.prompt_ids) for p in admitted]
        for pending, hit in zip(admitted, hits):
            pending.reused_tokens = hit.length if hit else 0
            pending.prefill_tokens = len(pending.request.prompt_ids) - pending.reused_tokens
        self.stats["prefill_tokens"] += sum(p.prefill_tokens for p in admitted)
        input_ids, attention = left_pad([p.request.prompt_ids[p.reused_tokens:] for p in admitted],
                                        self.pad_id, self.device)  # [R, S] the tokens to prefill
        # [R, P] attention (P = S + the longest reused prefix), [R, S] positions, that prefix's cache or None
        attention, positions, cache = with_prefixes(hits, attention)
        rope_deltas = None
        if self.mrope:  # [3, R, S] positions from the prompts' images (and their pixels), [R] deltas
            inputs, rope_deltas = vision_inputs(self.model, input_ids, attention,
                                                stack_vision([p.request.vision for p in admitted]))
        elif any(p.request.vision is not None for p in admitted):
            raise ValueError("a request has images, but the engine's model is a text-only model")
        else:
            inputs = {"position_ids": positions}
        logits, cache = self._forward(input_ids, attention, inputs, cache)  # [R, V]
        samples = [p.request.params.n for p in admitted]
        # [N, V], [N, P]: each sample its own row of its request's prefill
        logits, attention = repeat_requests(cache, logits, attention, samples)
        if rope_deltas is not None:
            rope_deltas = rope_deltas.repeat_interleave(torch.tensor(samples, device=rope_deltas.device))  # [N]
        self.stats["prefills"] += 1
        joining = DecodeBatch.build(rows, logits, cache, attention, self.eos_ids, self.generator, rope_deltas)
        if batch is None:
            self.stats["waves"] += 1
            return joining
        batch.merge(joining, self.generator)
        return batch

    def _sample_step(self, batch: DecodeBatch) -> bool:
        """Sample one token for every running row; False once no row runs.

        The per-token work is a handful of batched tensor ops: tokens, logprobs and versions go into
        preallocated `[B, W]` buffers at each row's own position, stop / length checks are one comparison,
        and Python touches a row only when it finishes. Rows that finished leave the batch (and its KV
        cache) once a quarter of it idles, or when requests join, so short answers stop costing compute.
        """
        self._drop_aborted(batch)
        if not batch.running:
            return False
        if self.batch_trace is not None:
            self.batch_trace.append(batch.running)
        tokens, logprobs = self._sample(batch)  # [B], [B]
        batch.record(tokens, logprobs, self._lifecycle.version)
        self.stats["tokens"] += batch.running
        stopped = (tokens.unsqueeze(1) == batch.stop_ids).any(1)  # [B]
        finished = batch.active & (stopped | (batch.lengths >= batch.limits))  # [B]
        done = torch.nonzero(finished).flatten()  # [D]
        if not len(done):
            return True
        for i, length, stop in zip(done.tolist(), batch.lengths[done].tolist(), stopped[done].tolist()):
            self._finish_row(batch, i, length, "stop" if stop else "length")  # Python sees finished rows only
        batch.active &= ~finished
        batch.running -= len(done)
        if batch.running and 4 * batch.running <= 3 * len(batch.rows):  # a quarter idles: drop it
            batch.select(torch.nonzero(batch.active).flatten())
        return batch.running > 0

    def _feed(self, batch: DecodeBatch) -> None:
        """Run the model on every row's last sampled token: the next token's logits, one more cache column."""
        batch.attention = torch.cat([batch.attention, batch.active.long().unsqueeze(1)], dim=1)  # [B, L + 1]
        self.stats["decode_steps"] += 1
        positions = batch.positions.unsqueeze(1)  # [B, 1]
        if self.mrope:  # a generated token is text: the same position on all three axes
            positions = (positions + batch.rope_deltas.unsqueeze(1)).unsqueeze(0).expand(3, -1, -1)  # [3, B, 1]
        batch.logits, batch.cache = self._forward(batch.last_tokens.unsqueeze(1), batch.attention,
                                                  {"position_ids": positions}, batch.cache)
        batch.positions += batch.active  # finished rows keep their last position (never past their own)

    @torch.no_grad()
    def _forward(self, input_ids, attention, inputs: dict, cache):
        """One forward with the cache; `inputs`: `position_ids`, or a vision-language prefill's
        (`vision_inputs`). Returns ([N, V] last logits, the cache)."""
        inputs = {"input_ids": input_ids, **inputs}  # a prefill's images replace the ids by embeddings
        output = self.model(attention_mask=attention, use_cache=True, logits_to_keep=1, **inputs,
                            **{self._cache_kwarg: cache})
        next_cache = getattr(output, "cache", None)
        if next_cache is None:
            next_cache = output.past_key_values
        return output.logits[:, -1].float(), next_cache  # [N, V]

    def _row_generator(self, params: SamplingParams, slot: int) -> torch.Generator | None:
        if params.seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(sample_seed(params.seed, slot))

    def _sample(self, batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one token per batch row (`sampling.sample_tokens`). Returns ([B] tokens, [B] logprobs).

        In a batch with seeded rows every row draws from its own pre-drawn uniform for its own position
        (`DecodeBatch.uniforms`); rows not yet at `min_new_tokens` cannot choose a stop id.
        """
        uniforms = batch.uniforms.gather(1, batch.lengths.unsqueeze(1)).squeeze(1) if batch.any_seeded else None
        blocked = batch.lengths < batch.min_tokens if batch.any_min_tokens else None  # [B]
        return sample_tokens(batch.logits, batch.temperatures, batch.greedy, all_greedy=batch.all_greedy,
                             filter_params=batch.params if batch.needs_filter else None,
                             stop_ids=batch.stop_ids if batch.any_min_tokens else None, stop_blocked=blocked,
                             uniforms=uniforms, generator=self.generator)

    def _finish_row(self, batch: DecodeBatch, i: int, length: int, reason: FinishReason) -> None:
        """Copy batch row `i`'s first `length` tokens out of the buffers; resolve its request once all
        of its rows finished."""
        row = batch.rows[i]
        out = row.pending.outputs[row.slot]
        out.token_ids = batch.tokens[i, :length].tolist()
        out.logprobs = batch.logprobs[i, :length].tolist()
        out.policy_versions = batch.versions[i, :length].tolist()
        out.finish_reason = reason
        if (reason != "abort" and row.params.n == 1 and batch.mergeable and self.prefix_cache.enabled
                and not self.mrope
                and row.pending.cache_epoch == self.prefix_cache.epoch):  # KV all from the current weights
            # The last sampled token was never fed: the cache holds the prompt and the tokens before it.
            self.prefix_cache.insert(row.pending.request.prompt_ids + out.token_ids[:-1],
                                     lambda: batch.row_kv(i))
        row.pending.unfinished -= 1
        if row.pending.unfinished == 0:
            self._resolve(row.pending, row.pending.outputs)

    def _drop_aborted(self, batch: DecodeBatch) -> None:
        if not self._aborted:
            return
        for i in torch.nonzero(batch.active).flatten().tolist():
            row = batch.rows[i]
            if row.pending.request.request_id in self._aborted:
                batch.active[i] = False
                batch.running -= 1
                self._finish_row(batch, i, int(batch.lengths[i]), "abort")

    def _resolve(self, pending: _Pending, outputs: list[CompletionOutput]) -> None:
        self._aborted.discard(pending.request.request_id)
        self._unresolved.discard(pending)
        if not pending.future.done():
            now = time.perf_counter()
            admitted = now if pending.admitted is None else pending.admitted  # None: resolved while queued
            metadata = {"seconds": now - pending.submitted, "queue_seconds": admitted - pending.submitted,
                        "version": self._lifecycle.version, "prefill_tokens": pending.prefill_tokens,
                        "prefix_reused_tokens": pending.reused_tokens}
            pending.future.set_result(Completion(pending.request.request_id, outputs, metadata))


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Left-padded `[R, P]` input ids and attention mask."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt):] = torch.tensor(prompt)
        attention[i, width - len(prompt):] = 1
    return input_ids.to(device), attention.to(device)
