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
