import pytest
import torch

from rollflow.cluster.weight_sync import verify_weights, weights_checksum, weights_nbytes
from rollflow.errors import WeightSyncError


def _weights():
    torch.manual_seed(0)
    return {"b": torch.randn(3, 4), "a": torch.arange(5, dtype=torch.int64), "c": torch.randn(2).bfloat16()}


def test_checksum_is_stable_and_order_independent():
    weights = _weights()
    reordered = dict(reversed(list(weights.items())))
    assert weights_checksum(weights) == weights_checksum(reordered)
    assert weights_checksum(weights) == weights_checksum({k: v.clone() for k, v in weights.items()})
    assert weights_nbytes(weights) == 12 * 4 + 5 * 8 + 2 * 2


def test_one_flipped_byte_is_detected():
    weights = _weights()
    checksum = weights_checksum(weights)
    corrupted = {k: v.clone() for k, v in weights.items()}
    corrupted["b"].view(-1).view(torch.uint8)[7] ^= 0x01  # one bit of one byte
    with pytest.raises(WeightSyncError, match="checksum mismatch"):
        verify_weights(corrupted, checksum)
    verify_weights(weights, checksum)  # the original still verifies


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


def test_publish_and_assemble_through_the_object_store(ray_session):
    import ray

    from rollflow.cluster.weight_sync import assemble_weights, publish_weights

    weights = _weights()
    manifest, unsent = publish_weights(weights, version=3, bucket_bytes=50)
    assert unsent == [] and len(manifest.buckets) == 3 and manifest.num_tensors == 3 and manifest.version == 3
    received = assemble_weights(manifest, ray.get(manifest.buckets))
    assert all(torch.equal(received[k], weights[k]) for k in weights)

    corrupted, _ = publish_weights(weights, version=4, bucket_bytes=50, corrupt=True)
    with pytest.raises(WeightSyncError, match="checksum mismatch"):
        assemble_weights(corrupted, ray.get(corrupted.buckets))
    with pytest.raises(WeightSyncError, match="delivered 2 tensors, the trainer sent 3"):
        assemble_weights(manifest, ray.get(manifest.buckets[:2]))


def test_broadcast_buckets_pack_and_unpack_every_dtype():
    from rollflow.cluster.weight_sync import pack_bucket, publish_weights, unpack_bucket

    weights = {**_weights(), "flag": torch.tensor([True, False]), "scalar": torch.tensor(2.5, dtype=torch.float64)}
    manifest, buckets = publish_weights(weights, version=1, bucket_bytes=40, transport="broadcast")
    assert manifest.buckets == [] and manifest.num_buckets == len(buckets) == len(manifest.layouts) > 1
    received = {}
    for bucket, layout in zip(buckets, manifest.layouts):
        flat = pack_bucket(bucket).clone()  # what the receiver's buffer holds after the broadcast
        assert flat.dtype == torch.uint8 and flat.numel() == sum(t.numel() * t.element_size() for t in bucket.values())
        received.update(unpack_bucket(flat, layout))
    assert set(received) == set(weights)
    assert all(received[k].dtype == weights[k].dtype and torch.equal(received[k], weights[k]) for k in weights)
    verify_weights(received, manifest.checksum)
