"""Versioned, checksummed weight transfer from the trainer to inference engines.

The trainer computes a checksum over every tensor it sends (names, dtypes, shapes and raw bytes, in name
order); the engine recomputes it on arrival and refuses weights that differ, so a corrupted or partial
transfer stops the run instead of silently training against a different model.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from rollflow.errors import WeightSyncError


def weights_checksum(named_tensors: dict[str, torch.Tensor]) -> str:
    """BLAKE2b digest of the tensors (hex). Same tensors -> same digest on any machine."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(named_tensors):
        tensor = named_tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
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
        buckets: Ray object refs, each a `dict[name, tensor]` of about `bucket_bytes`, in name order.
        nbytes: total tensor bytes.
        num_tensors: tensors over all buckets.
    """

    version: int
    checksum: str
    buckets: list = field(default_factory=list)
    nbytes: int = 0
    num_tensors: int = 0


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
                    corrupt: bool = False) -> WeightManifest:
    """Checksum the weights, put them in the Ray object store in buckets, return the manifest.

    Args:
        named_tensors: full weights (CPU tensors).
        version: the policy version they are.
        bucket_bytes: target bucket size.
        corrupt: flip one byte after the checksum is taken (tests prove the receiver catches it).
    """
    import ray

    checksum = weights_checksum(named_tensors)
    if corrupt:
        named_tensors = flip_one_byte(named_tensors)
    buckets = [ray.put(bucket) for bucket in split_buckets(named_tensors, bucket_bytes)]
    return WeightManifest(version, checksum, buckets, weights_nbytes(named_tensors), len(named_tensors))


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
