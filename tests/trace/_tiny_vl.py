"""A tiny Qwen2.5-VL (hidden 64, 2 decoder layers, a 4-block tower with two windowed and two full-attention
blocks, vocabulary 512) for the image tests: same classes as Qwen/Qwen2.5-VL-7B-Instruct, seconds to trace."""

from __future__ import annotations

from typing import Any

TINY_QWEN25_VL: dict[str, Any] = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3], "rope_theta": 1000000.0, "rope_type": "default"},
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "image_token_id": 500,
    "video_token_id": 501,
    "vision_start_token_id": 502,
    "vision_end_token_id": 503,
    "vision_token_id": 504,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "vision_config": {
        "depth": 4,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_heads": 4,
        "in_chans": 3,
        "out_hidden_size": 64,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [1, 3],
        "temporal_patch_size": 2,
        "hidden_act": "silu",
    },
}


def tiny_vl() -> Any:
    """The ModelSpec of the tiny config (built on the meta device for exact parameters)."""
    from vramledger.catalog.hfconfig import model_spec_from_config

    return model_spec_from_config(TINY_QWEN25_VL, name="tiny-qwen2.5-vl", source="tests/trace/_tiny_vl.py")
