"""The critic: value model alignment, the clipped value loss it trains with, save/load."""

import pytest
import torch

from rollflow.algorithms import loss_normalizer
from rollflow.backends.base import TrainerSettings
from rollflow.backends.torch_backend import TorchBackend
from rollflow.backends.value_model import ValueModel, response_values
from rollflow.data.sample import Sample, collate
from rollflow.workers.objectives import CriticLoss


def _samples():
    return [Sample([3, 4, 5], [6, 7, 8], group_id=0, reward=1.0), Sample([3], [9, 6], group_id=1, reward=0.0)]


def test_clipped_value_loss_with_metrics():
    batch = collate(_samples()[:1], pad_token_id=0)
    batch.extras["values"] = torch.tensor([[0.0, 0.0, 0.0]])  # at rollout time
    batch.extras["returns"] = torch.tensor([[1.0, 1.0, 1.0]])
    values = torch.tensor([[0.2, 1.0, -0.5]], requires_grad=True)
    loss, metrics = CriticLoss("token_mean", value_clip=0.5)(values, batch, loss_normalizer(batch.response_mask))
    # per token 0.5 * max((V - R)^2, (clip(V, -0.5, 0.5) - R)^2):
    # 0.2: max(0.64, 0.64) = 0.64; 1.0: max(0, 0.25) = 0.25; -0.5: max(2.25, 2.25) = 2.25
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.25 + 2.25) / 3)
    assert metrics["critic/value_clip_frac"] == pytest.approx(1 / 3)  # only 1.0 moved more than 0.5
    assert metrics["critic/values_mean"] == pytest.approx((0.2 + 1.0 - 0.5) / 3)


def test_value_of_token_t_is_read_before_token_t(random_model_dir):
    torch.manual_seed(0)
    model = ValueModel.from_pretrained(random_model_dir)
    torch.nn.init.normal_(model.value_head.weight)  # the zero init would make every value 0
    batch = collate(_samples(), pad_token_id=0)
    values = response_values(model, batch)  # [2, 3]
    changed = _samples()
    changed[0].response_ids = [6, 9, 8]  # change response token 1 of sample 0
    values_changed = response_values(model, collate(changed, pad_token_id=0))
    # V_0 and V_1 depend on the tokens before them only; V_2 sees the changed token
    assert torch.equal(values[0, :2], values_changed[0, :2])
    assert not torch.allclose(values[0, 2], values_changed[0, 2])


def test_value_backend_starts_at_zero_learns_and_round_trips(random_model_dir, tmp_path):
    torch.manual_seed(0)
    backend = TorchBackend(TrainerSettings(random_model_dir, lr=1e-2, micro_batch_size=1, value_head=True))
    batch = collate(_samples(), pad_token_id=0)
    values = backend.forward_values(batch)  # [2, 3]
    assert torch.all(values == 0)  # zero-initialized head
    batch.extras["values"] = values
    batch.extras["returns"] = torch.tensor([[1.0, 1.0, 1.0], [0.5, 0.5, 0.0]]) * batch.response_mask
    loss_fn = CriticLoss("token_mean", value_clip=None)
    losses = [backend.train_step(batch, loss_fn)["critic/value_loss"] for _ in range(20)]
    assert losses[-1] < 0.5 * losses[0]
    trained = backend.forward_values(batch)
    assert trained[1, 2] == 0  # padding
    backend.save(tmp_path / "critic")
    restored = TorchBackend(TrainerSettings(random_model_dir, micro_batch_size=1, value_head=True))
    restored.load(tmp_path / "critic")
    assert torch.equal(restored.forward_values(batch), trained)
