"""LoRA in the torch backend: adapters-only training, the adapters-off reference, merged weights, save/load.
On CPU (the tests compare with CPU tensors); LoRA on a GPU: tests/test_cuda.py."""

import json

import pytest
import torch
from pydantic import ValidationError

from rollflow.backends.base import TrainerSettings
from rollflow.backends.logprobs import model_logits
from rollflow.backends.torch_backend import TorchBackend
from rollflow.config import AlgorithmConfig
from rollflow.models import load_causal_lm
from rollflow.workers.actor_loss import ActorLoss
from tests.conftest import policy_batch

LORA = {"rank": 4, "alpha": 8.0}


def _loss():
    return ActorLoss(AlgorithmConfig(), temperature=1.0)


def _trained(model_dir, lora=LORA, steps=1, **kwargs):
    """A LoRA backend after `steps` optimizer steps (LoRA's B starts at 0: one step makes the adapters act)."""
    torch.manual_seed(0)
    backend = TorchBackend(TrainerSettings(model_dir, device="cpu", lr=1e-2, micro_batch_size=8, lora=lora, **kwargs))
    for _ in range(steps):
        backend.train_step(policy_batch(), _loss())
    return backend


def _logits(model, batch):
    with torch.no_grad():
        return model_logits(model.eval(), batch)  # [B, T, V]


def _plain_model_with(model_dir, weights):
    """A plain HF model (no PEFT) that loaded `weights` the way the hf engine does: copy into parameters."""
    model = load_causal_lm(model_dir)
    params = dict(model.named_parameters())
    assert set(weights) == set(params)
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)
    return model


def test_only_adapters_train_and_the_base_weights_stay_frozen(random_model_dir):
    base = dict(load_causal_lm(random_model_dir).named_parameters())
    backend = _trained(random_model_dir)
    trainable = {name for name, p in backend.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    optimized = {id(p) for group in backend.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for name, p in backend.model.named_parameters() if name in trainable}
    # 2 layers x 7 linear layers (q k v o gate up down), A and B each; lm_head is not targeted by all-linear
    assert len(trainable) == 2 * 7 * 2
    frozen = {name.replace("base_model.model.", "").replace(".base_layer", ""): p
              for name, p in backend.model.named_parameters() if name not in trainable}
    assert set(frozen) == set(base)
    assert all(torch.equal(frozen[name], base[name]) for name in base)
    assert any(p.abs().max() > 0 for name, p in backend.model.named_parameters() if ".lora_B." in name)


def test_target_modules_list_puts_adapters_only_there(random_model_dir):
    lora = {"rank": 2, "target_modules": ["q_proj", "v_proj"]}
    backend = TorchBackend(TrainerSettings(random_model_dir, device="cpu", lora=lora))
    adapted = {name.split(".lora_")[0].rsplit(".", 1)[1]
               for name, p in backend.model.named_parameters() if p.requires_grad}
    assert adapted == {"q_proj", "v_proj"}


def test_misspelled_lora_setting_is_an_error_naming_it(random_model_dir):
    with pytest.raises(ValidationError, match="rnak"):
        TorchBackend(TrainerSettings(random_model_dir, device="cpu", lora={"rnak": 4}))
    with pytest.raises(ValueError, match="lora needs a trainable causal LM"):
        TorchBackend(TrainerSettings(random_model_dir, device="cpu", lora=LORA, value_head=True))


def test_merged_weight_is_w_plus_scale_b_a(random_model_dir):
    """Reference computation for one layer: W + (alpha / rank) * B @ A."""
    backend = _trained(random_model_dir)
    layer = backend.model.base_model.model.model.layers[1].self_attn.q_proj
    expected = layer.base_layer.weight + (8.0 / 4) * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    merged = backend.named_weights()["model.layers.1.self_attn.q_proj.weight"]
    assert torch.allclose(merged, expected, atol=1e-7)
    assert not torch.allclose(merged, layer.base_layer.weight, atol=1e-4)  # the adapters did move it


def test_named_weights_are_the_plain_models_names_and_give_the_peft_logits(random_model_dir):
    backend = _trained(random_model_dir)
    batch = policy_batch()
    before = _logits(backend.model, batch)
    weights = backend.named_weights()
    plain = load_causal_lm(random_model_dir)
    assert {n: p.shape for n, p in plain.named_parameters()} == {n: t.shape for n, t in weights.items()}
    merged_logits = _logits(_plain_model_with(random_model_dir, weights), batch)
    assert torch.allclose(merged_logits, before, atol=1e-5)
    assert not torch.allclose(_logits(plain, batch), before, atol=1e-3)  # the adapters matter
    # exporting did not touch the trained model: same logits, bit for bit, and the same export again
    assert torch.equal(_logits(backend.model, batch), before)
    again = backend.named_weights()
    assert all(torch.equal(weights[n], again[n]) for n in weights)


def test_reference_logprobs_are_the_base_models(random_model_dir):
    backend = _trained(random_model_dir, steps=2)
    batch = policy_batch()
    base = TorchBackend(TrainerSettings(random_model_dir, device="cpu", trainable=False, micro_batch_size=8))
    expected = base.forward_logprobs(batch, temperature=0.7)  # [B, T]
    reference = backend.forward_reference_logprobs(batch, temperature=0.7)
    assert torch.allclose(reference, expected, atol=1e-6)
    policy = backend.forward_logprobs(batch, temperature=0.7)
    assert (policy - expected).abs().max() > 1e-3  # the adapters are back on after the context
    with pytest.raises(RuntimeError, match="needs lora"):
        base.forward_reference_logprobs(batch)


def test_worker_reference_logprobs_use_the_backends_adapters_off_model(random_model_dir):
    from rollflow.cluster.placement import WorkerPlacement
    from rollflow.config import load_config
    from rollflow.workers.actor_train import ActorTrainWorker
    from rollflow.workers.specs import trainer_spec

    config = load_config(None, [f"model.path={random_model_dir}", "rollout.temperature=0.7"])
    worker = ActorTrainWorker(WorkerPlacement("actor_train", 0, (), None, (), threads=1),
                             trainer_spec(config, "actor_train"))
    worker.backend = _trained(random_model_dir)  # instead of init_backend: this LoRA backend
    frozen = TorchBackend(TrainerSettings(random_model_dir, device="cpu", trainable=False))
    expected = frozen.forward_logprobs(policy_batch(), temperature=0.7)
    assert torch.allclose(worker.compute_reference_logprobs(policy_batch()), expected, atol=1e-6)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_save_writes_peft_adapters_and_a_merged_hf_model(random_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    backend = _trained(random_model_dir)
    batch = policy_batch()
    expected = _logits(backend.model, batch)
    backend.save(tmp_path / "ckpt")
    for name in ("adapter_config.json", "adapter_model.safetensors", "trainer_state.pt",
                 "merged/config.json", "merged/model.safetensors", "merged/tokenizer.json"):
        assert (tmp_path / "ckpt" / name).is_file(), name
    assert json.loads((tmp_path / "ckpt" / "adapter_config.json").read_text())["r"] == 4
    assert json.loads((tmp_path / "ckpt" / "rollflow_checkpoint.json").read_text())["lora"] is True
    with_peft = PeftModel.from_pretrained(load_causal_lm(random_model_dir), tmp_path / "ckpt")
    assert torch.allclose(_logits(with_peft, batch), expected, atol=1e-6)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "merged")
    assert torch.allclose(_logits(merged, batch), expected, atol=1e-5)


def test_save_load_then_step_equals_an_uninterrupted_step(random_model_dir, tmp_path):
    """Adapters, optimizer moments, scheduler and RNG (LoRA dropout draws from it) all come back."""
    lora = {**LORA, "dropout": 0.1}
    backend = _trained(random_model_dir, lora=lora, steps=2, warmup_steps=4)
    backend.save(tmp_path / "ckpt")
    rng_at_save = torch.get_rng_state()  # one process holds both runs: each must draw from this state
    restored = TorchBackend(TrainerSettings(random_model_dir, device="cpu", lr=1e-2, micro_batch_size=8, lora=lora,
                                            warmup_steps=4))
    torch.manual_seed(123)
    restored.load(tmp_path / "ckpt")
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    assert restored.scheduler.get_last_lr() == backend.scheduler.get_last_lr()
    restored.train_step(policy_batch(), _loss())
    torch.set_rng_state(rng_at_save)
    backend.train_step(policy_batch(), _loss())
    a, b = dict(backend.model.named_parameters()), dict(restored.model.named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a)
    fresh = TorchBackend(TrainerSettings(random_model_dir, device="cpu", lr=1e-2, micro_batch_size=8, lora=lora,
                                         warmup_steps=4))
    fresh.train_step(policy_batch(), _loss())  # without load: different adapters, so the check above has teeth
    c = dict(fresh.model.named_parameters())
    assert not all(torch.equal(a[n], c[n]) for n in a)


def test_load_rejects_adapters_of_another_shape(random_model_dir, tmp_path):
    _trained(random_model_dir).save(tmp_path / "ckpt")
    other = TorchBackend(TrainerSettings(random_model_dir, device="cpu", lora={"rank": 4, "target_modules": ["q_proj"]}))
    with pytest.raises(ValueError, match="does not match"):
        other.load(tmp_path / "ckpt")
