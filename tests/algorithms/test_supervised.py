import math

import pytest
import torch

from rollflow.algorithms import token_nll


def test_token_nll_hand_computed():
    # B=1, T=2, V=3.
    # Column 0: logits [0, ln 2, ln 5] -> exp = [1, 2, 5], sum 8; target 2 -> nll = -ln(5/8) = ln 1.6.
    # Column 1: logits [ln 3, 0, 0]    -> exp = [3, 1, 1], sum 5; target 1 -> nll = -ln(1/5) = ln 5.
    logits = torch.tensor([[[0.0, math.log(2), math.log(5)], [math.log(3), 0.0, 0.0]]])
    tokens = torch.tensor([[2, 1]])
    nll = token_nll(logits, tokens)
    assert nll.shape == (1, 2)
    assert nll[0].tolist() == pytest.approx([math.log(1.6), math.log(5)], rel=1e-6)


def test_token_nll_matches_a_loop_over_tokens():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 5, generator=generator)
    tokens = torch.randint(0, 5, (3, 4), generator=generator)
    expected = torch.tensor([[-torch.log_softmax(logits[b, t], dim=-1)[tokens[b, t]].item() for t in range(4)]
                             for b in range(3)])
    assert torch.allclose(token_nll(logits, tokens), expected, rtol=1e-6, atol=1e-7)
    assert (token_nll(logits, tokens) >= 0).all()
