"""The vision tower of a vision-language model: the facts that decide how many tokens an image becomes and what
the tower's own forward keeps. Read from a config.json's ``vision_config`` by ``catalog.vision_config``."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from vramledger.errors import VramledgerError


class ImageRule(str, enum.Enum):
    """How the processor turns an image into patches and LM tokens (each rule in ``analytic/vision.py``)."""

    DYNAMIC = "dynamic"
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL: ``Qwen2VLImageProcessor`` resizes to multiples of patch·merge within
    [min_pixels, max_pixels] (``smart_resize``); one token per merge² patches."""
    FIXED = "fixed"
    """Gemma 3: every image resized to ``image_size``² (pan-and-scan off), a fixed number of tokens."""
    TILES = "tiles"
    """Llama 4: tiles of ``image_size``² up to ``max_tiles``, plus a global tile when there is more than one."""


@dataclass(frozen=True, kw_only=True, slots=True)
class VisionSpec:
    """A vision tower (ViT) and its projector into the language model."""

    rule: ImageRule
    hidden_size: int
    """Width of the tower's residual stream (Qwen2.5-VL 1280, SigLIP-400M 1152)."""
    intermediate_size: int
    depth: int
    """Transformer blocks in the tower."""
    num_heads: int
    patch_size: int
    out_hidden_size: int
    """Width of the tokens handed to the language model (its hidden size)."""
    gated_mlp: bool = False
    """SwiGLU gate/up/down (Qwen2.5-VL) rather than fc1 → act → fc2 (SigLIP, Qwen2-VL, Qwen3-VL, Llama 4)."""
    fused_qkv: bool = False
    """One ``qkv`` projection whose output v is a view of (Qwen's towers): SDPA keeping v keeps all three alive;
    SigLIP and Llama 4 project q, k and v separately."""
    hidden_act: str = "gelu"
    """The MLP's activation (``quick_gelu`` x·σ(1.702x) keeps its input and the sigmoid; the GELUs keep the input)."""
    input_hooked: bool = True
    """The tower class names an input embedding (``_input_embed_layer`` / ``get_input_embeddings``: Qwen2-VL and
    Qwen2.5-VL ``patch_embed``, SigLIP and Llama 4 ``patch_embedding``), so ``enable_input_require_grads`` makes
    its output require grad; Qwen3-VL's tower names none."""
    layer_norm: bool = True
    """LayerNorm with bias (SigLIP, Llama 4, Qwen2-VL, Qwen3-VL) rather than RMSNorm (Qwen2.5-VL)."""
    merge_size: int = 1
    """Patches merged per side into one LM token (Qwen ``spatial_merge_size`` 2; Llama 4 pixel shuffle 0.5 → 2)."""
    temporal_patch_size: int = 1
    """Qwen: an image is repeated to this many frames before the 3-D patch embedding."""
    image_size: int = 0
    """FIXED/TILES: the side every image (tile) is resized to."""
    tokens_per_image: int = 0
    """FIXED: tokens per image (Gemma 3 ``mm_tokens_per_image``)."""
    min_pixels: int = 0
    """DYNAMIC: the processor's lower bound on resized pixels (``size['shortest_edge']``)."""
    max_pixels: int = 0
    """DYNAMIC: the processor's upper bound (``size['longest_edge']``); TILES: unused."""
    max_tiles: int = 0
    """TILES: the processor's ``max_patches`` (16 for Llama 4)."""
    window_patches: int = 0
    """Qwen2.5-VL windowed attention: the window's side in patches (``window_size // patch_size``); 0: every layer
    attends over the whole image."""
    full_attention_layers: int = 0
    """Qwen2.5-VL: blocks in ``fullatt_block_indexes`` (the rest attend within windows)."""
    class_token: bool = False
    """Llama 4: a class embedding prepended to each tile's patches."""
    deepstack_layers: int = 0
    """Qwen3-VL: extra patch mergers fed from these blocks (``deepstack_visual_indexes``)."""
    prefix: tuple[str, ...] = ()
    """Module path prefixes of the tower and projector (``visual.``, ``vision_tower.``, ``multi_modal_projector.``):
    adapters found there train inside the tower."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "depth", "num_heads", "patch_size", "out_hidden_size"):
            if getattr(self, name) <= 0:
                raise VramledgerError(f"vision_config: {name} must be a positive integer (got {getattr(self, name)})")
        if self.hidden_size % self.num_heads:
            raise VramledgerError(
                f"vision_config: num_heads ({self.num_heads}) must divide hidden_size ({self.hidden_size})"
            )

    def holds(self, module_path: str) -> bool:
        """Whether a module path (``model.visual.blocks.0.attn.qkv``) is inside the tower or its projector."""
        return any(part in self.prefix for part in module_path.split("."))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads
