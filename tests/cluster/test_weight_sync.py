import threading
from collections import Counter

import pytest
import torch

from rollflow.cluster import weight_sync
from rollflow.cluster.weight_sync import (
    CHECKSUM_MODES,
    WeightReceiver,
    fetched_bucket,
    flip_one_byte,
    publish_weights,
    weights_checksum,
    weights_nbytes,
)
from rollflow.errors import WeightSyncError


def _weights():
    torch.manual_seed(0)
    return {"b": torch.randn(3, 4), "a": torch.arange(5, dtype=torch.int64), "c": torch.randn(2).bfloat16()}


def _six_weights():
    """Six 40-byte tensors: with `bucket_bytes=90` three buckets, w0 w1 | w2 w3 | w4 w5."""
    torch.manual_seed(0)
    return {f"w{i}": torch.randn(10) for i in range(6)}


def _receive(manifest, buckets):
    """What a rollout worker does: add the buckets in arrival order, then finish."""
    receiver = WeightReceiver(manifest)
    for bucket in buckets:
        receiver.add(bucket)
    return receiver.finish()


def _fetch(manifest):
    """The object-store buckets as a rollout worker fetches them: flat byte arrays, unpacked by layout."""
    import ray

    return [fetched_bucket(ray.get(ref), layout) for ref, layout in zip(manifest.buckets, manifest.layouts)]


def test_checksum_is_stable_and_order_independent():
    weights = _weights()
    reordered = dict(reversed(list(weights.items())))
    assert weights_checksum(weights) == weights_checksum(reordered)
    assert weights_checksum(weights) == weights_checksum({k: v.clone() for k, v in weights.items()})
    assert weights_nbytes(weights) == 12 * 4 + 5 * 8 + 2 * 2


@pytest.mark.parametrize("mode", ["bucket", "full"])
def test_one_flipped_byte_is_detected(mode):
    weights = _weights()
    manifest, buckets = publish_weights(weights, version=1, bucket_bytes=10**6, checksum=mode,
                                        transport="broadcast")
    corrupted = {k: v.clone() for k, v in weights.items()}
    corrupted["b"].view(-1).view(torch.uint8)[7] ^= 0x01  # one bit of one byte
    assert weights_checksum(corrupted) != weights_checksum(weights)
    with pytest.raises(WeightSyncError, match="checksum mismatch"):
        _receive(manifest, [corrupted])
    _receive(manifest, buckets)  # the original still verifies


def test_renamed_or_reshaped_tensor_changes_the_checksum():
    weights = _weights()
    renamed = {("z" if k == "a" else k): v for k, v in weights.items()}
    reshaped = {**weights, "b": weights["b"].reshape(4, 3)}
    assert len({weights_checksum(w) for w in (weights, renamed, reshaped)}) == 3


def test_buckets_bound_size_and_keep_every_tensor():
    from rollflow.cluster.weight_sync import split_buckets

    weights = {f"w{i}": torch.zeros(10) for i in range(5)}  # 40 bytes each
    weights["big"] = torch.zeros(100)  # 400 bytes: alone in its bucket
    buckets = split_buckets(weights, bucket_bytes=90)
    assert [sorted(b) for b in buckets] == [["big"], ["w0", "w1"], ["w2", "w3"], ["w4"]]
    assert split_buckets(weights, bucket_bytes=10**6) == [dict(sorted(weights.items()))]


def test_publish_and_receive_through_the_object_store(ray_session):

    weights = _weights()
    manifest, unsent = publish_weights(weights, version=3, bucket_bytes=50)
    assert unsent == [] and len(manifest.buckets) == 3 and manifest.num_tensors == 3 and manifest.version == 3
    received = _receive(manifest, _fetch(manifest))
    assert all(torch.equal(received[k], weights[k]) for k in weights)

    corrupted, _ = publish_weights(weights, version=4, bucket_bytes=50, corrupt=True)
    with pytest.raises(WeightSyncError, match="checksum mismatch"):
        _receive(corrupted, _fetch(corrupted))
    with pytest.raises(WeightSyncError, match="delivered 2 tensors, the trainer sent 3"):
        _receive(manifest, _fetch(manifest)[:2])


@pytest.mark.parametrize("mode", CHECKSUM_MODES)
def test_broadcast_buckets_pack_and_unpack_every_dtype(mode):
    from rollflow.cluster.weight_sync import pack_bucket, unpack_bucket

    weights = {**_weights(), "flag": torch.tensor([True, False]),
               "scalar": torch.tensor(2.5, dtype=torch.float64)}
    manifest, buckets = publish_weights(weights, version=1, bucket_bytes=40, checksum=mode,
                                        transport="broadcast")
    assert manifest.buckets == [] and manifest.num_buckets == len(buckets) == len(manifest.layouts) > 1
    receiver = WeightReceiver(manifest)
    for bucket, layout in zip(buckets, manifest.layouts):
        flat = pack_bucket(bucket).clone()  # what the receiver's buffer holds after the broadcast
        assert flat.dtype == torch.uint8
        assert flat.numel() == sum(t.numel() * t.element_size() for t in bucket.values())
        receiver.add(unpack_bucket(flat, layout))
    received = receiver.finish()
    assert set(received) == set(weights)
    assert all(received[k].dtype == weights[k].dtype and torch.equal(received[k], weights[k])
               for k in weights)
    if mode == "full":  # the full-mode digest is the plain checksum of all the weights
        assert manifest.checksum == weights_checksum(weights) == weights_checksum(received)


def test_broadcast_group_delivers_buckets_one_at_a_time_over_gloo():
    from rollflow.cluster.runtime import free_port
    from rollflow.cluster.weight_sync import BroadcastGroup

    weights = _six_weights()
    manifest, buckets = publish_weights(weights, version=2, bucket_bytes=90, transport="broadcast")
    port, groups, errors = free_port(), {}, []

    def trainer():  # rank 0 in a thread: the group needs both ranks to form and to broadcast
        try:
            groups[0] = BroadcastGroup("127.0.0.1", port, 0, 2, timeout_s=30)
            groups[0].send(buckets)
        except Exception as error:  # reported to the test thread below
            errors.append(error)

    sender = threading.Thread(target=trainer)
    sender.start()
    receiver, seen = WeightReceiver(manifest), []
    for bucket in BroadcastGroup("127.0.0.1", port, 1, 2, timeout_s=30).receive(manifest.layouts):
        receiver.add(bucket)  # verified before the next bucket is broadcast
        seen.append(receiver.buckets_received)
    sender.join(timeout=30)
    assert not errors and not sender.is_alive()
    assert seen == [1, 2, 3]
    assert all(torch.equal(receiver.finish()[k], weights[k]) for k in weights)


def test_bucket_mode_names_the_corrupted_bucket_as_it_arrives():
    manifest, buckets = publish_weights(_six_weights(), version=7, bucket_bytes=90, transport="broadcast")
    assert manifest.checksum_mode == "bucket" and len(manifest.bucket_checksums) == 3
    assert manifest.checksum == ""
    buckets[1] = flip_one_byte(buckets[1])  # one bit of w2, in flight
    receiver = WeightReceiver(manifest)
    receiver.add(buckets[0])
    with pytest.raises(WeightSyncError, match=r"checksum mismatch in bucket 1 of 3 "
                                              r"\(tensors 'w2'..'w3', 2 tensors\) for version 7"):
        receiver.add(buckets[1])
    assert receiver.buckets_received == 1  # stopped before loading or fetching the rest

    # the fault-injection hook flips the first byte after the digests: caught at bucket 0
    corrupted, buckets = publish_weights(_six_weights(), version=8, bucket_bytes=90, corrupt=True,
                                         transport="broadcast")
    with pytest.raises(WeightSyncError, match=r"bucket 0 of 3 \(tensors 'w0'..'w1'.*version 8"):
        WeightReceiver(corrupted).add(buckets[0])


def test_full_mode_catches_the_corruption_once_every_bucket_is_in():
    weights = _six_weights()
    manifest, buckets = publish_weights(weights, version=5, bucket_bytes=90, checksum="full", corrupt=True,
                                        transport="broadcast")
    assert manifest.checksum == weights_checksum(weights) and manifest.bucket_checksums == []
    receiver = WeightReceiver(manifest)
    for bucket in buckets:
        receiver.add(bucket)  # full mode compares only at the end
    with pytest.raises(WeightSyncError, match="checksum mismatch for version 5: received 6 tensors hashing"):
        receiver.finish()


def test_off_mode_hashes_nothing_so_a_flipped_byte_gets_through():
    weights = _six_weights()
    manifest, buckets = publish_weights(weights, version=5, bucket_bytes=90, checksum="off", corrupt=True,
                                        transport="broadcast")
    assert manifest.checksum == "" and manifest.bucket_checksums == []
    received = _receive(manifest, buckets)
    # unsafe by design: the corruption reaches the engine (`full` and `bucket` raise on the same transfer)
    assert not torch.equal(received["w0"], weights["w0"])
    assert all(torch.equal(received[k], weights[k]) for k in weights if k != "w0")


@pytest.mark.parametrize("transport", ["broadcast", "object_store"])
@pytest.mark.parametrize("mode", CHECKSUM_MODES)
def test_each_side_hashes_every_tensor_once(mode, transport, monkeypatch, request):
    """Count `hash_tensor` calls per tensor: once on the trainer, once per receiver (`bucket`/`full`),
    never (`off`). A second verification pass anywhere on the path makes a count 2."""
    if transport == "object_store":
        request.getfixturevalue("ray_session")

    calls = Counter()
    hash_tensor = weight_sync.hash_tensor

    def counting_hash_tensor(digest, name, tensor):
        calls[name] += 1
        hash_tensor(digest, name, tensor)

    monkeypatch.setattr(weight_sync, "hash_tensor", counting_hash_tensor)
    weights = _six_weights()
    once = Counter(dict.fromkeys(weights, 1)) if mode != "off" else Counter()

    manifest, outgoing = publish_weights(weights, version=1, bucket_bytes=90, checksum=mode,
                                         transport=transport)
    assert manifest.num_buckets == 3 and calls == once
    for _ in range(2):  # two rollout workers
        calls.clear()
        buckets = outgoing if transport == "broadcast" else _fetch(manifest)
        received = _receive(manifest, buckets)
        assert calls == once and set(received) == set(weights)


@pytest.mark.parametrize("mode", CHECKSUM_MODES)
def test_missing_bucket_or_tensor_is_refused(mode):
    manifest, buckets = publish_weights(_six_weights(), version=9, bucket_bytes=90, checksum=mode,
                                        transport="broadcast")
    with pytest.raises(WeightSyncError, match=r"version 9 delivered 4 tensors, the trainer sent 6 "
                                              r"\(received 2 of 3 buckets\)"):
        _receive(manifest, buckets[:2])
    with pytest.raises(WeightSyncError, match="received bucket 3, but the trainer sent 3 buckets"):
        _receive(manifest, [*buckets, buckets[2]])
    short = [buckets[0], {"w2": buckets[1]["w2"]}, buckets[2]]  # w3 lost from the middle bucket
    lost = "checksum mismatch in bucket 1" if mode == "bucket" else "delivered 5 tensors, the trainer sent 6"
    with pytest.raises(WeightSyncError, match=lost):
        _receive(manifest, short)


def test_unknown_checksum_mode_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown weight checksum mode 'sha'; valid: bucket, full, off"):
        publish_weights(_six_weights(), version=1, bucket_bytes=90, checksum="sha", transport="broadcast")
