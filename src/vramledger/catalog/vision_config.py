"""Read a config.json's ``vision_config`` into a VisionSpec, without transformers.

A published config gives only the keys that differ from transformers' config class; the defaults below are
those classes' (transformers 5.23 ``configuration_<family>.py``), and the processor bounds are the image
processors' class defaults (a checkpoint's ``preprocessor_config.json`` is a separate file vramledger does not
read; each default is named where it is used).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.specs.vision import ImageRule, VisionSpec

# qwen2_vl/image_processing_qwen2_vl.py Qwen2VLImageProcessor.size: {"shortest_edge": 56 * 56, "longest_edge":
# 28 * 28 * 1280}; Qwen2.5-VL and Qwen3-VL use the same class (models/auto/image_processing_auto.py).
QWEN_MIN_PIXELS = 56 * 56
QWEN_MAX_PIXELS = 28 * 28 * 1280
# Module paths of towers and projectors in transformers 5.23 (Qwen*VLModel.visual, Gemma3Model.vision_tower and
# multi_modal_projector, Llama4ForConditionalGeneration.vision_model and multi_modal_projector).
_PREFIXES = ("visual", "vision_tower", "vision_model", "multi_modal_projector")


def _int(v: Mapping[str, Any], key: str, default: int, where: str) -> int:
    value = v.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int):
        raise VramledgerError(f"{where}: vision_config {key!r} must be an integer (got {value!r})")
    return value


def vision_spec(cfg: Mapping[str, Any], where: str) -> VisionSpec | None:
    """The vision tower a multimodal config describes; None for a text-only config or a tower not modelled here."""
    v = cfg.get("vision_config")
    if not isinstance(v, Mapping):
        return None
    family = str(cfg.get("model_type") or "")
    if family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"):
        return _qwen(family, v, cfg, where)
    if family == "gemma3":
        return _gemma3(v, cfg, where)
    if family == "llama4":
        return _llama4(v, cfg, where)
    return None


def _qwen(family: str, v: Mapping[str, Any], cfg: Mapping[str, Any], where: str) -> VisionSpec:
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), Mapping) else cfg
    assert isinstance(text, Mapping)
    out = _int(text, "hidden_size", 3584, where)
    if family == "qwen2_vl":
        # Qwen2VLVisionConfig: embed_dim 1280 is the tower's width, hidden_size (3584) the LM's; mlp_ratio 4;
        # VisionMlp fc1 → quick_gelu → fc2 with LayerNorms (modeling_qwen2_vl.py Qwen2VLVisionBlock).
        width = _int(v, "embed_dim", 1280, where)
        return VisionSpec(
            rule=ImageRule.DYNAMIC, hidden_size=width, intermediate_size=width * _int(v, "mlp_ratio", 4, where),
            depth=_int(v, "depth", 32, where), num_heads=_int(v, "num_heads", 16, where),
            patch_size=_int(v, "patch_size", 14, where), out_hidden_size=_int(v, "hidden_size", out, where),
            merge_size=_int(v, "spatial_merge_size", 2, where), temporal_patch_size=_int(v, "temporal_patch_size", 2,
                                                                                        where),
            min_pixels=QWEN_MIN_PIXELS, max_pixels=QWEN_MAX_PIXELS, fused_qkv=True, prefix=_PREFIXES,
            hidden_act=str(v.get("hidden_act", "quick_gelu")),
        )  # fmt: skip
    if family == "qwen2_5_vl":
        # Qwen2_5_VLVisionConfig: SwiGLU Qwen2_5_VLMLP(bias=True) and RMSNorms; windowed attention except in
        # fullatt_block_indexes (modeling_qwen2_5_vl.py Qwen2_5_VisionTransformerPretrainedModel.forward).
        full = v.get("fullatt_block_indexes", [7, 15, 23, 31])
        return VisionSpec(
            rule=ImageRule.DYNAMIC, hidden_size=_int(v, "hidden_size", 3584, where),
            intermediate_size=_int(v, "intermediate_size", 3420, where), depth=_int(v, "depth", 32, where),
            num_heads=_int(v, "num_heads", 16, where), patch_size=_int(v, "patch_size", 14, where),
            out_hidden_size=_int(v, "out_hidden_size", out, where), gated_mlp=True, layer_norm=False,
            merge_size=_int(v, "spatial_merge_size", 2, where),
            temporal_patch_size=_int(v, "temporal_patch_size", 2, where), min_pixels=QWEN_MIN_PIXELS,
            max_pixels=QWEN_MAX_PIXELS, window_patches=_int(v, "window_size", 112, where) // _int(v, "patch_size", 14,
                                                                                                  where),
            full_attention_layers=len(full) if isinstance(full, list) else 0, fused_qkv=True, prefix=_PREFIXES,
        )  # fmt: skip
    # Qwen3VLVisionConfig: fc1 → gelu_pytorch_tanh → fc2, LayerNorms, full attention, deepstack mergers.
    deep = v.get("deepstack_visual_indexes", [8, 16, 24])
    return VisionSpec(
        rule=ImageRule.DYNAMIC, hidden_size=_int(v, "hidden_size", 1152, where),
        intermediate_size=_int(v, "intermediate_size", 4304, where), depth=_int(v, "depth", 27, where),
        num_heads=_int(v, "num_heads", 16, where), patch_size=_int(v, "patch_size", 16, where),
        out_hidden_size=_int(v, "out_hidden_size", out, where), merge_size=_int(v, "spatial_merge_size", 2, where),
        temporal_patch_size=_int(v, "temporal_patch_size", 2, where), min_pixels=QWEN_MIN_PIXELS,
        max_pixels=QWEN_MAX_PIXELS, deepstack_layers=len(deep) if isinstance(deep, list) else 0, fused_qkv=True,
        prefix=_PREFIXES, input_hooked=False, hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
    )  # fmt: skip


def _gemma3(v: Mapping[str, Any], cfg: Mapping[str, Any], where: str) -> VisionSpec:
    # SiglipVisionConfig defaults (configuration_siglip.py) under Gemma3Config; Gemma3MultiModalProjector average-
    # pools the patches to mm_tokens_per_image (256) tokens (modeling_gemma3.py). Gemma3ImageProcessor resizes
    # every image to image_size² (Gemma 3's preprocessor_config gives 896), pan-and-scan off by default
    # (processing_gemma3.py Gemma3Processor.images_kwargs do_pan_and_scan False).
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), Mapping) else {}
    assert isinstance(text, Mapping)
    return VisionSpec(
        rule=ImageRule.FIXED, hidden_size=_int(v, "hidden_size", 768, where),
        intermediate_size=_int(v, "intermediate_size", 3072, where), depth=_int(v, "num_hidden_layers", 12, where),
        num_heads=_int(v, "num_attention_heads", 12, where), patch_size=_int(v, "patch_size", 16, where),
        out_hidden_size=_int(text, "hidden_size", 2304, where), image_size=_int(v, "image_size", 224, where),
        tokens_per_image=_int(cfg, "mm_tokens_per_image", 256, where), prefix=_PREFIXES,
    )  # fmt: skip


def _llama4(v: Mapping[str, Any], cfg: Mapping[str, Any], where: str) -> VisionSpec:
    # Llama4VisionConfig defaults; Llama4ImageProcessor size 336 (its preprocessor_config), max_patches 16
    # (image_processing_llama4.py); Llama4VisionPixelShuffleMLP with pixel_shuffle_ratio 0.5 keeps 1 token per
    # 2×2 patches; a class embedding per tile (modeling_llama4.py Llama4VisionModel).
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), Mapping) else {}
    assert isinstance(text, Mapping)
    ratio = float(v.get("pixel_shuffle_ratio", 0.5) or 0.5)
    return VisionSpec(
        rule=ImageRule.TILES, hidden_size=_int(v, "hidden_size", 768, where),
        intermediate_size=_int(v, "intermediate_size", 5632, where), depth=_int(v, "num_hidden_layers", 34, where),
        num_heads=_int(v, "num_attention_heads", 16, where), patch_size=_int(v, "patch_size", 14, where),
        out_hidden_size=_int(text, "hidden_size", 5120, where), merge_size=round(1 / ratio),
        image_size=_int(v, "image_size", 448, where), max_tiles=16, class_token=True, prefix=_PREFIXES,
    )  # fmt: skip
