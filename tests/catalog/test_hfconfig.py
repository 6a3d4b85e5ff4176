"""config.json → ModelSpec: the per-family rules that transformers' configuration classes apply, written out
by hand from transformers 5.x ``configuration_<family>.py`` and checked on the catalog's configs."""

from __future__ import annotations

import pytest

from vramledger.catalog import resolve_model
from vramledger.catalog.hfconfig import model_spec_from_config

QWEN2 = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "sliding_window": 4096,
    "max_window_layers": 20,
}


def spec(cfg: dict) -> object:
    return model_spec_from_config(cfg, name="t", source="test")


@pytest.mark.parametrize(
    ("key", "window", "sliding"),
    [
        ("mistral-7b-v0.1", 4096, 32),  # sliding_window on every MistralAttention layer
        ("mistral-7b-v0.3", 0, 0),  # sliding_window: null
        ("gemma-2-9b", 4096, 21),  # Gemma2Config: even-indexed layers slide, 42 layers
        ("gemma-3-1b", 512, 22),  # Gemma3TextConfig: every 6th layer global, 26 layers -> 4 global
        ("gemma-3-4b", 1024, 29),  # 34 layers -> 5 global (i = 5, 11, 17, 23, 29)
        ("qwen2.5-7b", 0, 0),  # use_sliding_window: false drops the window (Qwen2Config.__post_init__)
        ("qwen3-8b", 0, 0),
        ("phi-3-mini-4k", 2047, 32),
    ],
)
def test_sliding_window_layers(key: str, window: int, sliding: int) -> None:
    m = resolve_model(key)
    assert (m.sliding_window, m.sliding_layers) == (window, sliding)


def test_qwen_sliding_window_starts_at_max_window_layers() -> None:
    # Qwen2Config.__post_init__: layer i slides when use_sliding_window and i >= max_window_layers.
    assert spec({**QWEN2, "use_sliding_window": True}).sliding_layers == 24 - 20
    assert spec(QWEN2).sliding_layers == 0
    # Qwen3-MoE applies the window to every layer (Qwen3MoeAttention has no max_window_layers rule).
    moe = {
        **QWEN2,
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "use_sliding_window": True,
    }
    assert spec(moe).sliding_layers == 24


def test_gemma3_multimodal_reads_text_config_with_class_defaults() -> None:
    # gemma-3-4b's text_config omits vocab_size, heads and head_dim: Gemma3TextConfig's defaults are
    # 262,208 / 8 / 4 / 256; tie_word_embeddings defaults to True.
    m = resolve_model("gemma-3-4b")
    assert (m.family, m.vocab_size, m.head_dim) == ("gemma3_text", 262208, 256)
    assert (m.num_heads, m.num_kv_heads) == (8, 4)
    assert m.tie_word_embeddings and m.qk_norm and m.norms_per_layer == 4
    assert resolve_model("gemma-3-27b").head_dim == 128


@pytest.mark.parametrize(
    ("key", "qkv_bias", "o_bias", "tied"),
    [
        ("qwen2.5-7b", True, False, False),  # Qwen2Attention: bias=True on q/k/v, False on o
        ("qwen2.5-0.5b", True, False, True),
        ("qwen3-8b", False, False, False),  # Qwen3Attention: bias=config.attention_bias
        ("llama-3.2-1b", False, False, True),
        ("gpt2", True, True, True),  # Conv1D layers all carry a bias; GPT-2 ties wte and lm_head
    ],
)
def test_biases_and_tying(key: str, qkv_bias: bool, o_bias: bool, tied: bool) -> None:
    m = resolve_model(key)
    assert (m.qkv_bias, m.o_bias, m.tie_word_embeddings) == (qkv_bias, o_bias, tied)


def test_softcapping_and_dtype() -> None:
    g2 = resolve_model("gemma-2-2b")
    assert (g2.final_logit_softcapping, g2.attn_logit_softcapping, g2.native_dtype) == (30.0, 50.0, "float32")
    g3 = resolve_model("gemma-3-1b")
    assert (g3.final_logit_softcapping, g3.attn_logit_softcapping) == (0.0, 0.0)
