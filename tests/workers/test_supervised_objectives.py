"""The supervised objectives on a real torch backend: DPO's per-row surrogate gives the gradient of the batch's
mean pair loss however the pairs are split, the config's options reach the loss, the distillation loss does
not depend on the micro-batch size, and the teacher's top-k with k = V is the full log-softmax."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollflow.backends import create_backend
from rollflow.backends.base import TrainerSettings, unpack_top_k
from rollflow.backends.logprobs import model_logits, response_tokens, token_logprobs
from rollflow.config import load_config
from rollflow.data.char_tokenizer import build_ascii_tokenizer
from rollflow.data.sample import collate
from rollflow.data.supervised import ConversationEncoder
from rollflow.workers.objectives import OBJECTIVES, DistillLoss, NLLLoss, PreferenceLoss
from tests.conftest import save_random_model

# Pairs whose rows differ in length, so micro-batches trimmed and ordered by length split every pair.
PAIRS = [("23+58", "81", "84"), ("7+5", "12", "3"), ("99+99", "198", "19"), ("40+2", "42", "420")]
LR = 1e-4  # small: AdamW's first step is ~lr * sign(grad), so weights agree to ~lr * (relative grad error)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A small student (policy) and a different teacher (reference), both with the ASCII tokenizer."""
    root = tmp_path_factory.mktemp("objectives")
    return (save_random_model(root / "student", seed=0, hidden=32, layers=1),
            save_random_model(root / "teacher", seed=1, hidden=32, layers=1))


def _backend(model_dir: str, micro_batch_size: int = 32, trainable: bool = True, **kwargs):
    settings = TrainerSettings(model_path=model_dir, lr=LR, max_grad_norm=1e9, micro_batch_size=micro_batch_size,
                               trainable=trainable, device="cpu")
    return create_backend("torch", settings, **kwargs)


def _gradients_of_next_step(backend) -> list[torch.Tensor]:
    """Filled with the gradient the optimizer steps on (after clipping, which max_grad_norm=1e9 makes a no-op)
    at the next `train_step`."""
    captured: list[torch.Tensor] = []

    def keep(optimizer, args, kwargs):
        captured.extend(p.grad.detach().clone() for group in optimizer.param_groups for p in group["params"])

    backend.optimizer.register_step_pre_hook(keep)
    return captured


def _assert_close(got: list[torch.Tensor] | dict, expected: list[torch.Tensor] | dict, atol: float) -> None:
    if isinstance(got, dict):
        assert got.keys() == expected.keys()
        got, expected = list(got.values()), list(expected.values())
    assert len(got) == len(expected) and got
    worst = max(float((a - b).abs().max()) for a, b in zip(got, expected))
    assert worst <= atol, worst


@pytest.fixture(scope="module")
def preference_batch(model_dirs):
    """Rows alternating chosen, rejected with the reference's (the teacher model's) log-probs."""
    encoder = ConversationEncoder(build_ascii_tokenizer())
    samples = []
    for prompt, chosen, rejected in PAIRS:
        row = {"prompt": prompt, "response": chosen}
        samples += [encoder.encode(row, chosen), encoder.encode(row, rejected)]
    batch = collate(samples, pad_token_id=0)
    batch.extras["ref_logprobs"] = _backend(model_dirs[1], trainable=False).forward_logprobs(batch)  # [B, T]
    return batch


def _copy(batch):
    return batch.select(torch.arange(batch.size))  # the extras dict is the batch's own, `prepare` writes to it


def _direct_dpo(beta: float):
    """The textbook DPO loss of a micro-batch that holds every pair, rows in order (no surrogate)."""

    def loss_fn(logits, micro, normalizer):
        mask = micro.response_mask  # [B, T]
        policy = (token_logprobs(logits, response_tokens(micro)) * mask).sum(dim=1)  # [B]
        reference = (micro.extras["ref_logprobs"] * mask).sum(dim=1)  # [B]
        ratio = policy - reference  # [B]
        margin = ratio[0::2] - ratio[1::2]  # [N] chosen minus rejected
        loss = -F.logsigmoid(beta * margin).mean()
        return loss, {"dpo/loss": float(loss.detach())}

    return loss_fn


def test_preference_surrogate_split_across_micro_batches_steps_like_the_direct_dpo_loss(model_dirs,
                                                                                        preference_batch):
    beta = 0.5
    # 1 row per micro-batch: each pair's chosen and rejected rows are in different passes.
    split = _backend(model_dirs[0], micro_batch_size=1)
    split_grads = _gradients_of_next_step(split)
    loss = PreferenceLoss("dpo", {"beta": beta, "label_smoothing": 0.0})
    batch = _copy(preference_batch)
    metrics = loss.prepare(batch, split)
    metrics.update(split.train_step(batch, loss))

    # the same weights, the whole batch in one contiguous micro-batch, the pair loss itself
    whole = _backend(model_dirs[0], micro_batch_size=len(PAIRS) * 2, trim_micro_batches=False)
    whole_grads = _gradients_of_next_step(whole)
    direct = whole.train_step(_copy(preference_batch), _direct_dpo(beta))

    _assert_close(split_grads, whole_grads, atol=1e-6)
    assert max(float(g.abs().max()) for g in whole_grads) > 1e-3  # a real gradient, not two zeros
    assert metrics["grad_norm"] == pytest.approx(direct["grad_norm"], rel=1e-5)
    assert metrics["dpo/loss"] == pytest.approx(direct["dpo/loss"], rel=1e-6)
    _assert_close(split.named_weights(), whole.named_weights(), atol=1e-6)


@pytest.mark.parametrize("options, expected", [
    # h = chosen log-ratio - rejected log-ratio per pair; the loss is the mean over the 4 pairs of:
    (["dpo.beta=0.1"], lambda h: -F.logsigmoid(0.1 * h)),
    (["dpo.beta=0.5"], lambda h: -F.logsigmoid(0.5 * h)),
    (["dpo.beta=0.5", "dpo.label_smoothing=0.2"],
     lambda h: -0.8 * F.logsigmoid(0.5 * h) - 0.2 * F.logsigmoid(-0.5 * h)),
    (["dpo.loss=cdpo", "dpo.beta=0.5", "dpo.label_smoothing=0.2"],
     lambda h: -0.8 * F.logsigmoid(0.5 * h) - 0.2 * F.logsigmoid(-0.5 * h)),
    (["dpo.loss=ipo", "dpo.beta=0.5"], lambda h: (h - 1.0) ** 2),  # target margin 1 / (2 beta) = 1
])
def test_the_config_reaches_the_preference_loss(model_dirs, preference_batch, options, expected):
    config = load_config(None, ["pipeline=dpo", "data.train.task=add2", f"model.path={model_dirs[0]}", *options])
    loss = OBJECTIVES["preference"](config)
    backend = _backend(model_dirs[0])
    batch = _copy(preference_batch)
    metrics = loss.prepare(batch, backend)

    mask = batch.response_mask  # [B, T]
    ratio = ((backend.forward_logprobs(batch) - batch.extras["ref_logprobs"]) * mask).sum(dim=1)  # [B]
    margin = ratio[0::2] - ratio[1::2]  # [N]
    assert margin.abs().min() > 1e-3  # the policy is not the reference: the options change the loss
    assert metrics["dpo/loss"] == pytest.approx(float(expected(margin).mean()), rel=1e-5)
    assert metrics["dpo/reward_margin"] == pytest.approx(config.dpo.beta * float(margin.mean()), rel=1e-5)
    assert metrics["dpo/reward_accuracy"] == float((margin > 0).float().mean())
    # the surrogate's coefficients: d mean loss / d log pi of each row, opposite within a pair
    coef = batch.extras["sequence_coef"]  # [B]
    assert torch.allclose(coef[0::2], -coef[1::2])


# ---- distillation ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def distill_batch(model_dirs):
    """SFT samples of different lengths with the teacher's top-8 log-probs."""
    encoder = ConversationEncoder(build_ascii_tokenizer())
    rows = [{"prompt": p, "response": c} for p, c, _ in PAIRS] + [{"prompt": "1+1", "response": "2"}]
    batch = collate([encoder.encode(row) for row in rows], pad_token_id=0)
    ids, logprobs = unpack_top_k(_backend(model_dirs[1], trainable=False).forward_top_k(batch, k=8))  # [B, T, 8]
    batch.extras["teacher_ids"], batch.extras["teacher_logprobs"] = ids, logprobs
    return batch


@pytest.mark.parametrize("divergence", ["forward_kl", "adaptive_kl"])
def test_distill_gradient_does_not_depend_on_the_micro_batch_size(model_dirs, distill_batch, divergence):
    loss = DistillLoss(divergence, {}, kd_weight=0.7)
    results = []
    for micro_batch_size in (1, distill_batch.size):
        backend = _backend(model_dirs[0], micro_batch_size=micro_batch_size)
        grads = _gradients_of_next_step(backend)
        metrics = backend.train_step(_copy(distill_batch), loss)
        results.append((grads, metrics))
    (one, one_metrics), (whole, whole_metrics) = results
    _assert_close(one, whole, atol=1e-6)
    assert max(float(g.abs().max()) for g in whole) > 1e-3
    for key in ("loss", "distill/kd", "distill/ce"):
        assert one_metrics[key] == pytest.approx(whole_metrics[key], rel=1e-5), key
    assert whole_metrics["distill/kd"] > 0


def test_distill_with_kd_weight_zero_is_the_nll_loss(distill_batch):
    from rollflow.algorithms import loss_normalizer

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(distill_batch.size, distill_batch.response_width, 262, generator=generator)  # [B, T, V]
    normalizer = loss_normalizer(distill_batch.response_mask)
    results = []
    for loss_fn in (DistillLoss("forward_kl", {}, kd_weight=0.0), NLLLoss("token_mean")):
        leaf = logits.clone().requires_grad_(True)
        loss, metrics = loss_fn(leaf, distill_batch, normalizer)
        loss.backward()
        results.append((loss.detach(), leaf.grad, metrics))
    (distill, distill_grad, distill_metrics), (nll, nll_grad, nll_metrics) = results
    assert torch.allclose(distill, nll, rtol=1e-6, atol=0) and torch.allclose(distill_grad, nll_grad, atol=1e-8)
    assert distill_metrics["distill/ce"] == pytest.approx(nll_metrics["sft/nll"], rel=1e-6)
    assert distill_metrics["distill/kd"] > 0  # computed and logged, just not trained on


def test_forward_top_k_with_k_equal_to_the_vocabulary_is_the_full_log_softmax(model_dirs, distill_batch):
    teacher = _backend(model_dirs[1], micro_batch_size=2, trainable=False)  # trimmed micro-batches, row join
    vocab = teacher.model.config.vocab_size
    ids, logprobs = unpack_top_k(teacher.forward_top_k(distill_batch, k=vocab + 10))  # k is capped at V
    assert ids.shape == logprobs.shape == (distill_batch.size, distill_batch.response_width, vocab)
    assert ids.dtype == torch.long
    with torch.no_grad():
        full = torch.log_softmax(model_logits(teacher.model, distill_batch), dim=-1)  # [B, T, V]
    real = distill_batch.attention_mask[:, distill_batch.prompt_length:] > 0  # [B, T]
    # every real position: a permutation of the vocabulary, most likely first, at its full log-softmax
    assert torch.equal(ids[real].sort(dim=-1).values, torch.arange(vocab).expand(int(real.sum()), vocab))
    assert (logprobs[real][:, :-1] >= logprobs[real][:, 1:]).all()
    assert torch.allclose(logprobs[real], full.gather(-1, ids)[real], atol=1e-5)
    assert torch.allclose(logprobs[real].logsumexp(dim=-1), torch.zeros(int(real.sum())), atol=1e-5)
    assert not ids[~real].any() and not logprobs[~real].any()  # 0 on padding
