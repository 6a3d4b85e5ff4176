"""Tiny Qwen2.5-VL, Qwen2-VL and Qwen3-VL configs for the image tests (hidden 64, 2-3 decoder layers, 4-block towers;
Qwen2.5-VL's with two windowed and two full-attention blocks; vocabulary 512): the classes of the published
checkpoints, seconds to trace."""

from __future__ import annotations

from typing import Any

_TOKENS = {"image_token_id": 500, "video_token_id": 501, "vision_start_token_id": 502, "vision_end_token_id": 503}
# The language model of the Qwen2-VL and Qwen2.5-VL configs (their text keys sit at the top level).
_TEXT: dict[str, Any] = {
    "torch_dtype": "bfloat16",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    "tie_word_embeddings": False,
    **_TOKENS,
}

TINY_QWEN25_VL: dict[str, Any] = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    **_TEXT,
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

TINY_QWEN2_VL: dict[str, Any] = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "model_type": "qwen2_vl",
    **_TEXT,
    # Qwen2VLVisionConfig: embed_dim is the tower's width, hidden_size the language model's; quick_gelu MLP.
    "vision_config": {"depth": 4, "embed_dim": 64, "hidden_size": 64, "mlp_ratio": 2, "num_heads": 4,
                      "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
}  # fmt: skip

TINY_QWEN3_VL: dict[str, Any] = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "model_type": "qwen3_vl",
    "torch_dtype": "bfloat16",
    **_TOKENS,
    # 3 decoder layers, 2 deepstack mergers, 4 blocks: no two module lists of one length (catalog/inventory.py
    # finds the decoder layers by their count), and every deepstack feature reaches a decoder layer.
    "text_config": {"model_type": "qwen3_vl_text", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                    "max_position_embeddings": 4096, "tie_word_embeddings": False,
                    "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}},
    "vision_config": {"depth": 4, "hidden_size": 64, "intermediate_size": 96, "num_heads": 4, "out_hidden_size": 64,
                      "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "num_position_embeddings": 144, "deepstack_visual_indexes": [1, 3]},
}  # fmt: skip


def tiny_vl(config: dict[str, Any] | None = None) -> Any:
    """The ModelSpec of a tiny config (built on the meta device for exact parameters), Qwen2.5-VL by default."""
    from vramledger.catalog.hfconfig import model_spec_from_config

    cfg = TINY_QWEN25_VL if config is None else config
    return model_spec_from_config(cfg, name=f"tiny-{cfg['model_type']}", source="tests/trace/_tiny_vl.py")
