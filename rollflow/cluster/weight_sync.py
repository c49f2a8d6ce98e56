"""Versioned, checksummed weight transfer from the trainer to inference engines.

The trainer computes a checksum over every tensor it sends (names, dtypes, shapes and raw bytes, in name
order); the engine recomputes it on arrival and refuses weights that differ, so a corrupted or partial
transfer stops the run instead of silently training against a different model.
"""

from __future__ import annotations

import hashlib

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
