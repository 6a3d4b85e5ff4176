"""How many patches and language-model tokens an image becomes: the processors' own rules, ported.

Rules (transformers 5.23):
- Qwen2-VL / Qwen2.5-VL / Qwen3-VL: ``qwen2_vl/image_processing_qwen2_vl.py`` ``smart_resize`` rounds height and
  width to multiples of patch·merge (28; 32 for Qwen3-VL's 16-pixel patches) within [min_pixels, max_pixels]
  (class defaults 56² and 28²·1280); ``patchify`` gives (h/patch)·(w/patch) patches, and
  ``processing_qwen2_5_vl.py`` one ``<|image_pad|>`` per merge² patches: tokens = (h/28)·(w/28).
- Gemma 3: ``Gemma3ImageProcessor`` resizes every image to image_size² (896), pan-and-scan off by default
  (``processing_gemma3.py`` ``images_kwargs``); ``Gemma3Processor`` expands each image to ``image_seq_length``
  (``mm_tokens_per_image``, 256) tokens; the tower sees (896/14)² = 4096 patches.
- Llama 4: ``image_processing_llama4.py`` picks a canvas of 336-pixel tiles (``find_supported_resolutions``,
  ``get_best_fit``, at most ``max_patches`` 16 tiles), and ``processing_llama4.py`` ``_prompt_split_image`` gives
  (336/14)²/4 = 144 ``<|patch|>`` tokens per tile, plus a global tile's 144 when there is more than one tile.
LLaMA-Factory first scales an image larger than ``image_max_pixels`` (default 768²) down, or one smaller than
``image_min_pixels`` up (``data/mm_plugin.py`` ``BasePlugin._preprocess_image``: factor √(limit/(w·h)), sizes
truncated to integers), then hands it to the processor. Wrapper tokens (``<|vision_start|>``, Gemma's
``<start_of_image>``, Llama 4's tile separators) are text: count them in ``--seq``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vramledger.errors import VramledgerError
from vramledger.specs import TrainSpec
from vramledger.specs.vision import ImageRule, VisionSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class ImageGrid:
    """One image as the tower and the language model see it."""

    width: int
    height: int
    """Pixels after every resize (the processor's canvas)."""
    patches: int
    """Tower positions (Llama 4: over all tiles, each with its class token)."""
    tokens: int
    """``<image>`` placeholder tokens in the language model's sequence."""
    grid: tuple[int, int, int] = (1, 1, 1)
    """Qwen ``image_grid_thw``: (frames, height, width) in patches; Llama 4: (tiles, rows, columns)."""


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers ``qwen2_vl/image_processing_qwen2_vl.py`` ``smart_resize`` (same arithmetic, same rounding).

    >>> smart_resize(768, 1024, 28, 56 * 56, 28 * 28 * 1280)
    (756, 1036)
    """
    if max(height, width) / min(height, width) > 200:
        raise VramledgerError(f"--image-size: aspect ratio above 200 ({width}x{height}); the Qwen processor refuses it")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _llama4_canvas(height: int, width: int, tile: int, max_tiles: int) -> tuple[int, int]:
    """``image_processing_llama4.py`` ``find_supported_resolutions`` + ``get_best_fit``: the (rows, columns) of
    tiles: the smallest upscale ≥ 1 of any arrangement of at most ``max_tiles`` tiles, else the mildest
    downscale; ties go to the smaller canvas."""
    shapes = {(f, n // f) for n in range(1, max_tiles + 1) for f in range(1, n + 1) if n % f == 0}
    scales = {s: min(s[0] * tile / height, s[1] * tile / width) for s in shapes}
    up = [v for v in scales.values() if v >= 1]
    chosen = min(up) if up else max(scales.values())
    return min((s for s, v in scales.items() if v == chosen), key=lambda s: s[0] * s[1])


def default_image_size(v: VisionSpec) -> tuple[int, int]:
    """(width, height) when none is given: Gemma 3 / Llama 4 their (tile) resolution; Qwen a square as large as
    its processor keeps (√max_pixels: 1001² → 980² after ``smart_resize``, 1225 tokens)."""
    if v.rule is ImageRule.DYNAMIC:
        side = math.isqrt(v.max_pixels)
        return side, side
    return v.image_size, v.image_size


def prepared_size(v: VisionSpec, train: TrainSpec) -> tuple[int, int]:
    """(width, height) handed to the processor: the given or default size after LLaMA-Factory's resize."""
    w, h = train.image_size or default_image_size(v)
    hi, lo = train.image_max_pixels, train.image_min_pixels
    if hi is not None and w * h > hi:
        f = math.sqrt(hi / (w * h))
        w, h = int(w * f), int(h * f)
    if lo is not None and w * h < lo:
        f = math.sqrt(lo / (w * h))
        w, h = int(w * f), int(h * f)
    return max(w, 1), max(h, 1)


def image_grid(v: VisionSpec, train: TrainSpec) -> ImageGrid:
    """Patches and tokens of one image of ``train``'s size under ``v``'s processor."""
    w, h = prepared_size(v, train)
    if v.rule is ImageRule.DYNAMIC:
        factor = v.patch_size * v.merge_size
        rh, rw = smart_resize(h, w, factor, v.min_pixels, v.max_pixels)
        gh, gw = rh // v.patch_size, rw // v.patch_size
        return ImageGrid(width=rw, height=rh, patches=gh * gw, tokens=gh * gw // v.merge_size**2, grid=(1, gh, gw))
    per_side = v.image_size // v.patch_size
    if v.rule is ImageRule.FIXED:
        return ImageGrid(width=v.image_size, height=v.image_size, patches=per_side**2, tokens=v.tokens_per_image)
    rows, cols = _llama4_canvas(h, w, v.image_size, v.max_tiles)
    tiles = rows * cols + (1 if rows * cols > 1 else 0)  # the global tile (a resized copy) when tiled
    per_tile = per_side**2 // v.merge_size**2
    return ImageGrid(width=cols * v.image_size, height=rows * v.image_size, patches=tiles * (per_side**2 + 1),
                     tokens=tiles * per_tile, grid=(tiles, rows, cols))  # fmt: skip
