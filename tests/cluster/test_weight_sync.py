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
