"""Clipped value loss: hand-computed values and gradients."""

import torch
from torch.testing import assert_close

from rollflow.algorithms import clipped_value_loss


def test_clipped_value_loss():
    values = torch.tensor([[1.0, 2.0, 1.0, 5.0]], requires_grad=True)
    old = torch.tensor([[0.5, 2.0, 0.5, 0.0]])
    returns = torch.tensor([[0.0, 3.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # clip 0.2:
    #   tok0: (1-0)^2 = 1;  clipped V = 0.5 + 0.2 = 0.7, (0.7-0)^2 = 0.49;  0.5 * max = 0.5,   grad (V - R) = 1
    #   tok1: (2-3)^2 = 1;  clipped V = 2.0,            (2-3)^2 = 1;        0.5,              grad -1
    #   tok2: (1-2)^2 = 1;  clipped V = 0.7,            (0.7-2)^2 = 1.69;   0.845 (clipped),  grad 0
    #   tok3: masked -> 0
    loss = clipped_value_loss(values, old, returns, mask, clip=0.2)
    assert_close(loss.detach(), torch.tensor([[0.5, 0.5, 0.845, 0.0]]))
    loss.sum().backward()
    assert_close(values.grad, torch.tensor([[1.0, -1.0, 0.0, 0.0]]))


def test_unclipped_value_loss():
    values = torch.tensor([[1.0, 2.0, 1.0]])
    loss = clipped_value_loss(values, torch.zeros(1, 3), torch.tensor([[0.0, 3.0, 2.0]]), torch.ones(1, 3))
    assert_close(loss, torch.tensor([[0.5, 0.5, 0.5]]))  # 0.5 * (V - R)^2
