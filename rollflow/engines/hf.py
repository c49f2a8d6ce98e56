"""`hf` engine: batched KV-cache decoding with plain transformers models, on CPU or GPU.

Requests queue up; a runner coroutine takes every pending sequence (up to `max_batch_size`) into one
"wave": a left-padded prefill of each request's prompt (once, shared by its `n` samples), then a
token-by-token decode loop that yields to the event loop between tokens, so `abort` and new `generate`
calls are served while a wave runs. A request's future resolves as
soon as all of its sequences finish, while the rest of the wave keeps decoding, so its rewards can be
computed early. Requests that arrive during a wave join the next one. When decoding raises (a CUDA
error, NaN logits from non-finite weights), every request still queued or in the wave fails with one
`EngineError` and the next `generate` starts afresh.

The engine runs on the caller's event loop (no thread of its own): call every method from that loop's
thread.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rollflow.engines.base import (
    Completion,
    CompletionOutput,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    decoding_failed,
    sample_seed,
)
from rollflow.engines.lifecycle import EngineLifecycle
from rollflow.models import eos_token_ids, load_causal_lm, load_tokenizer


@dataclass(eq=False)  # compared and hashed by identity: the engine keeps a set of them
class _Pending:
    request: GenerationRequest
    future: asyncio.Future
    outputs: list[CompletionOutput] = field(default_factory=list)
    unfinished: int = 0
    submitted: float = field(default_factory=time.perf_counter)


class HFEngine:
    """Inference engine over a transformers causal LM.

    Args:
        model_path: bundled name, local HF directory or hub id.
        dtype: "float32" | "bfloat16" | "float16".
        max_batch_size: most sequences decoded together in one wave.
        seed: seed of the sampling generator.
        device: torch device ("cpu", "cuda").
    """

    def __init__(self, model_path: str, dtype: str = "float32", max_batch_size: int = 256, seed: int = 0,
                 device: str = "cpu", trust_remote_code: bool = False):
        self.device = torch.device(device)
        self.model = load_causal_lm(model_path, dtype, trust_remote_code).to(self.device)
        if self.device.type == "cpu":
            _use_cpu_decode_attention(self.model)
        tokenizer = load_tokenizer(model_path, trust_remote_code)
        self.eos_ids = eos_token_ids(self.model, tokenizer)
        self.pad_id = tokenizer.pad_token_id
        self.max_batch_size = max_batch_size
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._lifecycle = EngineLifecycle()
        self._queue: deque[_Pending] = deque()
        self._unresolved: set[_Pending] = set()  # queued or in a wave; what close() must resolve
        self._aborted: set[str] = set()
        self._runner: asyncio.Task | None = None
        self.stats = {"tokens": 0, "waves": 0, "decode_seconds": 0.0}

    @property
    def version(self) -> int:
        return self._lifecycle.version

    # ---- protocol ------------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> Completion:
        """Sample `request.params.n` completions of one prompt; RuntimeError while asleep or closed,
        EngineError when decoding fails (NaN logits, a device error)."""
        self._lifecycle.check_can_generate()
        pending = _Pending(request, asyncio.get_running_loop().create_future())
        self._queue.append(pending)
        self._unresolved.add(pending)
        if self._runner is None or self._runner.done():
            self._runner = asyncio.get_running_loop().create_task(self._run())
        return await pending.future

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests; their futures resolve with what was generated so far (`abort`)."""
        self._aborted.update(request_ids)
        for pending in [p for p in self._queue if p.request.request_id in self._aborted]:
            self._queue.remove(pending)
            outputs = [CompletionOutput(finish_reason="abort") for _ in range(pending.request.params.n)]
            self._resolve(pending, outputs)

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Load trainer weights in place; KeyError, before any is loaded, for names the model lacks."""
        self._lifecycle.check_open()
        params = dict(self.model.named_parameters())
        unknown = sorted(set(named_tensors) - set(params))
        if unknown:
            raise KeyError(f"weights for unknown parameters: {unknown[:5]}")
        with torch.no_grad():
            for name, tensor in named_tensors.items():
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))
        self._lifecycle.version = version

    def sleep(self) -> None:
        """Release memory between rollout phases (moves weights to CPU on an accelerator)."""
        on_accelerator = self.device.type != "cpu"
        self._lifecycle.sleep(lambda: self.model.to("cpu") if on_accelerator else None,
                              weights_released=on_accelerator)

    def wake(self) -> None:
        """Undo `sleep()` (weights back on the accelerator)."""
        self._lifecycle.wake(lambda: self.model.to(self.device) if self.device.type != "cpu" else None)

    def close(self) -> None:
        """Stop decoding, resolve every unfinished request and drop the model (idempotent).

        Each unfinished request resolves at once: samples that already finished keep their output, the
        others end "abort" with no tokens (tokens of a running wave are not copied out of its buffers).
        Later `generate` / `update_weights` / `sleep` / `wake` calls raise RuntimeError.
        """
        if not self._lifecycle.close():
            return
        if self._runner is not None and not self._runner.done() and not self._runner.get_loop().is_closed():
            self._runner.cancel()  # it stops at its next await, before touching the model again
        for pending in list(self._unresolved):
            if pending.future.get_loop().is_closed():  # its loop is gone, and whoever awaited it with it
                continue
            # In a wave, `outputs` holds finished samples and "abort" placeholders; queued, it is empty.
            outputs = pending.outputs or [CompletionOutput(finish_reason="abort")
                                          for _ in range(pending.request.params.n)]
            self._resolve(pending, outputs)
        self._unresolved.clear()
        self._queue.clear()
        self._aborted.clear()
        self.model = None

    # ---- decoding ------------------------------------------------------------------------------------
    async def _run(self) -> None:
        """Decode waves until the queue is empty; a failure fails every unresolved request (none waits)."""
        try:
            while self._queue:
                await self._gather_arrivals()
                wave: list[_Pending] = []
                sequences = 0
                while self._queue and (not wave or sequences + self._queue[0].request.params.n
                                       <= self.max_batch_size):
                    pending = self._queue.popleft()
                    wave.append(pending)
                    sequences += pending.request.params.n
                await self._decode_wave(wave)
        except asyncio.CancelledError:
            if not self._lifecycle.closed:  # close() resolves them itself; anyone else cancelling fails them
                self._fail_unresolved(RuntimeError("the decode loop was cancelled"))
            raise
        except Exception as err:  # the runner is nobody's awaitable: the error goes to each waiting request
            self._fail_unresolved(err)

    def _fail_unresolved(self, cause: BaseException) -> None:
        """Fail every queued or in-wave request with `decoding_failed(cause)`; later requests start afresh."""
        for pending in list(self._unresolved):
            self._aborted.discard(pending.request.request_id)
            if not pending.future.done() and not pending.future.get_loop().is_closed():
                pending.future.set_exception(decoding_failed("hf", cause))
        self._unresolved.clear()
        self._queue.clear()

    async def _gather_arrivals(self, settle_s: float = 0.002, max_wait_s: float = 0.05) -> None:
        """Let requests that are arriving right now join this wave instead of each starting its own.

        Waits while the queue keeps growing (at most `max_wait_s`); a wave is one prefill plus a decode
        loop, so 500 single-sample requests in one wave cost about what one request does.
        """
        deadline = time.perf_counter() + max_wait_s
        size = -1
        while len(self._queue) != size and time.perf_counter() < deadline:
            size = len(self._queue)
            await asyncio.sleep(settle_s)

    def _resolve(self, pending: _Pending, outputs: list[CompletionOutput]) -> None:
        self._aborted.discard(pending.request.request_id)
        self._unresolved.discard(pending)
        if not pending.future.done():
            metadata = {"seconds": time.perf_counter() - pending.submitted,
                        "version": self._lifecycle.version}
            pending.future.set_result(Completion(pending.request.request_id, outputs, metadata))

    async def _decode_wave(self, wave: list[_Pending]) -> None:
        """Prefill every request's prompt once, then decode all of its `n` rows together until each stops.

        The decode loop is written so the per-token work is a handful of batched tensor ops: tokens and
        logprobs go into preallocated `[N, T]` buffers, stop / length checks are one comparison, and
        Python touches a row only when it finishes. Rows that finished are dropped from the batch (and
        their KV cache) once a quarter of it is idle, so short answers stop costing compute.
        """
        started = time.perf_counter()
        rows = [_Row(pending, slot, self._row_generator(pending.request.params, slot))
                for pending in wave for slot in range(pending.request.params.n)]
        for pending in wave:
            # "abort" until the sample finishes (`_finish_row` sets the reason), so close() can resolve
            # a request mid-wave with the right reason on every sample.
            pending.outputs = [CompletionOutput(finish_reason="abort")
                               for _ in range(pending.request.params.n)]
            pending.unfinished = pending.request.params.n
        state = _WaveState.build(rows, self.eos_ids, self.device, self.generator)

        # One prefill per request, not per sample: the n rows of a request share their prompt's KV cache.
        prompts = [p.request.prompt_ids for p in wave]
        input_ids, attention = left_pad(prompts, self.pad_id, self.device)  # [R, P]
        positions = (attention.cumsum(1) - 1).clamp(min=0)  # [R, P]
        logits, cache = self._forward(input_ids, attention, positions, None)  # [R, V]; None: a new cache
        request_of_row = torch.tensor([i for i, p in enumerate(wave) for _ in range(p.request.params.n)],
                                      device=self.device)  # [N]
        if len(rows) != len(wave):
            cache.batch_select_indices(request_of_row)
            logits, attention = logits[request_of_row], attention[request_of_row]  # [N, V], [N, P]
            positions = positions[request_of_row]  # [N, P]

        step = 0
        while True:
            self._drop_aborted(state, step)
            active_rows = int(state.active.sum())
            if not active_rows:
                break
            tokens, logprobs = self._sample(logits, state, step)  # [B], [B]
            state.versions.append(self._lifecycle.version)
            state.tokens[state.origin, step] = tokens
            state.logprobs[state.origin, step] = logprobs
            step += 1
            self.stats["tokens"] += active_rows
            stopped = (tokens.unsqueeze(1) == state.stop_ids).any(1)  # [B]
            finished = state.active & (stopped | (state.limits <= step))  # [B]
            done = torch.nonzero(finished).flatten().tolist()
            for i in done:  # Python sees a row only when it finishes
                self._finish_row(state, state.rows[i], step, "stop" if stopped[i] else "length")
            if done:
                state.active &= ~finished
            if active_rows == len(done):
                break
            if 4 * (active_rows - len(done)) <= 3 * len(state.rows):  # a quarter of the batch idles: drop it
                keep = torch.nonzero(state.active).flatten()  # [B']
                cache.batch_select_indices(keep)
                tokens, attention, positions = tokens[keep], attention[keep], positions[keep]
                state.select(keep)
            attention = torch.cat([attention, state.active.long().unsqueeze(1)], dim=1)  # [B, P + step]
            positions = positions[:, -1:] + 1  # [B, 1]
            logits, cache = self._forward(tokens.unsqueeze(1), attention, positions, cache)
            await asyncio.sleep(0)  # let abort / generate calls in between tokens
        for pending in wave:  # rows still unresolved (all aborted before their first token)
            if not pending.future.done():
                self._resolve(pending, pending.outputs)
        self.stats["waves"] += 1
        self.stats["decode_seconds"] += time.perf_counter() - started

    @torch.no_grad()
    def _forward(self, input_ids, attention, positions, cache):
        output = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                            cache=cache, use_cache=True, logits_to_keep=1)
        next_cache = getattr(output, "cache", None)
        if next_cache is None:
            next_cache = output.past_key_values
        return output.logits[:, -1].float(), next_cache  # [N, V]

    def _row_generator(self, params: SamplingParams, slot: int) -> torch.Generator | None:
        if params.seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(sample_seed(params.seed, slot))

    @torch.no_grad()
    def _sample(self, logits: torch.Tensor, state: _WaveState, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one token per batch row. Returns ([B] tokens, [B] logprobs of those tokens).

        Logprobs are log-softmax(logits / temperature) before top-k / top-p (temperature 1 when greedy).
        In a batch with seeded rows every row samples by inverse CDF from its own pre-drawn uniform for this
        position (`_WaveState.uniforms`), so a seeded row's draw depends on nothing else in the batch.
        """
        scaled = logits / state.temperatures.unsqueeze(1)  # [B, V]; greedy rows carry temperature 1
        log_probs = torch.log_softmax(scaled, dim=-1)  # [B, V]
        # NaN / inf logits would make greedy rows emit garbage and sampled rows crash multinomial (a
        # device-side assert on CUDA, which poisons the process): refuse them here, in one clear line.
        if bool(torch.isnan(log_probs).any()):
            raise FloatingPointError("the model's logits are not finite (non-finite weights?)")
        tokens = log_probs.argmax(-1)  # [B] greedy choice
        if not state.all_greedy:
            if state.needs_filter:
                probs = torch.softmax(_filter_top_k_top_p(scaled, [row.params for row in state.rows]), dim=-1)
            else:
                probs = log_probs.exp()  # [B, V]
            if state.any_seeded:  # inverse CDF: the first token whose cumulative probability exceeds u
                cdf = probs.cumsum(-1)  # [B, V]
                u = state.uniforms[state.origin, step].unsqueeze(1) * cdf[:, -1:]  # [B, 1], below the total
                draws = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=probs.shape[1] - 1)  # [B]
            else:
                draws = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)  # [B]
            tokens = torch.where(state.greedy, tokens, draws)
        return tokens, log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1)

    def _finish_row(self, state: _WaveState, row: _Row, length: int, reason: FinishReason) -> None:
        """Copy a finished row's tokens out of the wave buffers; resolve its request once all rows are."""
        out = row.pending.outputs[row.slot]
        out.token_ids = state.tokens[row.index, :length].tolist()
        out.logprobs = state.logprobs[row.index, :length].tolist()
        out.policy_versions = state.versions[:length]
        out.finish_reason = reason
        row.pending.unfinished -= 1
        if row.pending.unfinished == 0:
            self._resolve(row.pending, row.pending.outputs)

    def _drop_aborted(self, state: _WaveState, step: int) -> None:
        if not self._aborted:
            return
        for i in torch.nonzero(state.active).flatten().tolist():
            row = state.rows[i]
            if row.pending.request.request_id in self._aborted:
                state.active[i] = False
                self._finish_row(state, row, step, "abort")


@dataclass
class _Row:
    """One sequence of a wave: output `slot` of its request."""

    pending: _Pending
    slot: int
    generator: torch.Generator | None
    index: int = 0  # position in the wave's output buffers (fixed; batch positions change as rows finish)

    @property
    def params(self) -> SamplingParams:
        return self.pending.request.params


@dataclass
class _WaveState:
    """Per-row tensors of the rows still in the decode batch ([B]) and the wave's output buffers ([N, T])."""

    rows: list[_Row]  # batch position -> row
    origin: torch.Tensor  # [B] buffer index of each batch row
    active: torch.Tensor  # [B] still generating
    temperatures: torch.Tensor  # [B] (1 for greedy rows)
    greedy: torch.Tensor  # [B]
    limits: torch.Tensor  # [B] max_new_tokens
    stop_ids: torch.Tensor  # [B, S] EOS + stop ids, padded with -1
    tokens: torch.Tensor  # [N, T]
    logprobs: torch.Tensor  # [N, T]
    versions: list[int] = field(default_factory=list)  # policy version at each decode step
    all_greedy: bool = False
    needs_filter: bool = False
    any_seeded: bool = False
    uniforms: torch.Tensor | None = None  # [N, T] sampling uniforms when a row is seeded

    @classmethod
    def build(cls, rows: list[_Row], eos_ids: list[int], device: torch.device,
              engine_generator: torch.Generator | None = None) -> _WaveState:
        for index, row in enumerate(rows):
            row.index = index
        stops = [sorted(set(eos_ids) | set(row.params.stop_token_ids)) for row in rows]
        stop_ids = torch.full((len(rows), max(1, max(len(s) for s in stops))), -1, dtype=torch.long)
        for i, ids in enumerate(stops):
            stop_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        temperatures = torch.tensor([row.params.temperature for row in rows], device=device)
        limits = torch.tensor([row.params.max_new_tokens for row in rows], device=device)
        width = int(limits.max())
        state = cls(rows=rows, origin=torch.arange(len(rows), device=device),
                    active=torch.ones(len(rows), dtype=torch.bool, device=device),
                    temperatures=torch.where(temperatures == 0, torch.ones_like(temperatures), temperatures),
                    greedy=temperatures == 0, limits=limits, stop_ids=stop_ids.to(device),
                    tokens=torch.zeros(len(rows), width, dtype=torch.long, device=device),
                    logprobs=torch.zeros(len(rows), width, device=device))
        state.refresh_flags()
        if state.any_seeded:  # [N, T] one uniform per position, from the row's generator (the engine's if unseeded)
            state.uniforms = torch.stack([torch.rand(width, generator=row.generator or engine_generator,
                                                     device=device) for row in rows])
        return state

    def refresh_flags(self) -> None:
        """Batch-wide facts `_sample` branches on, computed once per batch change instead of per token."""
        self.all_greedy = all(row.params.temperature == 0 for row in self.rows)
        self.needs_filter = any(row.params.top_k > 0 or row.params.top_p < 1.0 for row in self.rows)
        self.any_seeded = any(row.generator is not None for row in self.rows)

    def select(self, keep: torch.Tensor) -> None:
        """Keep only batch rows `keep` ([B'] indices)."""
        keep_list = keep.tolist()
        self.rows = [self.rows[i] for i in keep_list]
        self.origin, self.active = self.origin[keep], self.active[keep]
        self.temperatures, self.greedy = self.temperatures[keep], self.greedy[keep]
        self.limits, self.stop_ids = self.limits[keep], self.stop_ids[keep]
        self.refresh_flags()


CPU_DECODE_ATTENTION = "rollflow_cpu_decode"


def cpu_decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0,
                         scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of one new token per row as matmul, softmax, matmul; anything else goes to torch's sdpa.

    On CPU, `scaled_dot_product_attention` with a single query token runs ~1.5-2x slower than these
    three ops (it is built for long queries), and decode is nearly all single-token attention.

    Args:
        query: [B, H, 1, D]; key, value: [B, KV, L, D] (H a multiple of KV: grouped-query attention).
        attention_mask: None or transformers' sdpa mask, bool [B, 1, 1, L] (True: attend).

    Returns:
        ([B, 1, H, D] attention output, None), the attention-interface convention.
    """
    plain = (query.shape[2] == 1 and not dropout and kwargs.get("softcap") is None
             and kwargs.get("s_aux") is None and (attention_mask is None or attention_mask.shape[1] == 1))
    if not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    batch, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)  # [B, KV, G, D]
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float()  # [B, KV, G, L]
    scores = scores * (scaling if scaling is not None else dim ** -0.5)
    if attention_mask is not None:
        mask = attention_mask.reshape(batch, 1, 1, length)  # [B, 1, 1, L]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1).to(value.dtype)  # [B, KV, G, L]
    output = torch.matmul(probs, value)  # [B, KV, G, D]
    return output.reshape(batch, heads, 1, dim).transpose(1, 2), None


AttentionInterface.register(CPU_DECODE_ATTENTION, cpu_decode_attention)
AttentionMaskInterface.register(CPU_DECODE_ATTENTION, sdpa_mask)  # same masks as sdpa


def _use_cpu_decode_attention(model: torch.nn.Module) -> None:
    """Switch a model that uses sdpa to `cpu_decode_attention` (models with their own attention keep it)."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(CPU_DECODE_ATTENTION)


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Left-padded `[R, P]` input ids and attention mask."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt):] = torch.tensor(prompt)
        attention[i, width - len(prompt):] = 1
    return input_ids.to(device), attention.to(device)


def _filter_top_k_top_p(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask logits outside each row's top-k / top-p set with -inf. [S, V] -> [S, V]."""
    if all(p.top_k == 0 and p.top_p >= 1.0 for p in params):
        return scaled
    out = scaled.clone()
    for row, p in enumerate(params):
        if p.top_k > 0:
            kth = torch.topk(out[row], min(p.top_k, out.shape[1])).values[-1]
            out[row][out[row] < kth] = float("-inf")
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(out[row], descending=True)
            cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)
            drop = cumulative - torch.softmax(sorted_logits, -1) > p.top_p  # keep the token that crosses p
            out[row][order[drop]] = float("-inf")
    return out
