"""Model path resolution: bundled names, HF directories, LoRA checkpoints, hub ids, clear errors."""

import types

import pytest

from rollflow.errors import ModelLoadError
from rollflow.models import resolve_model_path


def test_lora_checkpoint_resolves_to_its_merged_model(tmp_path):
    (tmp_path / "merged").mkdir()
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "merged" / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path / "merged")
    (tmp_path / "config.json").write_text("{}")  # adapters beside a full model: still the merged one
    assert resolve_model_path(str(tmp_path)) == str(tmp_path / "merged")


def test_directory_without_config_and_missing_path_fail_clearly(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))
    assert resolve_model_path("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert resolve_model_path("tiny").endswith("tiny-qwen2-add")


# ---- cpu_attention ---------------------------------------------------------------------------------------


def _sdpa(query, key, value, mask, causal=False):
    """torch's sdpa on grouped heads, [B, Q, H, D] like the attention interface."""
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal, scale=0.3,
                                          enable_gqa=True).transpose(1, 2)


def _qkv(batch, queries, length, seed=0):
    import torch

    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 4, queries, 8, generator=generator),  # 4 query heads on 2 KV heads
            torch.randn(batch, 2, length, 8, generator=generator), torch.randn(batch, 2, length, 8, generator=generator))


def test_cpu_attention_equals_sdpa_for_one_query_token_with_padding():
    import torch

    from rollflow.models import cpu_attention

    query, key, value = _qkv(3, 1, 5)
    mask = torch.ones(3, 1, 1, 5, dtype=torch.bool)
    mask[1, ..., :2] = False  # row 1 is left-padded by two positions
    module = types.SimpleNamespace(is_causal=True)
    for attention_mask in (mask, None):
        output, weights = cpu_attention(module, query, key, value, attention_mask, scaling=0.3)
        assert weights is None and output.shape == (3, 1, 4, 8)  # [B, 1, H, D]
        assert torch.allclose(output, _sdpa(query, key, value, attention_mask), atol=1e-6)


def test_cpu_attention_equals_sdpa_on_short_padded_rows_and_their_gradients():
    """A training or prefill pass over short left-padded rows: every real query's output and every gradient
    as sdpa's; a padding query, which has no key to attend, stays finite (a NaN would reach the gradients)."""
    import torch

    from rollflow.models import cpu_attention

    length = 6
    real = torch.ones(3, length, dtype=torch.bool)
    real[1, :2] = False  # left padding
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool))
    mask = (causal & real[:, None, :])[:, None]  # [B, 1, Q, L]: row 1's first two queries see nothing
    module = types.SimpleNamespace(is_causal=True)
    results = []
    for attend in (cpu_attention, None):
        query, key, value = (t.requires_grad_() for t in _qkv(3, length, length, seed=1))
        if attend is None:  # sdpa only on the queries that can attend something
            output = _sdpa(query, key, value, mask | ~mask.any(-1, keepdim=True))
        else:
            output, _ = attend(module, query, key, value, mask, scaling=0.3)
            assert torch.isfinite(output).all()
        (output * real[:, :, None, None]).square().sum().backward()  # the loss ignores padding queries
        results.append((output * real[:, :, None, None], query.grad, key.grad, value.grad))
    for ours, theirs in zip(*results):
        assert torch.allclose(ours, theirs, atol=1e-5)


def test_cpu_attention_without_a_mask_is_causal_with_the_queries_last():
    import torch

    from rollflow.models import cpu_attention

    query, key, value = _qkv(2, 4, 4)
    module = types.SimpleNamespace(is_causal=True)
    output, _ = cpu_attention(module, query, key, value, None, scaling=0.3)
    assert torch.allclose(output, _sdpa(query, key, value, None, causal=True), atol=1e-6)
    # 2 new queries after 3 cached positions: query i sees keys 0 .. 3 + i
    query, key, value = _qkv(2, 2, 5)
    output, _ = cpu_attention(module, query, key, value, None, scaling=0.3)
    allowed = torch.arange(5)[None, :] <= torch.arange(3, 5)[:, None]
    assert torch.allclose(output, _sdpa(query, key, value, allowed), atol=1e-6)


def test_cpu_attention_leaves_long_rows_to_sdpa(monkeypatch):
    from rollflow import models

    calls = []
    monkeypatch.setattr("transformers.integrations.sdpa_attention.sdpa_attention_forward",
                        lambda *args, **kwargs: calls.append(args[1].shape) or ("sdpa", None))
    module = types.SimpleNamespace(is_causal=True)
    query, key, value = _qkv(1, models.SHORT_KEYS + 1, models.SHORT_KEYS + 1)
    assert models.cpu_attention(module, query, key, value, None)[0] == "sdpa"
    query, key, value = _qkv(1, models.SHORT_KEYS, models.SHORT_KEYS)
    assert models.cpu_attention(module, query, key, value, None)[0] != "sdpa"
    assert len(calls) == 1


def test_a_model_on_cpu_attention_gives_sdpa_s_logits_and_gradients():
    import torch

    from rollflow.models import CPU_ATTENTION, load_causal_lm, use_cpu_attention

    models = [load_causal_lm("tiny").train(), load_causal_lm("tiny").train()]
    use_cpu_attention(models[1])
    assert models[1].config._attn_implementation == CPU_ATTENTION
    input_ids = torch.tensor([[0, 0, 5, 20, 21, 8], [5, 20, 21, 8, 22, 23]])
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    logits = []
    for model in models:
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        (out.logsumexp(-1) * attention_mask).sum().backward()
        logits.append(out * attention_mask[..., None])
    assert torch.allclose(logits[0], logits[1], atol=1e-5)
    for ours, theirs in zip(models[1].parameters(), models[0].parameters()):
        assert torch.allclose(ours.grad, theirs.grad, atol=1e-5)
