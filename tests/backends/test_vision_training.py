"""Training a vision-language model: the vision tower trains or stays frozen (and out of weight syncs) as
configured, LoRA adapts the language model only, a checkpoint keeps the image processor, and a critic of a
VLM is refused."""

import pytest
import torch

from rollflow.backends.base import TrainerSettings
from rollflow.backends.torch_backend import TorchBackend
from rollflow.config import AlgorithmConfig
from rollflow.data.prompts import PromptEncoder
from rollflow.data.sample import Sample, collate
from rollflow.data.vision import load_vision_processor
from rollflow.data.visual_tasks import count_shapes_splits
from rollflow.errors import ConfigError
from rollflow.models import is_vision_weight, load_tokenizer
from rollflow.workers.actor_loss import ActorLoss


def _batch(model_dir):
    tokenizer = load_tokenizer(model_dir)
    encoder = PromptEncoder(tokenizer, processor=load_vision_processor(model_dir, tokenizer))
    rows = count_shapes_splits()[0][:4]
    samples = []
    for index, row in enumerate(rows):
        prompt = encoder.encode(row)
        answer = tokenizer.encode(row["answer"], add_special_tokens=False)
        samples.append(Sample(prompt.token_ids, answer + [tokenizer.eos_token_id], [-1.0, -1.0], [1, 1],
                              group_id=index // 2, reward=float(index % 2), vision=prompt.vision))
    batch = collate(samples, pad_token_id=tokenizer.pad_token_id)
    batch.extras["advantages"] = (batch.rewards - 0.5).unsqueeze(1) * batch.response_mask
    return batch


def _step(model_dir, **settings):
    torch.manual_seed(0)
    backend = TorchBackend(TrainerSettings(model_dir, lr=1e-2, micro_batch_size=4, **settings))
    before = {name: p.detach().clone() for name, p in backend.model.named_parameters()}
    backend.train_step(_batch(model_dir), ActorLoss(AlgorithmConfig(), temperature=1.0))
    changed = {name for name, p in backend.model.named_parameters() if not torch.equal(before[name], p.detach())}
    return backend, changed


def test_the_vision_tower_trains_and_syncs_unless_frozen(vl_model_dir):
    trained, changed = _step(vl_model_dir)
    vision = {name for name in changed if is_vision_weight(name)}
    assert vision and changed - vision  # both the tower and the language model moved
    assert vision <= set(trained.named_weights())  # and a sync carries the tower's new weights
    frozen, changed = _step(vl_model_dir, freeze_vision_tower=True)
    assert changed and not any(is_vision_weight(name) for name in changed)
    synced = frozen.named_weights()
    assert not any(is_vision_weight(name) for name in synced)
    assert set(synced) == {name for name in trained.named_weights() if not is_vision_weight(name)}


def test_lora_adapts_the_language_model_and_trains_the_tower_in_full_unless_frozen(vl_model_dir):
    lora = {"rank": 4, "alpha": 8.0}
    backend, changed = _step(vl_model_dir, lora=lora)
    adapters = [name for name, _ in backend.model.named_parameters() if "lora_" in name]
    assert adapters and not any(is_vision_weight(name) for name in adapters)
    assert any(is_vision_weight(name) for name in changed)  # the tower in full
    assert not any("lora_" not in name and not is_vision_weight(name) for name in changed)  # the LM: adapters
    synced = backend.named_weights()  # merged, under the plain model's names, with the tower
    assert not any("lora_" in name for name in synced) and any(is_vision_weight(name) for name in synced)
    _, frozen_changed = _step(vl_model_dir, lora=lora, freeze_vision_tower=True)
    assert frozen_changed and all("lora_" in name for name in frozen_changed)


def test_a_vlm_checkpoint_keeps_its_image_processor(vl_model_dir, tmp_path):
    backend, _ = _step(vl_model_dir)
    backend.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "preprocessor_config.json").is_file()
    tokenizer = load_tokenizer(str(tmp_path / "ckpt"))
    processor = load_vision_processor(str(tmp_path / "ckpt"), tokenizer)
    assert processor.merge_size == 2
    restored = TorchBackend(TrainerSettings(str(tmp_path / "ckpt"), trainable=False))
    weights = restored.named_weights()
    assert all(torch.equal(weights[name], tensor) for name, tensor in backend.named_weights().items())


def test_a_critic_of_a_vlm_is_refused(vl_model_dir):
    with pytest.raises(ConfigError, match="value model .* of a vision-language model is not supported"):
        TorchBackend(TrainerSettings(vl_model_dir, value_head=True))
