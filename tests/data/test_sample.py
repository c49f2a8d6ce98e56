import pickle

import pytest
import torch

from rollflow.data.sample import Sample, SampleStatus, collate


def test_collate_left_pads_prompts_and_right_pads_responses():
    samples = [
        Sample(prompt_ids=[1, 2, 3], response_ids=[4, 5], response_logprobs=[-0.1, -0.2], group_id=0,
               reward=1.0),
        Sample(prompt_ids=[7], response_ids=[8, 9, 10], loss_mask=[1, 0, 1], response_logprobs=[-1, 0, -3],
               policy_versions=[2, -1, 2], group_id=1, status=SampleStatus.TRUNCATED),
    ]
    batch = collate(samples, pad_token_id=0)
    # P = 3 (longest prompt), T = 3 (longest response)
    assert batch.prompt_length == 3 and batch.response_width == 3
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 0], [0, 0, 7, 8, 9, 10]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    # positions count from each row's first real token
    assert batch.position_ids[1].tolist() == [0, 0, 0, 1, 2, 3]
    assert batch.position_ids[0, :5].tolist() == [0, 1, 2, 3, 4]
    # the env token (loss_mask 0) and the padding are not trained on
    assert batch.response_mask.tolist() == [[1, 1, 0], [1, 0, 1]]
    assert torch.allclose(batch.rollout_logprobs, torch.tensor([[-0.1, -0.2, 0.0], [-1.0, 0.0, -3.0]]))
    assert batch.policy_versions.tolist() == [[-1, -1, -1], [2, -1, 2]]
    assert batch.rewards.tolist() == [1.0, 0.0]
    assert batch.truncated.tolist() == [False, True]
    assert batch.response_lengths.tolist() == [2, 3]


def test_select_keeps_columns_and_extras():
    batch = collate([Sample([1], [2]), Sample([3, 4], [5, 6])], pad_token_id=0)
    batch.extras["advantages"] = torch.tensor([[1.0, 0.0], [2.0, 3.0]])
    row = batch.select(slice(1, 2))
    assert row.size == 1 and row.prompt_length == batch.prompt_length
    assert row.extras["advantages"].tolist() == [[2.0, 3.0]]


def test_mismatched_per_token_lists_are_rejected():
    with pytest.raises(ValueError, match="response_logprobs has 1 entries for 2"):
        Sample([1], [2, 3], response_logprobs=[-1.0])


def test_collate_of_nothing_is_an_error():
    with pytest.raises(ValueError):
        collate([], 0)


def test_to_moves_every_tensor_and_extra():
    batch = collate([Sample([1], [2]), Sample([3, 4], [5, 6])], pad_token_id=0)
    batch.extras["advantages"] = torch.ones(2, 2)
    assert batch.to("cpu") is batch  # already there: no copy
    moved = batch.to("meta")  # a device every machine has
    assert moved.input_ids.device.type == "meta" and moved.response_mask.device.type == "meta"
    assert moved.extras["advantages"].device.type == "meta"
    assert moved.prompt_length == batch.prompt_length and batch.input_ids.device.type == "cpu"


def test_collate_numbers_the_domains_and_select_keeps_them():
    samples = [Sample([1], [2], domain="sum3"), Sample([1], [2]), Sample([1], [2], domain="add2")]
    batch = collate(samples, pad_token_id=0)
    assert batch.domain_names == ("add2", "default", "sum3")  # sorted
    assert batch.domain_ids.tolist() == [2, 1, 0]
    picked = batch.select(torch.tensor([2, 0]))
    assert picked.domain_ids.tolist() == [0, 2] and picked.domain_names == batch.domain_names
    assert batch.select(slice(1, 2)).domain_ids.tolist() == [1]
    assert batch.to("meta").domain_ids.device.type == "meta"


def _uneven_batch():
    """P = 3, T = 4:
    row 0: [1, 2, 3 | 4, _, _, _]
    row 1: [_, _, 5 | 6, 7, _, _]   (7 is an env token: real, not trained on)
    row 2: [_, 8, 9 | 10, 11, 12, 13]
    """
    samples = [Sample([1, 2, 3], [4]), Sample([5], [6, 7], loss_mask=[1, 0]), Sample([8, 9], [10, 11, 12, 13])]
    batch = collate(samples, pad_token_id=0)
    batch.extras["advantages"] = torch.arange(12, dtype=torch.float32).reshape(3, 4) * batch.response_mask
    batch.extras["scores"] = torch.tensor([0.5, 1.5, 2.5])  # a [B] extra
    return batch


def test_trimmed_drops_the_columns_no_row_of_a_micro_batch_uses():
    batch = _uneven_batch()
    assert (batch.prompt_length, batch.response_width) == (3, 4)
    assert batch.trimmed() is batch  # every column is used by some row

    alone = batch.select(torch.tensor([1])).trimmed()  # 2 leading prompt columns and 2 trailing response ones
    assert (alone.prompt_length, alone.response_width) == (1, 2)
    assert alone.input_ids.tolist() == [[5, 6, 7]]
    assert alone.attention_mask.tolist() == [[1, 1, 1]]
    assert alone.position_ids.tolist() == [[0, 1, 2]]  # unchanged: counted from the first real token
    assert alone.response_mask.tolist() == [[1, 0]]  # the env token's column stays: it is a real token
    assert alone.rollout_logprobs.shape == alone.policy_versions.shape == (1, 2)
    assert alone.extras["advantages"].tolist() == [[4.0, 0.0]]  # [b, T] extras lose the same columns
    assert alone.extras["scores"].tolist() == [1.5]  # [b] tensors are unchanged
    assert alone.response_lengths.tolist() == [2] and alone.domain_ids.tolist() == [0]

    # rows 1 and 0: row 0 uses every prompt column, neither uses response columns 2 and 3
    pair = batch.select(torch.tensor([1, 0])).trimmed()
    assert (pair.prompt_length, pair.response_width) == (3, 2)
    assert pair.input_ids.tolist() == [[0, 0, 5, 6, 7], [1, 2, 3, 4, 0]]
    assert pair.position_ids.tolist() == batch.position_ids[[1, 0], :5].tolist()

    # rows 1 and 2: the first prompt column goes, every response column stays
    pair = batch.select(torch.tensor([1, 2])).trimmed()
    assert (pair.prompt_length, pair.response_width) == (2, 4)
    assert pair.input_ids.tolist() == [[0, 5, 6, 7, 0, 0], [8, 9, 10, 11, 12, 13]]
    assert pair.position_ids.tolist() == batch.position_ids[1:, 1:].tolist()


def test_trimmed_keeps_one_response_column_and_rejects_extras_of_another_width():
    batch = collate([Sample([1, 2], []), Sample([3], [])], pad_token_id=0)  # failed samples: no response
    trimmed = batch.trimmed()
    assert (trimmed.prompt_length, trimmed.response_width) == (2, 1) and trimmed is batch
    batch = _uneven_batch()
    batch.extras["pairs"] = torch.zeros(3, 2)  # neither [B] nor [B, T]
    with pytest.raises(ValueError, match=r"extras\['pairs'\] has shape \(1, 2\); extras are \[B\] or \[B, T\]"):
        batch.select(torch.tensor([1])).trimmed()


def test_a_batch_pickles_its_tensors_as_numpy_and_comes_back_equal_and_writable():
    """The driver sends the trainer a batch every step: torch's tensor pickling runs a `torch.load` per
    tensor on the way in; the batch's own reduction sends numpy arrays and rebuilds equal, writable tensors
    (bfloat16, which numpy lacks, and tensors that need grad keep torch's pickling)."""
    batch = collate([Sample([1, 2, 3], [4, 5], response_logprobs=[-0.5, -1.0]), Sample([1], [6])], pad_token_id=0)
    batch.extras["advantages"] = torch.tensor([[0.5, 0.5], [-1.0, 0.0]])
    assert b"_rebuild_tensor" not in pickle.dumps(batch, protocol=5)  # no tensor pickled the torch way
    batch.extras["teacher"] = torch.ones(2, 2, dtype=torch.bfloat16)
    batch.extras["graded"] = torch.ones(2, requires_grad=True)
    copy = pickle.loads(pickle.dumps(batch, protocol=5))
    for name in ("input_ids", "attention_mask", "position_ids", "response_mask", "rollout_logprobs",
                 "policy_versions", "rewards", "group_ids", "response_lengths", "truncated", "domain_ids"):
        original, restored = getattr(batch, name), getattr(copy, name)
        assert restored.dtype == original.dtype and torch.equal(restored, original), name
    assert copy.prompt_length == batch.prompt_length and copy.domain_names == batch.domain_names
    assert set(copy.extras) == {"advantages", "teacher", "graded"}
    assert copy.extras["teacher"].dtype == torch.bfloat16 and copy.extras["graded"].requires_grad
    assert torch.equal(copy.extras["advantages"], batch.extras["advantages"])
    copy.input_ids[0, 0] = 7  # writable, and not the original's memory
    assert batch.input_ids[0, 0] != 7
