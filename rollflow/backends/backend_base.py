"""`TrainingBackendBase`: the one base class of the training backends (one level of inheritance), the setup
and bookkeeping they would otherwise repeat.

It holds the settings, model, optimizer, scheduler and tokenizer, and implements offload / onload with the
resident guard, the forward passes, the micro-batch loop with token-weighted metric averaging, the optimizer
step, and how a process's rows become micro-batches (`_micro_batches`: ordered by length, trimmed to their own
columns). A backend supplies where the model lives (its constructor: `training_state.build_model`, then its
placement), which rows a process runs and how many passes (`_passes`), how its rows come back (`_join_rows`),
`train_step`, weights export and checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from rollflow.backends.base import LossFn, TrainerSettings, micro_batch_rows
from rollflow.backends.training_state import build_optimizer, move_training_state

if TYPE_CHECKING:
    from pathlib import Path

    from rollflow.data.sample import Batch


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
        self.image_processor = _image_processor(settings, model)
        self.resident = True

    def save_processing(self, path: Path) -> None:
        """The tokenizer, and a vision-language model's image processor, into the model directory `path`, so
        that a checkpoint loads as the model it trains (a VLM's `preprocessor_config.json` with it)."""
        self.tokenizer.save_pretrained(path)
        if self.image_processor is not None:
            self.image_processor.save_pretrained(path)

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



def _image_processor(settings: TrainerSettings, model: torch.nn.Module):
    """The image processor of a vision-language model (None for a text model), for its checkpoints."""
    from rollflow.models import is_vision_language, resolve_model_path

    config = getattr(model, "config", None)
    if config is None or not is_vision_language(config):
        return None
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(resolve_model_path(settings.model_path),
                                              trust_remote_code=settings.trust_remote_code)
