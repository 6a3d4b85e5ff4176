"""MLA's generation cache: DeepSeek-V2/V3 in transformers 5.23 cache the compressed latent, not per-head K/V.

Truth: the tensors a real (tiny, CPU) DeepseekV3 forward leaves in its DynamicCache, and the hand derivation
kv_lora_rank + qk_rope_head_dim elements per token per layer (modeling_deepseek_v3.py
``past_key_values.update(kv_nope, k_rot)`` on single-head views)."""

from __future__ import annotations

import pytest

from tests.catalog.test_meta_inventory import TINY
from vramledger.analytic.evaluation import kv_cache_bytes
from vramledger.catalog.hfconfig import model_spec_from_config

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_mla_cache_equals_the_real_cache() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY["deepseek_v3"])
    m = model_spec_from_config(cfg, name="tiny-mla", source="test")
    B, P = 2, 9
    hand = 3 * B * P * (16 + 4) * 4  # layers · rows · tokens · (kv_lora_rank + qk_rope_head_dim) · fp32 bytes
    got = kv_cache_bytes(m, batch=B, prompt=P, new_tokens=1, dtype_bytes=4).at_end
    cfg.pop("model_type")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("deepseek_v3", **cfg)).eval()
    with torch.no_grad():
        out = model(torch.zeros(B, P, dtype=torch.long), use_cache=True)
    real = sum(t.numel() * t.element_size() for layer in out.past_key_values.layers for t in (layer.keys, layer.values))
    print("hand", hand, "analytic", got, "real cache", real)
    assert got == hand == real
