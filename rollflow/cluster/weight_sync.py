"""Versioned, checksummed weight transfer from the trainer to inference engines.

Three transports carry the same buckets (tensors grouped in name order, about `bucket_bytes` each):

* `object_store` (default): the trainer's rank 0 puts each bucket in the Ray object store; every engine worker
  fetches them. Works anywhere Ray does, across nodes, CPU or GPU (through host memory).
* `broadcast`: the trainer's rank 0 and every engine worker form a standalone torch process group (gloo on
  CPU, NCCL on GPUs, so GPU weights go device to device without host copies) and each bucket is broadcast
  as one flat byte buffer; the manifest carries the layout the receivers need to allocate and unpack it.
* `in_process`: a hybrid worker (`rollflow.workers.hybrid`) holds the trainer and the engine in one process;
  its engine receives the buckets as they are, checked the same way before they load.

Checksums (CRC-32 over each tensor's name, dtype, shape and raw bytes, in name order: an error-detecting
code, ~5x faster than a cryptographic hash, which a transfer between our own processes does not need) are
taken by the trainer and checked by each receiving rollout worker, so a corrupted or partial transfer stops the run
instead of silently training against a different model. Each side hashes every tensor at most once
(`hash_tensor` is the one place that reads tensor bytes for a digest). `CHECKSUM_MODES`:

* `bucket` (default): one digest per bucket; `WeightReceiver.add` checks each bucket as it arrives, so a
  bad bucket is reported by index before the rest is fetched.
* `full`: one digest over all tensors (`weights_checksum`), accumulated as buckets arrive and compared
  once `WeightReceiver.finish` has them all.
* `off`: nothing is hashed, only the tensor and bucket counts are checked. Unsafe: a flipped byte reaches
  the engine unnoticed. For measuring the checksum's cost, not for training runs.

Usage, on either transport:

    manifest, outgoing = publish_weights(weights, version, bucket_bytes, checksum="bucket")  # trainer rank 0
    receiver = WeightReceiver(manifest)                                                    # rollout worker
    for bucket in buckets_as_they_arrive:
        receiver.add(bucket)         # WeightSyncError on a bad bucket (`bucket` mode)
    weights = receiver.finish()      # WeightSyncError on a missing tensor or (`full` mode) a bad digest
"""

from __future__ import annotations

import math
import time
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from rollflow.errors import WeightSyncError

CHECKSUM_MODES = ("bucket", "full", "off")


class Crc32:
    """A running CRC-32 with the `update` / `hexdigest` interface of `hashlib` digests (zlib's CRC-32 reads
    ~6 GB/s on one core, BLAKE2b ~1.3)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def hash_tensor(digest: Crc32, name: str, tensor: torch.Tensor) -> None:
    """Feed one named tensor (name, dtype, shape, raw bytes) into `digest`.

    Every digest of this module goes through here, so the tests can count how often each tensor is hashed.

    Args:
        digest: a running BLAKE2b digest, updated in place.
        name: the tensor's parameter name.
        tensor: any dtype, shape or device (a device tensor is copied to host memory first).
    """
    tensor = tensor.detach().to("cpu").contiguous()
    digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    if tensor.numel():
        # the numpy array is read through the buffer protocol: no bytes copy of the tensor
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())


def _new_digest() -> Crc32:
    return Crc32()


def weights_checksum(named_tensors: dict[str, torch.Tensor]) -> str:
    """CRC-32 of the tensors (hex), in name order. Same tensors -> same digest on any machine.

    The `full` mode digest of all the weights; a `bucket` mode digest is this over one bucket.
    """
    digest = _new_digest()
    for name in sorted(named_tensors):
        hash_tensor(digest, name, named_tensors[name])
    return digest.hexdigest()


def weights_nbytes(named_tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in named_tensors.values())


def check_checksum_mode(mode: str) -> str:
    """Return `mode` if it is one of `CHECKSUM_MODES`, else raise `ValueError` naming the valid ones."""
    if mode not in CHECKSUM_MODES:
        raise ValueError(f"unknown weight checksum mode {mode!r}; valid: {', '.join(CHECKSUM_MODES)}")
    return mode


@dataclass
class WeightManifest:
    """One published weight version: what the engines fetch and check.

    Attributes:
        version: policy version (optimizer steps taken).
        checksum: `full` mode: `weights_checksum` of the full set, taken before the transfer; else "".
        buckets: `object_store`: Ray object refs, each a flat uint8 array of about `bucket_bytes` holding a
            bucket's tensors (`pack_bucket`; `fetched_bucket` unpacks one), in name order. `broadcast`: empty.
        nbytes: total tensor bytes.
        num_tensors: tensors over all buckets.
        layouts: per bucket, the (name, dtype, shape) of each tensor in its flat buffer.
        checksum_mode: one of `CHECKSUM_MODES`.
        bucket_checksums: `bucket` mode: the digest of each bucket, in bucket order; else empty.
        transport: "object_store", "broadcast" or "in_process".
    """

    version: int
    checksum: str
    buckets: list = field(default_factory=list)
    nbytes: int = 0
    num_tensors: int = 0
    layouts: list[list[tuple[str, str, tuple[int, ...]]]] = field(default_factory=list)
    checksum_mode: str = "bucket"
    bucket_checksums: list[str] = field(default_factory=list)
    transport: str = "object_store"

    @property
    def num_buckets(self) -> int:
        return len(self.layouts)


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


def bucket_digests(buckets: list[dict[str, torch.Tensor]], mode: str) -> tuple[str, list[str]]:
    """The digests `mode` sends with `buckets` (from `split_buckets`), hashing each tensor once.

    Returns:
        (`full`: the digest of all tensors, equal to `weights_checksum`; else "",
         `bucket`: one digest per bucket; else []).
    """
    if check_checksum_mode(mode) == "bucket":
        return "", [weights_checksum(bucket) for bucket in buckets]
    if mode == "full":
        digest = _new_digest()
        for bucket in buckets:  # buckets are consecutive runs of the name order: this is the name order
            for name in sorted(bucket):
                hash_tensor(digest, name, bucket[name])
        return digest.hexdigest(), []
    return "", []


def publish_weights(named_tensors: dict[str, torch.Tensor], version: int, bucket_bytes: int,
                    checksum: str = "bucket", corrupt: bool = False, transport: str = "object_store",
                    ) -> tuple[WeightManifest, list[dict[str, torch.Tensor]]]:
    """Split the weights into buckets for `transport` and checksum them as `checksum` says.

    Args:
        named_tensors: full weights.
        version: the policy version they are.
        bucket_bytes: target bucket size.
        checksum: one of `CHECKSUM_MODES` (`checks.weight_checksum`).
        corrupt: flip one byte of the first bucket after the digests are taken (the
            `checks.fault_injection_flip_sync_byte_at` hook; the receiver catches it unless `checksum="off"`).
        transport: "object_store" (buckets go into the Ray object store now), "broadcast" (the caller sends
            the returned buckets with `BroadcastGroup.send` while the engines receive) or "in_process" (a
            hybrid worker's engine takes the returned buckets in the same process).

    Returns:
        (manifest for the engines, the buckets still to send: empty for the object store).
    """
    buckets = split_buckets(named_tensors, bucket_bytes)
    full_checksum, per_bucket = bucket_digests(buckets, checksum)
    if corrupt and buckets:
        buckets[0] = flip_one_byte(buckets[0])
    manifest = WeightManifest(version, full_checksum, nbytes=weights_nbytes(named_tensors),
                              num_tensors=len(named_tensors), checksum_mode=checksum,
                              bucket_checksums=per_bucket, transport=transport)
    manifest.layouts = [[(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in b.items()]
                        for b in buckets]
    if transport == "object_store":
        import ray

        # one flat byte array per bucket: Ray stores a numpy array without pickling it and a reader maps it
        # without a copy; a dict of torch tensors pickles tensor by tensor (4x slower to put and to get)
        manifest.buckets = [ray.put(pack_bucket(bucket).numpy()) for bucket in buckets]
        return manifest, []
    return manifest, buckets


def fetched_bucket(array, layout: list[tuple[str, str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """The tensors of an object-store bucket (the flat byte array `publish_weights` put), as `layout` says."""
    with warnings.catch_warnings():  # the store's array is read-only; `unpack_bucket` copies out of it
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(array)
    return unpack_bucket(flat, layout)


class WeightReceiver:
    """Collects the buckets of one `WeightManifest` on a rollout worker and verifies them once.

    Feed it the buckets in the order the trainer sent them (both transports deliver them in order), then
    call `finish`. `bucket` mode checks each bucket in `add`; `full` mode hashes each bucket in `add` (while
    it is still in cache) and compares the digest in `finish`; `off` hashes nothing.

    Args:
        manifest: what `publish_weights` returned on the trainer.

    Attributes:
        verify_seconds: time spent hashing so far (0 in `off` mode), for the sync metrics.
    """

    def __init__(self, manifest: WeightManifest):
        self.manifest = manifest
        self.mode = check_checksum_mode(manifest.checksum_mode)
        self.weights: dict[str, torch.Tensor] = {}
        self.buckets_received = 0
        self.verify_seconds = 0.0
        self._full_digest = _new_digest() if self.mode == "full" else None

    def add(self, bucket: dict[str, torch.Tensor]) -> None:
        """Take the next bucket; in `bucket` mode verify it now.

        Raises:
            WeightSyncError: more buckets than the trainer sent, or (`bucket` mode) a digest mismatch, naming
                the bucket index, the version and the bucket's first and last tensor names.
        """
        manifest, index = self.manifest, self.buckets_received
        if index >= manifest.num_buckets:
            raise WeightSyncError(f"weight sync for version {manifest.version} received bucket {index}, but "
                                  f"the trainer sent {manifest.num_buckets} buckets")
        started = time.perf_counter()
        if self.mode == "bucket":
            actual, expected = weights_checksum(bucket), manifest.bucket_checksums[index]
            if actual != expected:
                names = sorted(bucket)
                span = f"{names[0]!r}..{names[-1]!r}" if names else "no tensors"
                raise WeightSyncError(
                    f"weight sync checksum mismatch in bucket {index} of {manifest.num_buckets} "
                    f"(tensors {span}, {len(names)} tensors) for version {manifest.version}: "
                    f"received {actual}, trainer sent {expected}; the transfer was corrupted"
                )
        elif self.mode == "full":
            for name in sorted(bucket):
                hash_tensor(self._full_digest, name, bucket[name])
        self.verify_seconds += time.perf_counter() - started
        self.weights.update(bucket)
        self.buckets_received += 1

    def finish(self) -> dict[str, torch.Tensor]:
        """The full weights, once every bucket has arrived; in `full` mode verify them now.

        Raises:
            WeightSyncError: a missing bucket or tensor, or (`full` mode) a checksum mismatch.
        """
        manifest, received = self.manifest, len(self.weights)
        if received != manifest.num_tensors or self.buckets_received != manifest.num_buckets:
            raise WeightSyncError(
                f"weight sync for version {manifest.version} delivered {received} tensors, the trainer sent "
                f"{manifest.num_tensors} (received {self.buckets_received} of {manifest.num_buckets} buckets)"
            )
        if self.mode == "full":
            actual = self._full_digest.hexdigest()
            if actual != manifest.checksum:
                raise WeightSyncError(
                    f"weight sync checksum mismatch for version {manifest.version}: received {received} "
                    f"tensors hashing to {actual}, trainer sent {manifest.checksum}; "
                    f"the transfer was corrupted"
                )
        return self.weights


def pack_bucket(bucket: dict[str, torch.Tensor]) -> torch.Tensor:
    """The bucket's tensors as one flat uint8 buffer, in the bucket's order."""
    return torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for t in bucket.values()])


def layout_nbytes(dtype_name: str, shape: tuple[int, ...]) -> int:
    """Bytes of one tensor of a bucket layout entry."""
    return math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype_name)).element_size()


def unpack_bucket(flat: torch.Tensor,
                  layout: list[tuple[str, str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
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

    def receive(self,
                layouts: list[list[tuple[str, str, tuple[int, ...]]]]) -> Iterator[dict[str, torch.Tensor]]:
        """Yield each bucket described by `layouts` as it arrives (ranks 1..N), so the caller can verify
        one bucket before the next is broadcast. Every bucket must be consumed: the trainer waits for all."""
        for layout in layouts:
            nbytes = sum(layout_nbytes(dtype_name, shape) for _, dtype_name, shape in layout)
            flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.group.broadcast(flat, 0).wait()
            yield unpack_bucket(flat, layout)
