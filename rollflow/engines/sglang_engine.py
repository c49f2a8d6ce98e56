"""`sglang` engine: the engine protocol over SGLang's offline engine (`sglang.Engine`), on GPUs.

Written against SGLang's documented Python API as of SGLang 0.5 (docs.sglang.io, `python/sglang/srt/
entrypoints/engine.py`, `docs/basic_usage/sampling_params.md`):

- `sglang.Engine(model_path=..., skip_tokenizer_init=True, enable_memory_saver=True, ...)` (any
  `ServerArgs` field as a keyword);
- `await Engine.async_generate(input_ids=[[...], ...], sampling_params=[{...}, ...], return_logprob=True,
  rid=[...])` returning one dict per sequence: `meta_info["output_token_logprobs"]` is a list of
  `(logprob, token_id, text)` for every generated token and `meta_info["finish_reason"]` is
  `{"type": "stop" | "length" | "abort", ...}`;
- sampling params `max_new_tokens, min_new_tokens, temperature, top_p, top_k (-1: off), min_p,
  stop_token_ids, *_penalty, sampling_seed`; the docs advise sending a prompt n times rather than
  `n > 1`, which is what this does;
- `Engine.tokenizer_manager.abort_request(rid=...)` (SGLang's own abort path; the scheduler then finishes
  the request with `finish_reason.type == "abort"` and the tokens generated so far);
- `Engine.update_weights_from_tensor(named_tensors, flush_cache=True)`,
  `Engine.release_memory_occupation(tags)` / `resume_memory_occupation(tags)` (needs
  `enable_memory_saver=True`; tags "weights", "kv_cache").

Logprobs. SGLang's sampler reports log(softmax(logits / temperature)) of the sampled token, before
top-k / top-p / min-p filtering (log-softmax of the logits when greedy) — rollflow's quantity. The
environment variable `SGLANG_RETURN_ORIGINAL_LOGPROB=1` switches it to the logits before temperature,
so the engine refuses to start with it set (unless every request runs at temperature 0 or 1, which it
cannot know up front). `min_new_tokens` is SGLang's min-new-tokens penalizer, which masks EOS / stop
ids in the logits before the sampler takes logprobs: tokens sampled before `min_new_tokens` report
logprobs renormalized without the stop ids, not rollflow's quantity (read from SGLang's sampler, not
checked on a GPU here); requests without it are unaffected.

Threading. `sglang.Engine`'s synchronous methods run `self.loop.run_until_complete(...)` on the event loop
it was created with, and its async methods must run on that same loop. The engine is therefore created
by a `LoopThread` (`loop_thread.py`) in a private thread that drives that loop: it serves
`async_generate` calls until a synchronous call arrives, then makes that call (whose `run_until_complete`
keeps in-flight generations running).

Policy versions: SGLang's weight update takes its model-update writer lock, which waits for running
requests and holds new ones back, so a request never spans an update; its tokens carry the version
current when it completes (set on the loop's thread together with the load).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from rollflow.engines import ENGINE_PACKAGES
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
from rollflow.engines.loop_thread import LoopThread
from rollflow.models import resolve_model_path

FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"


# ---- pure conversions (unit-tested without SGLang) --------------------------------------------------------
def sglang_sampling_params(params: SamplingParams) -> list[dict[str, Any]]:
    """One SGLang sampling-params dict per sample of `params.n` (each sample is its own request).

    Every knob is given explicitly because SGLang otherwise takes defaults from the model's
    generation_config.json. A seeded request gives sample `slot` the seed `sample_seed(seed, slot)`, as
    the hf engine does (SGLang honours `sampling_seed` with `enable_deterministic_inference=True`).
    """
    base = {
        "max_new_tokens": params.max_new_tokens,
        "min_new_tokens": params.min_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,  # -1: off
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "stop_token_ids": list(params.stop_token_ids),
    }
    if params.seed is None:
        return [dict(base) for _ in range(params.n)]
    return [{**base, "sampling_seed": sample_seed(params.seed, slot)} for slot in range(params.n)]


def original_logprob_enabled(environ: dict[str, str]) -> bool:
    """Whether SGLang would report logprobs before temperature (its `SGLANG_RETURN_ORIGINAL_LOGPROB`)."""
    return environ.get(ORIGINAL_LOGPROB_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def finish_reason_from_sglang(reason: dict | str | None) -> FinishReason:
    """SGLang's `meta_info["finish_reason"]` (a dict with a `type`, or None if it never finished)."""
    if reason is None:
        return "abort"
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind not in FINISH_REASONS:
        raise RuntimeError(f"SGLang finished a sequence with {reason!r}")
    return FINISH_REASONS[kind]


def completion_output_from_sglang(result: dict, version: int) -> CompletionOutput:
    """rollflow's `CompletionOutput` from one `async_generate` result dict.

    Token ids come from `output_token_logprobs` — `(logprob, token_id, text)` per generated token, stop
    token included — so every token is paired with the logprob of exactly that token.
    """
    meta = result["meta_info"]
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        raise RuntimeError("SGLang returned no output_token_logprobs; the request needs return_logprob=True")
    return CompletionOutput(
        token_ids=[int(entry[1]) for entry in pairs],
        logprobs=[float(entry[0]) for entry in pairs],
        policy_versions=[version] * len(pairs),
        finish_reason=finish_reason_from_sglang(meta.get("finish_reason")),
    )


# ---- the engine -------------------------------------------------------------------------------------------
class SGLangEngine:
    """Inference engine over `sglang.Engine` (GPU).

    Args:
        model_path: bundled name, local HF directory or hub id.
        dtype: "bfloat16" | "float16" | "float32".
        max_batch_size: SGLang's `max_running_requests`.
        seed: SGLang's `random_seed`.
        trust_remote_code: passed to SGLang.
        **engine_kwargs: any other `sglang` `ServerArgs` field (`mem_fraction_static`, `tp_size`, ...).
    """

    def __init__(self, model_path: str, dtype: str = "bfloat16", max_batch_size: int = 256, seed: int = 0,
                 trust_remote_code: bool = False, **engine_kwargs: Any):
        try:
            import sglang
        except ImportError as err:
            raise ImportError(f"the sglang engine needs SGLang: {ENGINE_PACKAGES['sglang'][1]}") from err
        if original_logprob_enabled(dict(os.environ)):
            raise ValueError(f"unset {ORIGINAL_LOGPROB_ENV}: it makes SGLang report logprobs before "
                             "temperature, not the ones the trainer recomputes")
        settings = {"skip_tokenizer_init": True, "enable_memory_saver": True, **engine_kwargs}
        # With no running loop on the new thread, sglang.Engine makes one and exposes it as `.loop`.
        self._loop_thread = LoopThread(lambda: sglang.Engine(
            model_path=resolve_model_path(model_path), dtype=dtype, max_running_requests=max_batch_size,
            random_seed=seed, trust_remote_code=trust_remote_code, **settings), name="rollflow-sglang")
        self.engine = self._loop_thread.instance
        self._lifecycle = EngineLifecycle()
        self._rids: dict[str, list[str]] = {}  # running request -> its SGLang request ids (loop thread only)
        self._aborted_early: set[str] = set()
        self._submitted: set[str] = set()

    @property
    def version(self) -> int:
        return self._lifecycle.version

    async def generate(self, request: GenerationRequest) -> Completion:
        """Sample `request.params.n` completions of one prompt; RuntimeError while asleep or closed,
        EngineError when SGLang or its loop thread fails."""
        self._lifecycle.check_can_generate()
        self._submitted.add(request.request_id)
        try:
            return await self._loop_thread.run_async(self._generate(request))
        except Exception as err:  # SGLang's own error, a dead loop thread, ...
            self._submitted.discard(request.request_id)
            raise decoding_failed("sglang", err) from err

    async def _generate(self, request: GenerationRequest) -> Completion:
        started, n = time.perf_counter(), request.params.n
        self._submitted.discard(request.request_id)
        if request.request_id in self._aborted_early:
            self._aborted_early.discard(request.request_id)
            outputs = [CompletionOutput(finish_reason="abort") for _ in range(n)]
            return Completion(request.request_id, outputs, {"seconds": 0.0, "version": self.version})
        rids = [f"{request.request_id}#{slot}" for slot in range(n)]
        self._rids[request.request_id] = rids
        try:
            results = await self.engine.async_generate(
                input_ids=[list(request.prompt_ids)] * n, rid=rids, return_logprob=True,
                sampling_params=sglang_sampling_params(request.params), **sglang_image_data(request))
        finally:
            self._rids.pop(request.request_id, None)
        # The version now is the one that sampled every token: an update waits for running requests,
        # and a request that waited for an update ran after `_load` set its version.
        version = self.version
        outputs = [completion_output_from_sglang(result, version) for result in results]
        return Completion(request.request_id, outputs, {"seconds": time.perf_counter() - started,
                                                        "version": version})

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests; they resolve with what was generated so far (`abort`)."""
        if self._lifecycle.closed:  # close() already resolved every request
            return
        self._loop_thread.call_soon(self._abort, list(request_ids))

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if request_id in self._rids:
                for rid in self._rids[request_id]:
                    self.engine.tokenizer_manager.abort_request(rid=rid)
            elif request_id in self._submitted:
                self._aborted_early.add(request_id)

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Load trainer weights into SGLang; asleep, only the weights are brought back first."""
        self._lifecycle.check_open()
        self._loop_thread.call(lambda: self._load(list(named_tensors.items()), version))

    def _load(self, weights: list[tuple[str, torch.Tensor]], version: int) -> None:
        """On the loop's thread, between runs of the loop (no request completes in between)."""
        lifecycle = self._lifecycle
        if not lifecycle.weights_resident:  # asleep: bring the weights back (not the KV cache) to load into
            self.engine.resume_memory_occupation(tags=["weights"])
            lifecycle.weights_resident = True
        result = self.engine.update_weights_from_tensor(weights, flush_cache=not lifecycle.asleep)
        if isinstance(result, tuple) and result and not result[0]:
            raise RuntimeError(f"SGLang could not load the weights: {result[1:]}")
        lifecycle.version = version

    def sleep(self) -> None:
        """Release GPU memory (weights and KV cache) between rollout phases."""
        self._lifecycle.sleep(lambda: self._loop_thread.call(self.engine.release_memory_occupation),
                              weights_released=True)

    def wake(self) -> None:
        """Undo `sleep()`: the KV cache, and the weights unless a weight load already brought them back."""
        tags = self._lifecycle.tags_to_resume()
        self._lifecycle.wake(lambda: self._loop_thread.call(
            lambda: self.engine.resume_memory_occupation(tags=tags)))

    def close(self) -> None:
        """Shut SGLang down and stop its loop thread (idempotent); requests still running are cancelled."""
        if not self._lifecycle.close():
            return
        try:
            self._loop_thread.call(self.engine.shutdown)
        finally:
            self._loop_thread.close()


def sglang_image_data(request: GenerationRequest) -> dict:
    """`async_generate`'s images for a vision-language request, one list per sample of its `n` (each sample is a
    request of its own there); {} for a text request. The ids hold the images' placeholders already expanded,
    as the trainer scores them."""
    if request.vision is None or not request.vision.num_images:
        return {}
    return {"image_data": [list(request.vision.images)] * request.params.n}
