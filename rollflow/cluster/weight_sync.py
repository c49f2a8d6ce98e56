"""Versioned, checksummed weight transfer from the trainer to inference engines.

Two transports carry the same buckets (tensors grouped in name order, about `bucket_bytes` each):

* `object_store` (default): the trainer's rank 0 puts each bucket in the Ray object store; every engine worker
  fetches them. Works anywhere Ray does, across nodes, CPU or GPU (through host memory).
* `broadcast`: the trainer's rank 0 and every engine worker form a standalone torch process group (gloo on
  CPU, NCCL on GPUs, so GPU weights go device to device without host copies) and each bucket is broadcast
  as one flat byte buffer; the manifest carries the layout the receivers need to allocate and unpack it.

The trainer computes a checksum over every tensor it sends (names, dtypes, shapes and raw bytes, in name
order); the engine recomputes it on arrival and refuses weights that differ, so a corrupted or partial
transfer stops the run instead of silently training against a different model.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch

from rollflow.errors import WeightSyncError


def weights_checksum(named_tensors: dict[str, torch.Tensor]) -> str:
    """BLAKE2b digest of the tensors (hex). Same tensors -> same digest on any machine."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(named_tensors):
        tensor = named_tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def verify_weights(named_tensors: dict[str, torch.Tensor], expected: str) -> None:
    """Raise `WeightSyncError` unless the tensors hash to `expected`."""
    actual = weights_checksum(named_tensors)
    if actual != expected:
        raise WeightSyncError(
            f"weight sync checksum mismatch: received {len(named_tensors)} tensors hashing to {actual}, "
            f"trainer sent {expected}; the transfer was corrupted"
        )


def weights_nbytes(named_tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in named_tensors.values())


@dataclass
class WeightManifest:
    """One published weight version: what the engines fetch and check.

    Attributes:
        version: policy version (optimizer steps taken).
        checksum: `weights_checksum` of the full set, taken before the transfer.
        buckets: `object_store`: Ray object refs, each a `dict[name, tensor]` of about `bucket_bytes`, in name
            order. `broadcast`: empty.
        nbytes: total tensor bytes.
        num_tensors: tensors over all buckets.
        layouts: `broadcast`: per bucket, the (name, dtype, shape) of each tensor in the flat buffer.
    """

    version: int
    checksum: str
    buckets: list = field(default_factory=list)
    nbytes: int = 0
    num_tensors: int = 0
    layouts: list[list[tuple[str, str, tuple[int, ...]]]] = field(default_factory=list)

    @property
    def num_buckets(self) -> int:
        return len(self.buckets) or len(self.layouts)


def split_buckets(named_tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Group tensors in name order into buckets of at most `bucket_bytes` (a larger tensor goes alone), so
    a transfer streams in bounded pieces instead of one object of the whole model."""
    buckets: list[dict[str, torch.Tensor]] = []
    current: dict[str, torch.Tensor] = {}
    size = 0
    for name in sorted(named_tensors):
        tensor = named_tensors[name]
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def flip_one_byte(named_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of the tensors with one bit of the first tensor's first byte flipped (fault injection)."""
    corrupted = dict(named_tensors)
    name = sorted(corrupted)[0]
    tensor = corrupted[name].clone()
    tensor.view(-1).view(torch.uint8)[0] ^= 1
    corrupted[name] = tensor
    return corrupted


def publish_weights(named_tensors: dict[str, torch.Tensor], version: int, bucket_bytes: int,
                    corrupt: bool = False, transport: str = "object_store",
                    ) -> tuple[WeightManifest, list[dict[str, torch.Tensor]]]:
    """Checksum the weights and split them into buckets for `transport`.

    Args:
        named_tensors: full weights.
        version: the policy version they are.
        bucket_bytes: target bucket size.
        corrupt: flip one byte after the checksum is taken (tests prove the receiver catches it).
        transport: "object_store" (buckets go into the Ray object store now) or "broadcast" (the caller sends
            the returned buckets with `BroadcastGroup.send` while the engines receive).

    Returns:
        (manifest for the engines, the buckets still to send: empty for the object store).
    """
    checksum = weights_checksum(named_tensors)
    if corrupt:
        named_tensors = flip_one_byte(named_tensors)
    buckets = split_buckets(named_tensors, bucket_bytes)
    manifest = WeightManifest(version, checksum, nbytes=weights_nbytes(named_tensors),
                              num_tensors=len(named_tensors))
    if transport == "object_store":
        import ray

        manifest.buckets = [ray.put(bucket) for bucket in buckets]
        return manifest, []
    manifest.layouts = [[(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in b.items()]
                        for b in buckets]
    return manifest, buckets


def pack_bucket(bucket: dict[str, torch.Tensor]) -> torch.Tensor:
    """The bucket's tensors as one flat uint8 buffer, in the bucket's order."""
    return torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for t in bucket.values()])


def layout_nbytes(dtype_name: str, shape: tuple[int, ...]) -> int:
    """Bytes of one tensor of a bucket layout entry."""
    return math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype_name)).element_size()


def unpack_bucket(flat: torch.Tensor, layout: list[tuple[str, str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """Inverse of `pack_bucket` given the bucket's (name, dtype, shape) layout."""
    named, offset = {}, 0
    for name, dtype_name, shape in layout:
        nbytes = layout_nbytes(dtype_name, shape)
        # a copy: a slice at an odd offset cannot be viewed as a wider dtype (alignment)
        named[name] = flat[offset:offset + nbytes].clone().view(getattr(torch, dtype_name)).view(shape)
        offset += nbytes
    return named


class BroadcastGroup:
    """A standalone torch process group of the trainer's rank 0 (rank 0 here) and the engine workers.

    Built on its own TCPStore, not the default process group, so it lives beside the trainer's FSDP group.
    gloo on CPU; NCCL on CUDA devices.

    Args:
        host, port: where rank 0 hosts the store.
        rank: 0 for the trainer, 1..N for the engine workers.
        world_size: N + 1.
        device: "cpu" or "cuda" (the current CUDA device).
        timeout_s: how long a member waits for the others.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, device: str = "cpu",
                 timeout_s: float = 600.0):
        import datetime

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
        if device == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.group = dist.ProcessGroupNCCL(self.store, rank, world_size)
        else:
            self.device = torch.device("cpu")
            self.group = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)

    def send(self, buckets: list[dict[str, torch.Tensor]]) -> None:
        """Broadcast each bucket as one buffer (rank 0)."""
        for bucket in buckets:
            self.group.broadcast(pack_bucket(bucket).to(self.device), 0).wait()

    def receive(self, layouts: list[list[tuple[str, str, tuple[int, ...]]]]) -> list[dict[str, torch.Tensor]]:
        """Receive every bucket described by `layouts` (ranks 1..N)."""
        buckets = []
        for layout in layouts:
            nbytes = sum(layout_nbytes(dtype_name, shape) for _, dtype_name, shape in layout)
            flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.group.broadcast(flat, 0).wait()
            buckets.append(unpack_bucket(flat, layout))
        return buckets


def assemble_weights(manifest: WeightManifest, buckets: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Join the fetched buckets of `manifest` and check them against its checksum.

    Raises:
        WeightSyncError: a missing tensor or a checksum mismatch.
    """
    named: dict[str, torch.Tensor] = {}
    for bucket in buckets:
        named.update(bucket)
    if len(named) != manifest.num_tensors:
        raise WeightSyncError(f"weight sync for version {manifest.version} delivered {len(named)} tensors, "
                              f"the trainer sent {manifest.num_tensors}")
    verify_weights(named, manifest.checksum)
    return named
