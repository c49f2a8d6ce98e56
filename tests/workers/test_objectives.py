import math

import pytest
import torch

from rollflow.algorithms import loss_normalizer
from rollflow.data.sample import Sample, collate
from rollflow.workers.objectives import OBJECTIVES, NLLLoss


def test_sft_loss_hand_computed():
    # Two samples with a one-token prompt: row 0 is prompt [0], response [1, 0] (both trained on); row 1 is
    # prompt [1], response [0, 1] with the last token masked out. B=2, T=2, V=2; logits column t predicts
    # response token t (input column P + t, P = 1).
    # Row 0: logits[0,0] = [0, ln 3] -> p(token 1) = 3/4; target 1, mask 1 -> nll = ln(4/3).
    #        logits[0,1] = [0, 0]    -> p = 1/2;            target 0, mask 1 -> nll = ln 2.
    # Row 1: logits[1,0] = [ln 3, 0] -> p(token 0) = 3/4;  target 0, mask 1 -> nll = ln(4/3).
    #        column 1's target is masked out.
    # Loss = (2 ln(4/3) + ln 2) / 3.
    batch = collate([Sample([0], [1, 0]), Sample([1], [0, 1], loss_mask=[1, 0])], pad_token_id=0)
    assert batch.input_ids.tolist() == [[0, 1, 0], [1, 0, 1]]
    logits = torch.tensor([[[0.0, math.log(3)], [0.0, 0.0]], [[math.log(3), 0.0], [9.0, -9.0]]])
    normalizer = loss_normalizer(batch.response_mask)
    loss, metrics = OBJECTIVES["nll"]()(logits, batch, normalizer)
    expected = (2 * math.log(4 / 3) + math.log(2)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["sft/nll"] == pytest.approx(expected, rel=1e-6)

    # The same sum as a plain loop over every (row, response token).
    targets = batch.input_ids[:, batch.prompt_length :]
    total, count = 0.0, 0
    for b in range(2):
        for t in range(2):
            if batch.response_mask[b, t]:
                total -= torch.log_softmax(logits[b, t], dim=-1)[targets[b, t]].item()
                count += 1
    assert loss.item() == pytest.approx(total / count, rel=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nll_gradient_is_bit_for_bit_the_textbook_masked_mean(seed):
    generator = torch.Generator().manual_seed(seed)
    samples = [Sample([1, 2], [3, 4, 5]), Sample([6], [7]), Sample([8, 9, 1], [2, 3], loss_mask=[0, 1])]
    batch = collate(samples, pad_token_id=0)  # T = 3, padded and masked tokens included
    logits = torch.randn(3, batch.response_width, 11, generator=generator)
    ours = logits.clone().requires_grad_(True)
    loss, _ = NLLLoss("token_mean")(ours, batch, loss_normalizer(batch.response_mask))
    loss.backward()

    textbook = logits.clone().requires_grad_(True)
    tokens, mask = batch.input_ids[:, batch.prompt_length :], batch.response_mask  # [B, T], [B, T]
    picked = torch.log_softmax(textbook, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B, T]
    reference = -(picked * mask).sum() / mask.sum()
    reference.backward()

    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    assert torch.equal(ours.grad, textbook.grad)
