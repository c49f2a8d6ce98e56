import pytest
import torch

from rollflow.backends.base import TrainerSettings
from rollflow.backends.torch_backend import TorchBackend
from rollflow.config import AlgorithmConfig
from rollflow.data.sample import Sample, collate
from rollflow.errors import NonFiniteError
from rollflow.workers.actor_loss import ActorLoss
from tests.conftest import policy_batch


def _batch():
    torch.manual_seed(0)
    return policy_batch()


def _trained_weights(model_dir, micro_batch_size, aggregation):
    torch.manual_seed(0)
    backend = TorchBackend(TrainerSettings(model_dir, lr=1e-2, micro_batch_size=micro_batch_size))
    loss = ActorLoss(AlgorithmConfig(loss_aggregation=aggregation), temperature=1.0)
    metrics = backend.train_step(_batch(), loss)
    return backend.named_weights(), metrics


def test_train_step_changes_weights_and_reports_finite_metrics(random_model_dir):
    before = TorchBackend(TrainerSettings(random_model_dir, trainable=False)).named_weights()
    after, metrics = _trained_weights(random_model_dir, 8, "token_mean")
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert {"loss", "grad_norm", "lr"} <= set(metrics)


def _accumulated_gradients(model_dir, micro_batch_size, aggregation):
    backend = TorchBackend(TrainerSettings(model_dir, lr=1e-2, micro_batch_size=micro_batch_size,
                                           max_grad_norm=1e9))
    backend.optimizer.step = lambda: None  # keep the accumulated gradient for inspection
    backend.optimizer.zero_grad = lambda set_to_none=True: None
    backend.train_step(_batch(), ActorLoss(AlgorithmConfig(loss_aggregation=aggregation), temperature=1.0))
    return {n: p.grad.clone() for n, p in backend.model.named_parameters()}


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_micro_batching_does_not_change_the_gradient(random_model_dir):
    """Global loss normalization: 1 micro-batch of 8 and 4 micro-batches of 2 give the same gradient."""
    for aggregation in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        whole = _accumulated_gradients(random_model_dir, 8, aggregation)
        split = _accumulated_gradients(random_model_dir, 2, aggregation)
        assert any(g.abs().max() > 0 for g in whole.values())
        for name in whole:
            assert torch.allclose(whole[name], split[name], atol=1e-7, rtol=1e-4), (aggregation, name)


def test_save_and_load_restore_weights_and_optimizer(random_model_dir, tmp_path):
    backend = TorchBackend(TrainerSettings(random_model_dir, lr=1e-2, micro_batch_size=8))
    loss = ActorLoss(AlgorithmConfig(), temperature=1.0)
    backend.train_step(_batch(), loss)
    backend.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    restored = TorchBackend(TrainerSettings(str(tmp_path / "ckpt"), lr=1e-2, micro_batch_size=8))
    restored.load(tmp_path / "ckpt")
    backend.train_step(_batch(), loss)  # the same next step from both must land on the same weights
    restored.train_step(_batch(), loss)
    a, b = backend.named_weights(), restored.named_weights()
    assert all(torch.allclose(a[n], b[n], atol=1e-7) for n in a)


def test_lr_schedule_warms_up_then_holds_or_decays():
    from rollflow.backends.base import lr_multiplier

    # warm-up over 4 steps: 1/4, 2/4, 3/4, 4/4
    assert [lr_multiplier(s, 4, 20, "constant") for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_multiplier(19, 4, 20, "constant") == 1.0
    # cosine after warm-up: 1 at step 4, 0.5 halfway (step 12 of 4..20), 0 at the end
    assert lr_multiplier(4, 4, 20, "cosine") == pytest.approx(1.0)
    assert lr_multiplier(12, 4, 20, "cosine") == pytest.approx(0.5)
    assert lr_multiplier(20, 4, 20, "cosine") == pytest.approx(0.0, abs=1e-12)


def test_offload_moves_weights_and_adam_state_and_guards_use(random_model_dir):
    from rollflow.backends.training_state import move_training_state

    backend = TorchBackend(TrainerSettings(random_model_dir, lr=1e-2, micro_batch_size=8))
    loss = ActorLoss(AlgorithmConfig(), temperature=1.0)
    backend.train_step(_batch(), loss)  # Adam now holds moment tensors
    move_training_state(backend.model, backend.optimizer, "meta")  # a device every machine has
    assert all(p.device.type == "meta" for p in backend.model.parameters())
    moments = [v for state in backend.optimizer.state.values() for v in state.values() if v.dim() > 0]
    assert moments and all(v.device.type == "meta" for v in moments)

    backend = TorchBackend(TrainerSettings(random_model_dir, lr=1e-2, micro_batch_size=8))
    backend.offload()  # on CPU nothing moves, but the backend refuses work until onload
    with pytest.raises(RuntimeError, match="offloaded"):
        backend.train_step(_batch(), loss)
    backend.onload()
    assert torch.isfinite(torch.tensor(backend.train_step(_batch(), loss)["loss"]))  # works again


class NaNGradientLoss:
    """The policy loss plus sqrt(0 * logits): the loss stays finite, its gradient is NaN (inf * 0)."""

    def __init__(self):
        self.loss = ActorLoss(AlgorithmConfig(), temperature=1.0)

    def __call__(self, logits, batch, normalizer):
        loss, metrics = self.loss(logits, batch, normalizer)
        return loss + torch.sqrt((logits * 0).sum()), metrics


def _weights(backend):
    return {name: p.detach().clone() for name, p in backend.model.named_parameters()}


def test_a_nan_gradient_stops_before_any_weight_changes(random_model_dir):
    backend = TorchBackend(TrainerSettings(random_model_dir, lr=1e-2, micro_batch_size=4))
    backend.train_step(_batch(), ActorLoss(AlgorithmConfig(), temperature=1.0))  # step 1 is a good one
    before = _weights(backend)
    with pytest.raises(NonFiniteError) as raised:
        backend.train_step(_batch(), NaNGradientLoss())
    assert str(raised.value) == "non-finite grad norm (nan) at optimizer step 2; the weights were not updated"
    assert raised.value.weights_updated is False
    assert all(torch.equal(before[n], p) for n, p in backend.model.named_parameters())
    assert all(p.grad is None for p in backend.model.parameters())  # the bad gradient is gone too
    nan_loss = lambda logits, batch, normalizer: (logits.sum() * float("nan"), {})  # noqa: E731
    with pytest.raises(NonFiniteError, match=r"non-finite loss \(nan\) at optimizer step 2"):
        backend.train_step(_batch(), nan_loss)


def test_skip_step_drops_a_nan_gradient_and_the_next_step_trains(random_model_dir):
    backend = TorchBackend(TrainerSettings(random_model_dir, lr=1e-2, micro_batch_size=4, warmup_steps=2,
                                           on_nonfinite="skip_step"))
    before = _weights(backend)
    skipped = backend.train_step(_batch(), NaNGradientLoss())
    assert skipped["skipped_steps"] == 1.0 and skipped["lr"] == pytest.approx(0.5e-2)  # warm-up 1/2 still
    assert all(torch.equal(before[n], p) for n, p in backend.model.named_parameters())
    assert backend.scheduler.last_epoch == 0  # the LR schedule did not advance
    trained = backend.train_step(_batch(), ActorLoss(AlgorithmConfig(), temperature=1.0))
    assert trained["skipped_steps"] == 0.0 and trained["lr"] == pytest.approx(1e-2)
    assert any(not torch.equal(before[n], p) for n, p in backend.model.named_parameters())


@pytest.mark.parametrize("on_nonfinite", ["stop", "skip_step"])
def test_weights_a_step_made_non_finite_stop_the_run_in_both_modes(random_model_dir, on_nonfinite):
    backend = TorchBackend(TrainerSettings(random_model_dir, lr=float("inf"), micro_batch_size=8,
                                           on_nonfinite=on_nonfinite))
    with pytest.raises(NonFiniteError) as raised:
        backend.train_step(_batch(), ActorLoss(AlgorithmConfig(), temperature=1.0))
    assert str(raised.value) == "weights became non-finite after optimizer step 1"
    assert raised.value.weights_updated is True


def test_huge_but_finite_weights_are_not_reported_as_non_finite(random_model_dir):
    """The check reads the largest |weight|, whose square would overflow a 2-norm into a false alarm."""
    backend = TorchBackend(TrainerSettings(random_model_dir, lr=1e30, micro_batch_size=8))
    backend.train_step(_batch(), ActorLoss(AlgorithmConfig(), temperature=1.0))
    largest = max(float(p.detach().abs().max()) for p in backend.model.parameters())
    assert 1e25 < largest < float("inf")


def _long_tail_batch():
    """12 rows, prompts of 1-5 tokens; 2 responses of 24 tokens, the rest of 2 (one ending in an env token),
    with old / reference logprobs, so the actor loss reads every [b, T] extra it can."""
    gen = torch.Generator().manual_seed(5)
    samples = []
    for i in range(12):
        prompt = torch.randint(3, 60, (1 + (3 * i) % 5,), generator=gen).tolist()
        response = torch.randint(3, 60, (24 if i in (3, 8) else 2,), generator=gen).tolist()
        loss_mask = [1, 0] if i == 5 else None  # a tool token at the end
        samples.append(Sample(prompt, response, loss_mask=loss_mask, group_id=i // 4, reward=float(i % 2)))
    batch = collate(samples, pad_token_id=0)
    shape = batch.response_mask.shape  # [12, 24]
    batch.extras["advantages"] = torch.randn(12, 1, generator=gen) * batch.response_mask
    batch.extras["old_logprobs"] = -torch.rand(shape, generator=gen) * 4 * batch.response_mask
    batch.extras["ref_logprobs"] = -torch.rand(shape, generator=gen) * 4 * batch.response_mask
    return batch


class WidthRecorder:
    """Wraps a loss function and records the [b, t] shape of each micro-batch it is given."""

    def __init__(self, loss_fn):
        self.loss_fn, self.shapes = loss_fn, []

    def __call__(self, outputs, batch, normalizer):
        self.shapes.append(tuple(batch.response_mask.shape))
        return self.loss_fn(outputs, batch, normalizer)


def _gradients_and_metrics(model_dir, trim, aggregation):
    backend = TorchBackend(TrainerSettings(model_dir, lr=1e-2, micro_batch_size=3, max_grad_norm=1e9),
                           trim_micro_batches=trim)
    backend.optimizer.step = lambda: None  # keep the accumulated gradient for inspection
    backend.optimizer.zero_grad = lambda set_to_none=True: None
    config = AlgorithmConfig(loss_aggregation=aggregation, kl_loss_coef=0.1, entropy_coef=0.01)
    loss = WidthRecorder(ActorLoss(config, temperature=1.0))
    metrics = backend.train_step(_long_tail_batch(), loss)
    return {n: p.grad.clone() for n, p in backend.model.named_parameters()}, metrics, loss.shapes


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_trimmed_length_grouped_micro_batches_give_the_full_width_gradient(random_model_dir, aggregation):
    """The 2 long rows share the first micro-batch; the other 3 passes are 2 columns wide instead of 24, and
    the loss, metrics and gradient are the untrimmed ones (seq_mean_token_sum_norm with no
    max_response_length divides by the BATCH's width, 24, whatever a micro-batch's width)."""
    full, full_metrics, full_shapes = _gradients_and_metrics(random_model_dir, False, aggregation)
    trimmed, metrics, shapes = _gradients_and_metrics(random_model_dir, True, aggregation)
    assert full_shapes == [(3, 24)] * 4
    assert shapes == [(3, 24), (3, 2), (3, 2), (3, 2)]
    assert set(metrics) == set(full_metrics)
    for key, value in full_metrics.items():
        if key.endswith(("_max", "_min")):
            continue  # a token-weighted mean of per-micro-batch extremes: it depends on the split anyway
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert any(g.abs().max() > 0 for g in full.values())
    for name in full:
        assert torch.allclose(trimmed[name], full[name], atol=1e-7, rtol=1e-4), name


def test_trimmed_forward_passes_return_full_width_rows_in_order(random_model_dir):
    batch = _long_tail_batch()
    results = {}
    for trim in (False, True):
        settings = TrainerSettings(random_model_dir, trainable=False, micro_batch_size=3)
        results[trim] = TorchBackend(settings, trim_micro_batches=trim).forward_logprobs(batch, temperature=0.7)
    assert results[True].shape == batch.response_mask.shape == (12, 24)
    assert torch.allclose(results[True], results[False], atol=1e-5)
    real = batch.attention_mask[:, batch.prompt_length:] > 0  # [B, T]
    assert bool((results[True][~real] == 0).all()) and bool((results[True][real] < 0).all())


def test_trimmed_value_passes_match_the_full_width_ones(random_model_dir):
    batch = _long_tail_batch()
    values = []
    for trim in (False, True):
        critic = TorchBackend(TrainerSettings(random_model_dir, trainable=False, value_head=True,
                                              micro_batch_size=5), trim_micro_batches=trim)
        torch.manual_seed(0)
        torch.nn.init.normal_(critic.model.value_head.weight)  # the zero-initialized head would read 0
        values.append(critic.forward_values(batch))  # [12, 24]
    assert values[0].abs().max() > 0
    assert torch.allclose(values[1], values[0], atol=1e-5)
