"""Tiny configs of each traced family (hidden 128, 2 layers, vocab 1000) so the trace tests stay fast.

Sequence lengths in the tests (40, 48) differ from every hidden, head and vocabulary size, so that a
length x length tensor cannot be confused with another shape.
"""

from __future__ import annotations

from typing import Any

_BASE = {"vocab_size": 1000, "num_hidden_layers": 2, "max_position_embeddings": 256}

TINY = {
    "llama": {
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 352,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        **_BASE,
    },
    "llama_tied": {
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 352,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        **_BASE,
    },
    "qwen2": {
        "model_type": "qwen2",
        "hidden_size": 128,
        "intermediate_size": 320,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        **_BASE,
    },
    "qwen3": {
        "model_type": "qwen3",
        "hidden_size": 128,
        "intermediate_size": 320,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "tie_word_embeddings": True,
        **_BASE,
    },
    "mistral": {
        "model_type": "mistral",
        "hidden_size": 128,
        "intermediate_size": 352,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "sliding_window": None,
        **_BASE,
    },
    "gemma2": {
        "model_type": "gemma2",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "sliding_window": 4096,
        **_BASE,
    },
    "phi3": {
        "model_type": "phi3",
        "hidden_size": 128,
        "intermediate_size": 352,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "pad_token_id": 0,
        **_BASE,
    },
    "gpt2": {
        "model_type": "gpt2",
        "n_embd": 128,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 256,
        "vocab_size": 1000,
    },
}


def spec(name: str) -> Any:
    from vramledger.catalog.hfconfig import model_spec_from_config

    return model_spec_from_config(TINY[name], name=f"tiny-{name}", source="tests/trace/_trace_tiny.py")
