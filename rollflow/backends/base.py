"""What every training backend shares: the `TrainingBackend` protocol the workers program against,
`TrainerSettings` (the constructor fields every backend takes), and one implementation of the setup and
bookkeeping the backends would otherwise repeat.

* `build_model(settings)`: the causal LM or `ValueModel`, LoRA-wrapped or frozen as the settings say.
* `build_optimizer(model, settings)`: AdamW over what trains + the `lr_multiplier` schedule.
* `TrainingBackendBase`: the one base class of the backends (one level of inheritance). It holds the
  settings, model, optimizer, scheduler and tokenizer, and implements offload / onload with the resident
  guard, the forward passes, the micro-batch loop with token-weighted metric averaging, the optimizer step,
  and how a process's rows become micro-batches (`_micro_batches`: ordered by length, trimmed to their own
  columns). A backend supplies where the model lives (its constructor), which rows a process runs and how
  many passes (`_passes`), how its rows come back (`_join_rows`), `train_step`, weights export and
  checkpoints.

The config module imports this one (for `SETTINGS_FIELDS`), so at module level it imports only the standard
library and torch; the rest of rollflow, transformers and peft are imported inside the functions that use
them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from rollflow.algorithms import LossNormalizer
    from rollflow.data.sample import Batch

# `loss_fn(outputs, micro_batch, normalizer) -> (loss, metrics)`: outputs are [b, t, V] logits (a causal LM)
# or [b, t] values (a value model), over the micro-batch's own t <= T response columns (micro-batches are
# trimmed: `Batch.trimmed`); `loss` is the micro-batch's contribution to the loss of the whole batch (see
# `rollflow.algorithms.aggregation`), so the accumulated gradient does not depend on how it was split. The
# rows of a micro-batch are any of the batch's rows, in any order: a loss must be a sum over rows.
LossFn = Callable[[torch.Tensor, "Batch", "LossNormalizer"], tuple[torch.Tensor, dict[str, float]]]

LR_SCHEDULES = ("constant", "cosine")
ON_NONFINITE = ("stop", "skip_step")


@runtime_checkable
class TrainingBackend(Protocol):
    """What a worker may call on a training backend (`TorchBackend`, `FSDP2Backend`).

    Batches are full `Batch`es (B rows, T response columns); results come back on CPU. Under a data-parallel
    backend every call is a collective: all ranks make it, with the same full batch.

    Attributes:
        resident: False between `offload()` and `onload()`; forward and training calls raise then.
    """

    resident: bool

    def forward_logprobs(self, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        """Returns [B, T] logprobs of the response tokens (0 where padded)."""
        ...

    def forward_values(self, batch: Batch) -> torch.Tensor:
        """Returns [B, T] values of the response tokens (value head only; 0 where padded)."""
        ...

    def forward_reference_logprobs(self, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        """Returns [B, T] logprobs under the base model with the LoRA adapters off (LoRA only)."""
        ...

    def train_step(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on the whole batch. Returns metrics: the loss function's, `loss`,
        `grad_norm`, `lr`, `skipped_steps` (1 when a non-finite loss or gradient norm dropped the step).

        Raises NonFiniteError for a non-finite loss or gradient norm with `on_nonfinite="stop"`, and for
        weights a step made non-finite."""
        ...

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Full weights by HF parameter name, on CPU, for weight sync."""
        ...

    def offload(self) -> None: ...

    def onload(self) -> None: ...

    def save(self, path: str | Path) -> None: ...

    def load(self, path: str | Path) -> None: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    """The settings every training backend takes; backend-specific knobs are keyword arguments of the
    backend class (`backend_kwargs` in the config).

    Args:
        model_path: bundled name, local HF directory or hub id.
        dtype: parameter dtype ("float32" on CPU).
        lr, betas, weight_decay: AdamW settings.
        warmup_steps: linear LR warm-up over this many optimizer steps.
        max_grad_norm: gradient clipping (global norm).
        micro_batch_size: rows per forward/backward pass (per rank under a data-parallel backend).
        trainable: False for a frozen model (a reference): every weight frozen, no optimizer.
        lr_schedule: after warm-up, "constant" or "cosine" (to 0 at `total_steps`).
        total_steps: optimizer steps in the run (for the cosine schedule).
        trust_remote_code: passed to the HF loaders.
        value_head: hold a `ValueModel` (backbone + scalar head) instead of the causal LM, for a critic.
        max_response_length: the constant L of `seq_mean_token_sum_norm` (the generation limit); None uses
            each batch's padded response width.
        lora: `rollflow.config.LoraConfig` fields (rank, alpha, dropout, target_modules) to train LoRA
            adapters instead of all weights (validated when the model is built); None trains every weight.
        device: "cpu", "cuda", or None for CUDA when available. Inputs move to it per micro-batch.
        on_nonfinite: a non-finite loss or gradient norm: "stop" raises NonFiniteError, "skip_step" drops
            the step (gradient cleared, weights and LR schedule unchanged) and goes on.
    """

    model_path: str
    dtype: str = "float32"
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    micro_batch_size: int = 32
    trainable: bool = True
    lr_schedule: str = "constant"
    total_steps: int = 0
    trust_remote_code: bool = False
    value_head: bool = False
    max_response_length: int | None = None
    lora: dict[str, Any] | None = None
    device: str | None = None
    on_nonfinite: str = "stop"

    def __post_init__(self):
        if self.lora is not None and (self.value_head or not self.trainable):
            raise ValueError("lora needs a trainable causal LM (not value_head=True or trainable=False)")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"unknown lr_schedule {self.lr_schedule!r}; valid: {', '.join(LR_SCHEDULES)}")
        if self.on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"unknown on_nonfinite {self.on_nonfinite!r}; valid: {', '.join(ON_NONFINITE)}")


# The config rejects `backend_kwargs` that repeat one of these: they come from typed config keys.
SETTINGS_FIELDS = frozenset(field.name for field in dataclasses.fields(TrainerSettings))


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """LR factor at optimizer step `step` (0-based): linear warm-up, then constant or cosine to 0."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def micro_batch_rows(lengths: torch.Tensor, micro_batch_size: int, by_length: bool) -> list[torch.Tensor]:
    """Which rows each micro-batch holds.

    Ordering by length (longest first, ties in row order) puts long rows together, so the micro-batches of
    short rows stay narrow once trimmed; the longest pass comes first, so running out of memory shows at
    once. The number of micro-batches is `ceil(n / micro_batch_size)` either way.

    Args:
        lengths: [n] real tokens (prompt + response) of each row.
        micro_batch_size: rows per micro-batch.
        by_length: order the rows by length; False keeps them in order (contiguous micro-batches).

    Returns:
        [b] long row indices of each micro-batch, every row once; [] for n = 0.
    """
    order = (torch.argsort(lengths, descending=True, stable=True) if by_length
             else torch.arange(len(lengths)))  # [n]
    return [rows for rows in order.split(micro_batch_size) if len(rows)]


def unpack_top_k(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`TrainingBackendBase.forward_top_k`'s [B, T, 2k] as (ids [B, T, k] long, logprobs [B, T, k])."""
    k = packed.shape[-1] // 2
    return packed[..., k:].long(), packed[..., :k].contiguous()


def move_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                        device: torch.device | str) -> None:
    """Move a model's parameters and its optimizer's state tensors (Adam moments) to `device`."""
    model.to(device)  # an FSDP2 module re-registers its sharded parameters after the move
    for state in (optimizer.state.values() if optimizer is not None else []):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.to(device, non_blocking=True)


def build_model(settings: TrainerSettings) -> torch.nn.Module:
    """The model `settings` describe, on CPU, not yet placed (a backend moves or shards it).

    Returns:
        The causal LM, or a `ValueModel` with `value_head`; wrapped with PEFT LoRA adapters (base weights
        frozen) with `lora`; every weight frozen when not `trainable`.
    """
    from rollflow.backends.value_model import ValueModel
    from rollflow.models import load_causal_lm

    if settings.value_head:
        model = ValueModel.from_pretrained(settings.model_path, settings.dtype, settings.trust_remote_code)
    else:
        model = load_causal_lm(settings.model_path, settings.dtype, settings.trust_remote_code)
    if settings.lora is not None:
        from rollflow.backends.lora import wrap_with_lora

        model = wrap_with_lora(model, settings.lora)
    if not settings.trainable:
        model.requires_grad_(False)
    return model


def build_optimizer(model: torch.nn.Module, settings: TrainerSettings
                    ) -> tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None]:
    """AdamW over the parameters of `model` that train (all weights, or just the LoRA adapters) and its LR
    schedule (warm-up, then constant or cosine: `lr_multiplier`).

    Build it after the model is placed: the optimizer holds, and shapes its state like, those parameters
    (this rank's shards under FSDP2).

    Returns:
        (optimizer, scheduler), or (None, None) when not `settings.trainable`.
    """
    if not settings.trainable:
        return None, None
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=settings.lr, betas=settings.betas,
                                  weight_decay=settings.weight_decay, fused=_fusable(parameters) or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        lr_multiplier, warmup_steps=settings.warmup_steps, total_steps=settings.total_steps,
        schedule=settings.lr_schedule))
    return optimizer, scheduler


FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fusable(parameters: list[torch.Tensor]) -> bool:
    """Whether AdamW's fused kernel takes these parameters: plain tensors (not FSDP2's DTensor shards) of one
    float dtype on one CPU or CUDA device. It is one kernel per tensor list where the default CPU path loops
    in Python over every tensor: 1.4 ms instead of 6.9 ms per step for the bundled model's 50 tensors."""
    if not parameters:
        return False
    first = parameters[0]
    return all(type(p) in (torch.nn.Parameter, torch.Tensor) and p.dtype == first.dtype and p.device == first.device
               for p in parameters) and first.dtype in FUSED_DTYPES and first.device.type in ("cpu", "cuda")


def load_scheduler_state(scheduler: torch.optim.lr_scheduler.LambdaLR, state: dict[str, Any]) -> None:
    """Restore a saved LR schedule's position (its step count) and continue on `scheduler`'s own schedule.

    The saved state also holds the LR the saved run had reached, which a resumed run with another
    `total_steps` (`train.steps` raised) must not keep: the LR is recomputed at the restored step, so a
    cosine schedule is stretched to the new total and every step from here gets the LR a run configured
    with that total has at that step (with an unchanged total, the same LR as saved).
    """
    scheduler.load_state_dict(state)  # the step count; `lr_multiplier`'s settings are not in the state
    step = scheduler.last_epoch
    for group, base_lr, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * factor(step)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]  # what get_last_lr reads


def save_training_state(state: dict[str, Any], path: str | Path) -> None:
    """`torch.save(state, path)` through a Python file object, so a failed write keeps its errno.

    Given a path, torch's own C++ writer reports a full disk (or quota) only as `[enforce fail at
    inline_container.cc] unexpected pos ...`; through a Python file the write that failed raises `OSError`
    (ENOSPC, EDQUOT), which is what is raised here, and what the driver recognizes as a full disk
    (`rollflow.trackers.durable_files.disk_full_error`) across the Ray boundary.
    """
    try:
        with open(path, "wb") as out:
            torch.save(state, out)
    except RuntimeError as err:  # torch's writer, raised while handling the OSError of the write that failed
        if isinstance(err.__context__, OSError):
            raise err.__context__ from None
        raise


class TrainingBackendBase:
    """State and bookkeeping shared by the training backends; each backend extends this class once.

    A backend's constructor builds the model (`build_model`), places it (moves or shards it) and then calls
    `super().__init__`, which builds the optimizer over the placed parameters and loads the tokenizer.

    Args:
        settings: the shared settings.
        model: the placed model.
        device: where inputs go (the model's device).
        trim_micro_batches: order a process's rows by length before cutting micro-batches and drop the
            columns that are padding in every row of a micro-batch (`Batch.trimmed`); False: contiguous
            micro-batches at the batch's full width. Results are the same either way (up to float rounding).

    Attributes:
        settings, model, device, tokenizer, trim_micro_batches: as given / loaded.
        optimizer, scheduler: AdamW and its LambdaLR; None when frozen.
        forward: `(model, micro_batch) -> [b, t, V] logits`, or `[b, t] values` for a value model.
        resident: False between `offload()` and `onload()`.
    """

    def __init__(self, settings: TrainerSettings, model: torch.nn.Module, device: torch.device,
                 trim_micro_batches: bool = True):
        from rollflow.backends.logprobs import model_logits
        from rollflow.backends.value_model import response_values
        from rollflow.models import load_tokenizer, use_cpu_attention

        if device.type == "cpu":  # short rows (the bundled model's) train ~13% faster (`cpu_attention`)
            use_cpu_attention(model)
        self.settings = settings
        self.model = model
        self.device = device
        self.trim_micro_batches = trim_micro_batches
        self.forward = response_values if settings.value_head else model_logits
        self.optimizer, self.scheduler = build_optimizer(model, settings)
        self.tokenizer = load_tokenizer(settings.model_path, settings.trust_remote_code)
        self.resident = True

    # ---- what each backend supplies -------------------------------------------------------------------

    def _passes(self, batch: Batch) -> Iterator[tuple[Batch, torch.Tensor | None]]:
        """The forward/backward passes over `batch` as (micro_batch on the device, rows): `rows` [b] indexes
        the micro-batch's rows among this process's rows (`_micro_batches` of them), None for a placeholder
        pass, which is run (a data-parallel rank's collectives must line up) but contributes nothing."""
        raise NotImplementedError

    def _join_rows(self, local: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The [B, T] result on CPU from this process's [n, T] rows (in its own row order)."""
        raise NotImplementedError

    # ---- micro-batches --------------------------------------------------------------------------------

    def _micro_batches(self, rows: Batch) -> Iterator[tuple[Batch, torch.Tensor]]:
        """`rows` (one optimizer step's rows on this process) as `micro_batch_size`-row micro-batches on the
        device, each with the [b] indices of its rows in `rows`.

        With `trim_micro_batches`, the rows are ordered by length (`micro_batch_rows`) and each micro-batch
        is cut to its own columns (`Batch.trimmed`): on a long-tailed batch most passes are then a fraction
        of the batch's width. The number of micro-batches does not depend on it. Neither does the loss: it
        is a sum over rows divided by counts of the whole batch (`rollflow.algorithms.aggregation`).
        """
        lengths = rows.attention_mask.sum(dim=1)  # [n] prompt + response tokens
        for index in micro_batch_rows(lengths, self.settings.micro_batch_size, self.trim_micro_batches):
            micro = rows.select(index)
            yield (micro.trimmed() if self.trim_micro_batches else micro).to(self.device), index

    # ---- residency ------------------------------------------------------------------------------------

    def require_resident(self, operation: str) -> None:
        """Raise RuntimeError when offloaded (before any collective, so every rank raises alike)."""
        if not self.resident:
            raise RuntimeError(
                f"{type(self).__name__}.{operation} called while offloaded; call onload() first")

    def offload(self) -> None:
        """Move weights and optimizer state (this rank's shards under FSDP2) to host memory between phases;
        on CPU nothing moves. Until `onload()`, forward and training calls raise RuntimeError."""
        if self.device.type == "cuda":
            move_training_state(self.model, self.optimizer, "cpu")
            torch.cuda.empty_cache()
        self.resident = False

    def onload(self) -> None:
        """Bring weights and optimizer state back to the device."""
        if self.device.type == "cuda":
            move_training_state(self.model, self.optimizer, self.device)
        self.resident = True

    def close(self) -> None:
        """Release what the backend holds outside its own objects; nothing, unless a backend overrides it."""

    # ---- forward --------------------------------------------------------------------------------------

    @torch.no_grad()
    def _forward_response(self, batch: Batch, read: Callable[[Batch], torch.Tensor],
                          trailing: tuple[int, ...] = ()) -> torch.Tensor:
        """`read(micro) -> [b, t, *trailing]` on every pass. Returns the real passes' rows (0 on padding),
        padded back to the batch's width T, put back in row order and joined into [B, T, *trailing] on CPU."""
        self.model.eval()
        parts, part_rows = [], []
        for micro, rows in self._passes(batch):
            values = read(micro)  # [b, t, *trailing]; run on placeholder passes too, for the collectives
            if rows is not None:
                real = micro.attention_mask[:, micro.prompt_length:] > 0  # [b, t]
                values = values * real.view(*real.shape, *(1,) * len(trailing))  # 0 on padding
                widen = (0, 0) * len(trailing) + (0, batch.response_width - values.shape[1])
                parts.append(torch.nn.functional.pad(values, widen))
                part_rows.append(rows)
        if not parts:  # a data-parallel rank with no rows
            return self._join_rows(torch.zeros(0, batch.response_width, *trailing, device=self.device), batch)
        joined = torch.cat(parts)  # [n, T] in pass order
        local = torch.empty_like(joined)
        local[torch.cat(part_rows).to(joined.device)] = joined  # [n, T] in row order
        return self._join_rows(local, batch)

    def forward_logprobs(self, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        """Logprobs of the batch's response tokens. Returns [B, T] on CPU (0 where padded)."""
        from rollflow.backends.logprobs import response_logprobs

        self.require_resident("forward_logprobs")
        return self._forward_response(batch, lambda micro: response_logprobs(self.model, micro, temperature))

    def forward_top_k(self, batch: Batch, k: int, temperature: float = 1.0) -> torch.Tensor:
        """The k most likely next tokens at every response position (a distillation teacher's output).

        Returns:
            [B, T, 2k] on CPU, 0 where padded: the full-vocabulary log-softmax of logits / temperature at the
            k most likely ids (most likely first), then those ids as floats. One tensor, so it goes through
            the row joins (and a worker's reply) as any other forward does; `unpack_top_k` splits it.
        """
        from rollflow.backends.logprobs import model_logits

        self.require_resident("forward_top_k")

        def read(micro: Batch) -> torch.Tensor:
            logprobs = torch.log_softmax(model_logits(self.model, micro) / temperature, dim=-1)  # [b, t, V]
            if logprobs.shape[-1] >= 2**24:
                raise ValueError("token ids above 2**24 do not survive the float transfer of forward_top_k")
            values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)  # [b, t, k] each
            return torch.cat([values, ids.float()], dim=-1)  # [b, t, 2k]: one tensor through the row join

        width = min(k, self.model.config.vocab_size)
        return self._forward_response(batch, read, trailing=(2 * width,))  # [B, T, 2k]

    def forward_values(self, batch: Batch) -> torch.Tensor:
        """Values of the batch's response tokens (value head only). Returns [B, T] on CPU (0 where padded)."""
        from rollflow.backends.value_model import response_values

        assert self.settings.value_head, "forward_values needs value_head=True"
        self.require_resident("forward_values")
        return self._forward_response(batch, lambda micro: response_values(self.model, micro))

    def forward_reference_logprobs(self, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        """Logprobs under the reference policy: the base model with the LoRA adapters disabled (no second
        copy of the model). Returns [B, T] on CPU (0 where padded).
        """
        if self.settings.lora is None:
            raise RuntimeError("forward_reference_logprobs needs lora: without adapters the trained weights "
                               "are the policy, so the reference is a separate frozen model")
        with self.model.disable_adapter():
            return self.forward_logprobs(batch, temperature)

    # ---- training -------------------------------------------------------------------------------------

    def _accumulate_gradients(self, batch: Batch, passes: Iterator[tuple[Batch, torch.Tensor | None]],
                              loss_fn: LossFn) -> tuple[float, dict[str, float]]:
        """Forward and backward every pass, adding up the gradient of the loss of the whole `batch`.

        The loss normalizer (token / sequence counts, and the default L: the full batch's width T) and the
        metric weights come from the FULL batch, so passes over any part of it (a micro-batch, trimmed or
        not, a rank's shard) add up to the whole batch's numbers.

        Returns:
            (the sum of the real passes' losses, their metrics weighted by trained tokens / the batch's
            trained tokens); over all passes of all ranks these add up to the batch's loss and metrics.
        """
        from rollflow.algorithms import loss_normalizer

        assert self.optimizer is not None, "train_step on a frozen backend"
        self.model.train()
        normalizer = loss_normalizer(batch.response_mask, self.settings.max_response_length)
        total_tokens = max(float(batch.response_mask.sum()), 1.0)
        loss_sum, metric_sums = 0.0, {}
        for micro, rows in passes:
            real = rows is not None
            outputs = self.forward(self.model, micro)  # [b, t, V] logits, or [b, t] values
            loss, metrics = loss_fn(outputs, micro, normalizer)
            if not real:
                loss = loss * 0.0  # keeps the graph (and so a rank's collectives) but adds no gradient
            loss.backward()
            if not real:
                continue
            loss_sum += float(loss.detach())
            weight = float(micro.response_mask.sum()) / total_tokens  # token-weighted metric average
            for key, value in metrics.items():
                metric_sums[key] = metric_sums.get(key, 0.0) + float(value) * weight
        return loss_sum, metric_sums

    def _optimizer_step(self, loss: float) -> dict[str, float]:
        """Clip the accumulated gradient by its global norm, step AdamW and the LR schedule, clear it.

        A non-finite `loss` or gradient norm never reaches the weights: the gradient is cleared, then
        `on_nonfinite="stop"` raises NonFiniteError and "skip_step" returns without stepping (nor advancing
        the LR schedule). After a real step the stepped weights are checked (their float64 2-norm, one
        pass): non-finite ones raise NonFiniteError in both modes, so they are never synced or saved.

        Args:
            loss: the batch's loss, the same number on every rank (every rank must decide alike).

        Returns:
            {"grad_norm": the global norm before clipping, "lr": the LR of the next step, "skipped_steps":
            1.0 when the step was dropped, else 0.0}.

        Raises:
            NonFiniteError: as above; its message names the optimizer step (1-based, counted by the LR
            schedule, so it survives a resume).
        """
        from rollflow.errors import NonFiniteError

        # clip exactly what the optimizer steps (all weights, or just the LoRA adapters)
        parameters = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = _reduced(torch.nn.utils.clip_grad_norm_(parameters, self.settings.max_grad_norm))
        step = self.scheduler.last_epoch + 1  # this update's number: LambdaLR starts at 0, +1 per step
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            what, value = ("loss", loss) if not math.isfinite(loss) else ("grad norm", grad_norm)
            if self.settings.on_nonfinite == "stop":
                raise NonFiniteError(f"non-finite {what} ({value}) at optimizer step {step}; the weights were "
                                     "not updated", weights_updated=False)
            return {"grad_norm": grad_norm, "lr": self.scheduler.get_last_lr()[0], "skipped_steps": 1.0}
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if not math.isfinite(_weights_norm(parameters)):
            raise NonFiniteError(f"weights became non-finite after optimizer step {step}", weights_updated=True)
        return {"grad_norm": grad_norm, "lr": self.scheduler.get_last_lr()[0], "skipped_steps": 0.0}


@torch.no_grad()
def _weights_norm(parameters: list[torch.Tensor]) -> float:
    """The global 2-norm of `parameters`, accumulated in float64: finite for any finite float32 weights (in
    float32 the squares overflow past |w| ~ 1e19), NaN or inf as soon as one weight is. One foreach pass."""
    norms = torch._foreach_norm(parameters, 2.0, dtype=torch.float64)  # what clip_grad_norm_ runs on grads
    return _reduced(torch.linalg.vector_norm(torch.stack(norms)))


def _reduced(norm: torch.Tensor) -> float:
    """A norm over parameters as a float; under FSDP2 it is a DTensor, reduced over the ranks here."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
