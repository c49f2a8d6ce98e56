"""`fsdp2` training backend: data-parallel training with PyTorch FSDP2 (`fully_shard`) over torch.distributed.

One backend per rank; ranks form a process group from the torchrun-style environment (`RANK`, `WORLD_SIZE`,
`MASTER_ADDR`, `MASTER_PORT`, `LOCAL_RANK`), gloo on CPU and nccl on CUDA. Parameters, gradients and
optimizer state are sharded across ranks; each decoder layer is one FSDP unit (all-gathered just before its
forward / backward), the rest of the model (embeddings, tied LM head, final norm, value head) is the root.

Every rank receives the same full `Batch`; the backend takes its own contiguous shard of rows, so callers
never shard. A training step over the global batch gives the same gradient as the single-process
`TorchBackend` on that batch, whatever the world size and micro-batch size:

* the loss normalizer (token / sequence counts) is computed from the FULL batch, so each micro-batch's loss
  is its contribution to the global loss (see `rollflow.algorithms.aggregation`);
* micro-batch gradients accumulate as a sum, and FSDP's reduce-scatter SUMS across ranks (its default
  averages: we set the gradient divide factor to 1);
* FSDP2 forward / backward are collectives, so every rank runs the same number of passes: a rank with fewer
  (or no) rows runs zero-weight passes on a placeholder row instead of skipping, which would deadlock.

Within its shard a rank orders its rows by length before cutting micro-batches and trims each micro-batch
to its own columns (`TrainingBackendBase._micro_batches`); that changes neither the number of passes (it
depends only on the shard's row count) nor the result. Ranks may run passes of different widths: FSDP's
collectives move parameters and gradients, whose shapes do not depend on the inputs.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rollflow.backends.backend_base import TrainingBackendBase
from rollflow.backends.base import LossFn, TrainerSettings
from rollflow.backends.training_state import (
    build_model,
    load_scheduler_state,
    save_training_state,
    synced_weights,
)
from rollflow.backends.value_model import WEIGHTS_FILE
from rollflow.data.sample import Batch
from rollflow.models import DTYPES, load_causal_lm

OPTIMIZER_DIR = "optimizer"  # sharded optimizer state (torch.distributed.checkpoint), under a checkpoint
MIXED_PRECISION_KEYS = ("param_dtype", "reduce_dtype", "output_dtype")


def shard_rows(batch_size: int, world_size: int, rank: int) -> slice:
    """The contiguous rows of a `batch_size`-row batch that `rank` trains on.

    Rows are split as evenly as possible, the first `batch_size % world_size` ranks taking one extra (the
    `torch.tensor_split` rule); a rank past the end gets an empty slice.

    Returns:
        slice(start, stop) into the batch's rows.
    """
    base, extra = divmod(batch_size, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def passes_per_rank(batch_size: int, world_size: int, micro_batch_size: int) -> int:
    """Forward (and backward) passes every rank runs for one batch: the largest shard's micro-batch count.

    At least 1, so a batch smaller than the world size still runs the collectives on every rank.
    """
    largest_shard = math.ceil(batch_size / world_size)
    return max(1, math.ceil(largest_shard / micro_batch_size))


def mixed_precision_policy(spec: dict[str, str] | None):
    """FSDP2 `MixedPrecisionPolicy` from dtype names, e.g. {"param_dtype": "bfloat16", "reduce_dtype":
    "float32"}; None (or {}) keeps full precision. Unknown keys or dtype names raise ValueError."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    spec = dict(spec or {})
    unknown = sorted(set(spec) - set(MIXED_PRECISION_KEYS))
    if unknown:
        raise ValueError(f"unknown mixed_precision keys {unknown}; valid keys: {list(MIXED_PRECISION_KEYS)}")
    bad = {key: name for key, name in spec.items() if name not in DTYPES}
    if bad:
        raise ValueError(f"unknown dtype names {bad} in mixed_precision; valid: {sorted(DTYPES)}")
    return MixedPrecisionPolicy(**{key: DTYPES[name] for key, name in spec.items()})


def join_process_group(device: torch.device) -> bool:
    """Join the process group described by the torchrun-style environment, unless one exists.

    Returns:
        True when this call created the group (its owner destroys it).
    """
    if dist.is_initialized():
        return False
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise RuntimeError(f"the fsdp2 backend needs the environment variables {missing} (torchrun style) set "
                           "before it is constructed")
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", device_id=(
        device if device.type == "cuda" else None))
    return True


def shard_model(model: torch.nn.Module, mesh, mixed_precision: dict[str, str] | None,
                reshard_after_forward: bool) -> None:
    """Apply FSDP2 in place: one unit per transformer block (the classes HF lists in `_no_split_modules`),
    then the root; set every unit to SUM gradients across ranks."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    policy = mixed_precision_policy(mixed_precision)
    block_names: set[str] = set()
    for module in model.modules():
        block_names.update(getattr(module, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in block_names:
            fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # root: FSDP keeps it unsharded for backward
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Each rank's loss is already its share of the GLOBAL loss (global normalizer), so the global
            # gradient is the SUM over ranks; FSDP's default divides by the world size. Dividing by 1 with
            # plain SUM collectives (no AVG / PREMUL_SUM, which gloo lacks) gives the sum on every backend.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


class FSDP2Backend(TrainingBackendBase):
    """One data-parallel rank's sharded model, optimizer and LR schedule.

    Same settings and methods as `TorchBackend`; every method is a collective (all ranks call it, with the
    same full batch). The process group must be described by the environment before construction. A value
    model (`value_head`, a critic) and a frozen model (`trainable=False`, a reference) shard the same way.

    Args:
        settings: the shared `TrainerSettings`; `micro_batch_size` is rows per rank per pass; `device` is
            "cpu", "cuda" (device LOCAL_RANK) or None for CUDA when available. `lora` is not supported by
            this backend yet (raises NotImplementedError).
        mixed_precision: FSDP2 `MixedPrecisionPolicy` as dtype names, e.g. {"param_dtype": "bfloat16",
            "reduce_dtype": "float32"}; None computes in the parameters' dtype.
        reshard_after_forward: free each block's gathered parameters after its forward (less memory, one more
            all-gather in backward).
        trim_micro_batches: cut micro-batches from the shard's rows ordered by length, each only as wide as
            its own rows (the default); False: contiguous micro-batches at the batch's full width.

    Attributes:
        rank, world_size: this process's place in the process group.
        resident: False between `offload()` and `onload()`.
    """

    def __init__(self, settings: TrainerSettings, *, mixed_precision: dict[str, str] | None = None,
                 reshard_after_forward: bool = True, trim_micro_batches: bool = True):
        from torch.distributed.device_mesh import init_device_mesh

        if settings.lora is not None:
            raise NotImplementedError("lora is not supported by the fsdp2 backend yet; use backend: torch")
        mixed_precision_policy(mixed_precision)  # fail on a bad spec before joining the group
        if settings.device == "cuda" or settings.device is None and torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        self.owns_process_group = join_process_group(device)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh(device.type, (self.world_size,))
        model = build_model(settings)
        shard_model(model, mesh, mixed_precision, reshard_after_forward)  # moves shards to the device
        super().__init__(settings, model, device, trim_micro_batches)  # the optimizer holds this rank's shards

    # ---- batches --------------------------------------------------------------------------------------

    def _passes(self, batch: Batch) -> Iterator[tuple[Batch, torch.Tensor | None]]:
        """This rank's micro-batches as (micro_batch, rows in the shard); the same count on every rank.

        Past the end of its shard's micro-batches a rank gets `(placeholder, None)`: the batch's first row
        with an all-zero response mask, run (with zero weight in training) only so that FSDP's collectives
        line up across ranks.
        """
        shard = batch.select(shard_rows(batch.size, self.world_size, self.rank))
        micro_batches = self._micro_batches(shard)  # ceil(shard rows / micro_batch_size) of them
        placeholder = None
        for _ in range(passes_per_rank(batch.size, self.world_size, self.settings.micro_batch_size)):
            micro = next(micro_batches, None)
            if micro is not None:
                yield micro
                continue
            if placeholder is None:
                placeholder, _ = next(self._micro_batches(batch.select(slice(0, 1))))
                placeholder.response_mask = torch.zeros_like(placeholder.response_mask)
            yield placeholder, None
        assert next(micro_batches, None) is None, "a shard has more micro-batches than passes_per_rank"

    def _join_rows(self, local: torch.Tensor, batch: Batch) -> torch.Tensor:
        """All-gather each rank's [n_r, T] rows into the full [B, T] tensor (rank order), on CPU, on every
        rank."""
        if self.world_size == 1:
            return local.cpu()
        largest = math.ceil(batch.size / self.world_size)
        padded = local.new_zeros((largest, *local.shape[1:]))  # equal shapes for the collective
        padded[: local.shape[0]] = local
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded)
        rows = [shard_rows(batch.size, self.world_size, rank) for rank in range(self.world_size)]
        return torch.cat([part[: row.stop - row.start] for part, row in zip(gathered, rows, strict=True)]).cpu()

    # ---- training -------------------------------------------------------------------------------------

    def train_step(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on the whole (global) batch; collective.

        Each rank backpropagates its shard's share of the GLOBAL loss (normalizer from the full batch);
        FSDP's reduce-scatter sums the gradients over ranks.

        Returns:
            Global metrics, identical on every rank: `loss` (the global loss, summed over ranks and
            micro-batches), the loss function's metrics averaged over the global batch weighted by trained
            tokens, `grad_norm` (global, before clipping), `lr` and `skipped_steps` (see `_optimizer_step`).
        """
        self.require_resident("train_step")
        local_loss, local_sums = self._accumulate_gradients(batch, self._passes(batch), loss_fn)
        loss, metric_sums = self._sum_over_ranks(local_loss, local_sums)
        step = self._optimizer_step(loss)  # clips by the global norm; decides alike on every rank
        return {**metric_sums, "loss": loss, **step}

    def _sum_over_ranks(self, loss: float, sums: dict[str, float]) -> tuple[float, dict[str, float]]:
        """Sum the per-rank loss and metric sums (a key a rank lacks counts 0), in rank order so every rank
        gets bit-identical numbers."""
        if self.world_size == 1:
            return loss, sums
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (loss, sums))
        totals: dict[str, float] = {}
        for _, rank_sums in gathered:
            for key, value in rank_sums.items():
                totals[key] = totals.get(key, 0.0) + value
        return sum(rank_loss for rank_loss, _ in gathered), totals

    # ---- weights and checkpoints ----------------------------------------------------------------------

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state dict (collective): CPU tensors on rank 0, {} elsewhere."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Full parameters by HF name (tied weights once), on CPU, on rank 0; {} on other ranks. Collective."""
        state = self._full_state_dict()
        if self.rank != 0:
            return {}
        # named_parameters lists a tied parameter once, under the same name TorchBackend reports
        return synced_weights({name: state[name].contiguous() for name, _ in self.model.named_parameters()},
                              self.settings)

    def save(self, path: str | Path) -> None:
        """Collective checkpoint under `path`: rank 0 writes the model + tokenizer in HF format (a value model:
        `value_model.safetensors`); every rank writes its optimizer shard (torch.distributed.checkpoint, in
        `path/optimizer/`) and its scheduler + RNG state (`trainer_state_rank{r}.pt`)."""
        import torch.distributed.checkpoint as dcp
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = self._full_state_dict()
        if self.rank == 0:
            if self.settings.value_head:
                save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(path / WEIGHTS_FILE))
            else:
                # The gathered tensors share no storage, so HF cannot see that the output embedding is the
                # input one: keep the names the model's parameters have (a tied weight once), as TorchBackend
                # writes. HF strips FSDP's class-name prefix from `architectures`.
                parameters = {name for name, _ in self.model.named_parameters()}
                buffers = {name for name, _ in self.model.named_buffers()}
                state = {name: tensor for name, tensor in state.items() if name in parameters | buffers}
                self.model.save_pretrained(path, state_dict=state, safe_serialization=True)
            self.save_processing(path)
        if self.optimizer is not None:
            dcp.save({"optimizer": get_optimizer_state_dict(self.model, self.optimizer)},
                     checkpoint_id=str(path / OPTIMIZER_DIR))
        trainer_state = {
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state() if self.device.type == "cuda" else None,
            "python_rng": random.getstate(),
        }
        save_training_state(trainer_state, path / f"trainer_state_rank{self.rank}.pt")
        dist.barrier()  # the marker below means every rank finished writing
        if self.rank == 0:
            (path / "rollflow_checkpoint.json").write_text(json.dumps(
                {"format": 1, "backend": "fsdp2", "world_size": self.world_size}))

    def load(self, path: str | Path) -> None:
        """Restore what `save` wrote (collective): weights (read on rank 0, broadcast), the sharded optimizer
        state (resharded if the world size changed), scheduler and RNG."""
        import torch.distributed.checkpoint as dcp
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(path)
        state: dict[str, torch.Tensor] = {}
        if self.rank == 0:
            if self.settings.value_head:
                state = load_file(str(path / WEIGHTS_FILE))
            else:
                state = load_causal_lm(str(path), dtype=self.settings.dtype).state_dict()
        set_model_state_dict(self.model, state, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
        if self.optimizer is not None:
            # a fresh optimizer has no state to load into: get_optimizer_state_dict creates it (a zero-lr step)
            optimizer_state = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
            dcp.load(optimizer_state, checkpoint_id=str(path / OPTIMIZER_DIR))
            set_optimizer_state_dict(self.model, self.optimizer, optimizer_state["optimizer"])
        rank_file = path / f"trainer_state_rank{self.rank}.pt"
        if not rank_file.is_file():  # saved with fewer ranks: the schedule is the same on every rank
            rank_file = path / "trainer_state_rank0.pt"
        trainer_state = torch.load(rank_file, weights_only=False)
        if self.scheduler and trainer_state["scheduler"]:
            load_scheduler_state(self.scheduler, trainer_state["scheduler"])  # stretched to a raised train.steps
        torch.set_rng_state(trainer_state["torch_rng"])
        if self.device.type == "cuda" and trainer_state["cuda_rng"] is not None:
            torch.cuda.set_rng_state(trainer_state["cuda_rng"])
        random.setstate(trainer_state["python_rng"])

    # ---- lifetime -------------------------------------------------------------------------------------

    def close(self) -> None:
        """Destroy the process group if this backend created it."""
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_process_group = False
