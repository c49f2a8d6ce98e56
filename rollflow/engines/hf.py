"""`hf` engine: batched KV-cache decoding with plain transformers models, on CPU or GPU.

Requests queue up; a runner coroutine takes every pending sequence (up to `max_batch_size`) into one
"wave": a left-padded prefill, then a token-by-token decode loop that yields to the event loop between
tokens, so `abort` and new `generate` calls are served while a wave runs. A request's future resolves as
soon as all of its sequences finish, while the rest of the wave keeps decoding, so its rewards can be
computed early. Requests that arrive during a wave join the next one.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from rollflow.cluster.weight_sync import verify_weights
from rollflow.engines.base import Completion, CompletionOutput, GenerationRequest, SamplingParams
from rollflow.models import eos_token_ids, load_causal_lm, load_tokenizer


@dataclass
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
        tokenizer = load_tokenizer(model_path, trust_remote_code)
        self.eos_ids = eos_token_ids(self.model, tokenizer)
        self.pad_id = tokenizer.pad_token_id
        self.max_batch_size = max_batch_size
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._version = 0
        self._queue: deque[_Pending] = deque()
        self._aborted: set[str] = set()
        self._runner: asyncio.Task | None = None
        self._asleep = False
        self.stats = {"tokens": 0, "waves": 0, "decode_seconds": 0.0}

    @property
    def version(self) -> int:
        return self._version

    # ---- protocol ------------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> Completion:
        """Sample `request.params.n` completions of one prompt."""
        if self._asleep:
            raise RuntimeError("engine is asleep; call wake() before generate()")
        pending = _Pending(request, asyncio.get_running_loop().create_future())
        self._queue.append(pending)
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

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int, checksum: str) -> None:
        """Load trainer weights in place after verifying their checksum; raises `WeightSyncError`."""
        verify_weights(named_tensors, checksum)
        params = dict(self.model.named_parameters())
        unknown = sorted(set(named_tensors) - set(params))
        if unknown:
            raise KeyError(f"weights for unknown parameters: {unknown[:5]}")
        with torch.no_grad():
            for name, tensor in named_tensors.items():
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))
        self._version = version

    def sleep(self) -> None:
        """Release memory between rollout phases (moves weights to CPU on an accelerator)."""
        self._asleep = True
        if self.device.type != "cpu":
            self.model.to("cpu")

    def wake(self) -> None:
        if self.device.type != "cpu":
            self.model.to(self.device)
        self._asleep = False

    # ---- decoding ------------------------------------------------------------------------------------
    async def _run(self) -> None:
        while self._queue:
            await self._gather_arrivals()
            wave: list[_Pending] = []
            sequences = 0
            while self._queue and (not wave or sequences + self._queue[0].request.params.n <= self.max_batch_size):
                pending = self._queue.popleft()
                wave.append(pending)
                sequences += pending.request.params.n
            await self._decode_wave(wave)

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
        if not pending.future.done():
            metadata = {"seconds": time.perf_counter() - pending.submitted, "version": self._version}
            pending.future.set_result(Completion(pending.request.request_id, outputs, metadata))

    async def _decode_wave(self, wave: list[_Pending]) -> None:
        started = time.perf_counter()
        rows: list[tuple[_Pending, SamplingParams]] = []
        prompts: list[list[int]] = []
        for pending in wave:
            params = pending.request.params
            pending.outputs = [CompletionOutput() for _ in range(params.n)]
            pending.unfinished = params.n
            for _ in range(params.n):
                rows.append((pending, params))
                prompts.append(pending.request.prompt_ids)
        count = len(rows)
        width = max(len(p) for p in prompts)
        input_ids = torch.full((count, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((count, width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            input_ids[i, width - len(prompt):] = torch.tensor(prompt)
            attention[i, width - len(prompt):] = 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        positions = (attention.cumsum(1) - 1).clamp(min=0)  # [N, P]
        temperatures = torch.tensor([p.temperature for _, p in rows], device=self.device)  # [N]
        greedy = temperatures == 0
        limits = torch.tensor([p.max_new_tokens for _, p in rows], device=self.device)  # [N]
        stop_sets = [set(self.eos_ids) | set(p.stop_token_ids) for _, p in rows]
        output_index = _output_slots(rows)
        active = torch.ones(count, dtype=torch.bool, device=self.device)
        generators = [self._row_generator(p, slot) for (_, p), slot in zip(rows, output_index)]

        logits, cache = self._forward(input_ids, attention, positions, cache=None)
        step = 0
        while True:
            self._drop_aborted(rows, output_index, active)
            if not active.any():
                break
            tokens, logprobs = self._sample(logits, temperatures, greedy, rows, generators)  # [N], [N]
            version = self._version
            step += 1
            for i in torch.nonzero(active).flatten().tolist():
                pending, _ = rows[i]
                out = pending.outputs[output_index[i]]
                token = int(tokens[i])
                out.token_ids.append(token)
                out.logprobs.append(float(logprobs[i]))
                out.policy_versions.append(version)
                finished = token in stop_sets[i] or step >= int(limits[i])
                if finished:
                    out.finish_reason = "stop" if token in stop_sets[i] else "length"
                    active[i] = False
                    pending.unfinished -= 1
                    if pending.unfinished == 0:
                        self._resolve(pending, pending.outputs)
            self.stats["tokens"] += int(count)
            if not active.any():
                break
            attention = torch.cat([attention, active.long().unsqueeze(1)], dim=1)  # [N, P + step]
            positions = positions[:, -1:] + 1  # [N, 1]
            logits, cache = self._forward(tokens.unsqueeze(1), attention, positions, cache)
            await asyncio.sleep(0)  # let abort / generate calls in between tokens
        for pending in wave:  # aborted rows left unresolved above
            if not pending.future.done():
                self._resolve(pending, pending.outputs)
        self.stats["waves"] += 1
        self.stats["decode_seconds"] += time.perf_counter() - started

    @torch.no_grad()
    def _forward(self, input_ids, attention, positions, cache):
        kwargs = {"cache": cache} if cache is not None else {}
        output = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                            use_cache=True, logits_to_keep=1, **kwargs)
        next_cache = getattr(output, "cache", None)
        if next_cache is None:
            next_cache = output.past_key_values
        return output.logits[:, -1].float(), next_cache  # [N, V]

    def _row_generator(self, params: SamplingParams, slot: int) -> torch.Generator | None:
        if params.seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(params.seed * 1_000_003 + slot)

    @torch.no_grad()
    def _sample(self, logits, temperatures, greedy, rows, generators):
        """Sample one token per row. Returns ([N] tokens, [N] logprobs of those tokens)."""
        safe_t = torch.where(greedy, torch.ones_like(temperatures), temperatures)  # [N]
        scaled = logits / safe_t.unsqueeze(1)  # [N, V]
        log_probs = torch.log_softmax(scaled, dim=-1)  # [N, V]
        tokens = log_probs.argmax(-1)  # [N] greedy choice
        sampled_rows = torch.nonzero(~greedy).flatten().tolist()
        if sampled_rows:
            filtered = _filter_top_k_top_p(scaled[sampled_rows], [rows[i][1] for i in sampled_rows])
            probs = torch.softmax(filtered, dim=-1)  # [S, V]
            if all(generators[i] is None for i in sampled_rows):
                draws = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
            else:
                draws = torch.stack([
                    torch.multinomial(probs[j], 1, generator=generators[i] or self.generator).squeeze(0)
                    for j, i in enumerate(sampled_rows)
                ])
            tokens[sampled_rows] = draws
        return tokens, log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1)

    def _drop_aborted(self, rows, output_index, active) -> None:
        if not self._aborted:
            return
        for i in torch.nonzero(active).flatten().tolist():
            pending, _ = rows[i]
            if pending.request.request_id in self._aborted:
                active[i] = False
                pending.outputs[output_index[i]].finish_reason = "abort"
                pending.unfinished -= 1
                if pending.unfinished == 0:
                    self._resolve(pending, pending.outputs)


def _output_slots(rows: list[tuple[_Pending, SamplingParams]]) -> list[int]:
    """Which of its request's n outputs each row fills."""
    seen: dict[int, int] = {}
    slots = []
    for pending, _ in rows:
        slots.append(seen.get(id(pending), 0))
        seen[id(pending)] = slots[-1] + 1
    return slots


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
