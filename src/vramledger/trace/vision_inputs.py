"""Images in a traced step: fake ``pixel_values`` and ``image_grid_thw`` of the processor's shapes, the image
placeholders in ``input_ids``, and what lets the real vision code run on fake tensors.

The batch is what ``Qwen2VLImageProcessor`` and the processor give a collator (``patchify``: one row of
3·temporal·patch² fp32 values per patch; ``image_grid_thw`` (1, h/patch, w/patch) per image; ``<|image_pad|>``
tokens, one per merge² patches, and ``mm_token_type_ids`` marking them), with the geometry of
``analytic/image_tokens.py`` ``image_grid`` (the one home of the processors' rules). Gemma 3 and Llama 4 get their
processors' batches too (``_fixed_inputs``, ``_tile_inputs``): fp32 pixel images or tiles and the image tokens.

Fake tensors carry shapes, not values, and the vision code asks for values: ``grid_thw.tolist()``
(``vision_utils.py`` ``get_vision_position_ids``, ``get_vision_window_index``), the window lengths
(``Qwen2_5_VLVisionAttention.forward`` splits q/k/v per window with ``lengths.tolist()``), the number of image
tokens (``get_placeholder_mask``) and the 3-D rope positions (``get_rope_index``). PyTorch's fake mode keeps the
value of a small tensor made from data (a *constant*: ``torch._subclasses.fake_tensor`` ``CONSTANT_NUMEL_LIMIT``,
1 element by default) and runs ops whose inputs are all constants for real. ``vision_trace`` raises that limit
while the step runs, so that input_ids, the grid and the window boundaries are constants and every value derived
from them alone is known; the window index and boundaries, which transformers computes with a boolean mask, are
computed beforehand from real tensors and handed to the tower as the precomputed inputs its helpers accept
(``get_vision_window_index(..., kwargs)`` pops ``window_index``/``cu_window_seqlens``); ``get_rope_index`` runs on
the constants' real values (``_on_real_values``). Activations stay fake; a run on real tensors records the same
events (tests/trace/test_vision_trace_real.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vramledger.analytic.image_tokens import ImageGrid, image_grid
from vramledger.errors import VramledgerError
from vramledger.specs import Loss, ModelSpec, TrainSpec
from vramledger.specs.vision import ImageRule, VisionSpec

# Large enough for input_ids, the 3-D positions (3·B·L) and the window tables of any traced batch.
_CONSTANT_LIMIT = 1 << 26


def check_traceable(model: ModelSpec, train: TrainSpec) -> None:
    """Refuse, before any model is built, images the traced step cannot feed (the chunked loss runs the decoder
    alone)."""
    if train.images and train.loss in (Loss.CHUNKED, Loss.CHUNKED_NLL):
        raise VramledgerError(
            f"trace --images with --loss {train.loss.value}: the chunked loss runs the decoder alone (trace/step.py "
            "chunked_loss, trace/trl_loss.py), without the vision tower; use --loss standard, or `vramledger estimate`"
        )


def _config(hf: Any) -> Any:
    return _base(hf).config


def _vision(hf: Any, train: TrainSpec) -> tuple[VisionSpec, ImageGrid] | None:
    if not train.images:
        return None
    from vramledger.catalog.vision_config import vision_spec

    cfg = _config(hf)
    v = vision_spec(cfg.to_dict(), "trace")
    if v is None:
        raise VramledgerError(
            f"trace --images: {cfg.model_type} has no vision tower vramledger feeds (Qwen2/2.5/3-VL, Gemma 3, "
            "Llama 4); drop --images"
        )
    return v, image_grid(v, train)


def tower_exclusion(hf: Any, train: TrainSpec) -> str | None:
    """PEFT ``exclude_modules`` (a regex matched against full module paths) keeping adapters out of the vision
    tower and projector, as LLaMA-Factory does with ``freeze_vision_tower`` (``model/model_utils/visual.py``
    ``patch_target_modules``); None when the tower is not frozen or the model has none."""
    if not train.freeze_vision_tower:
        return None
    from vramledger.catalog.vision_config import vision_spec

    cfg = _config(hf)
    v = vision_spec(cfg.to_dict(), "trace")
    if v is None:
        return None
    return r"(.*\.)?(" + "|".join(v.prefix) + r")(\..*)?"


def _base(hf: Any) -> Any:
    return hf.get_base_model() if hasattr(hf, "get_base_model") else hf


def _visual(hf: Any) -> Any:
    return _base(hf).model.visual


def image_inputs(hf: Any, train: TrainSpec, input_ids: Any) -> dict[str, Any]:
    """The image part of the batch, and ``input_ids`` rebuilt with the placeholders (a constant: see the module
    docstring); empty without images. Call inside ``vision_trace``."""
    found = _vision(hf, train)
    if found is None:
        return {}
    import torch

    v, grid = found
    if v.rule is ImageRule.FIXED:
        return _fixed_inputs(_config(hf), v, train, input_ids)
    if v.rule is ImageRule.TILES:
        return _tile_inputs(_config(hf), v, grid, train, input_ids)
    b, length = input_ids.shape
    n = train.images * grid.tokens
    token = int(_config(hf).image_token_id)
    # Each row: the images' placeholders first, then text (their position does not change any tensor's size).
    row = [token] * n + [0] * (length - n)
    per_patch = 3 * v.temporal_patch_size * v.patch_size**2
    # processing_utils.py ProcessorMixin.create_mm_token_type_ids (the Qwen-VL processors return it): 1 marks an
    # image token; Qwen2-VL and Qwen3-VL need it for their 3-D rope positions.
    types = [1] * n + [0] * (length - n)
    return {
        "input_ids": torch.tensor([row] * b, dtype=torch.long),
        "mm_token_type_ids": torch.tensor([types] * b, dtype=torch.long),
        "pixel_values": torch.zeros((b * train.images * grid.patches, per_patch), dtype=torch.float32),
        "image_grid_thw": torch.tensor([list(grid.grid)] * (b * train.images), dtype=torch.long),
    }


def _fixed_inputs(cfg: Any, v: VisionSpec, train: TrainSpec, input_ids: Any) -> dict[str, Any]:
    """Gemma 3's batch: ``Gemma3ImageProcessor`` output, fp32 ``(images, 3, side, side)`` (every image resized to
    ``image_size``², rescaled and normalised in float32: ``image_processing_gemma3.py`` ``_preprocess``);
    ``Gemma3Processor.__init__`` expands each image to ``full_image_sequence``: two newlines, boi,
    ``image_seq_length`` image tokens, eoi, two newlines (the wrappers are text, counted in ``--seq``; boi and eoi
    are placed here when the text has room); ``token_type_ids`` 1 on the image tokens, as the processor and
    LLaMA-Factory's ``_get_gemma3_token_type_ids`` give it, which makes ``Gemma3Model.forward`` build the
    bidirectional image-block mask (``create_masks_for_vision_model``)."""
    import torch

    b, length = input_ids.shape
    image, boi, eoi = int(cfg.image_token_id), int(cfg.boi_token_id), int(cfg.eoi_token_id)
    wrap = length - train.images * v.tokens_per_image >= 2 * train.images
    one = ([boi] if wrap else []) + [image] * v.tokens_per_image + ([eoi] if wrap else [])
    row = one * train.images
    row += [0] * (length - len(row))
    types = [1 if t == image else 0 for t in row]
    return {
        "input_ids": torch.tensor([row] * b, dtype=torch.long),
        "token_type_ids": torch.tensor([types] * b, dtype=torch.long),
        "pixel_values": torch.zeros((b * train.images, 3, v.image_size, v.image_size), dtype=torch.float32),
    }


def _tile_inputs(cfg: Any, v: VisionSpec, grid: ImageGrid, train: TrainSpec, input_ids: Any) -> dict[str, Any]:
    """Llama 4's batch: ``Llama4ImageProcessor`` tiles each image into ``grid.grid[0]`` tiles of side² fp32 pixels
    (the global tile included), stacked as ``(tiles, 3, side, side)``; ``Llama4Processor._prompt_split_image``
    writes (side/patch)²/shuffle² ``<|patch|>`` tokens per tile (``image_token_index``) between tile separators
    and image start/end tokens, which are text (counted in ``--seq``)."""
    import torch

    b, length = input_ids.shape
    n = train.images * grid.tokens
    row = [int(cfg.image_token_index)] * n + [0] * (length - n)
    tiles = b * train.images * grid.grid[0]
    return {
        "input_ids": torch.tensor([row] * b, dtype=torch.long),
        "pixel_values": torch.zeros((tiles, 3, v.image_size, v.image_size), dtype=torch.float32),
    }


def _window_tables(hf: Any, v: VisionSpec, grid: ImageGrid, images: int) -> dict[str, Any]:
    """``window_index`` and ``cu_window_seqlens`` (Qwen2.5-VL) computed by transformers' own helper on real
    tensors, remade as fake constants."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    visual = _visual(hf)
    if not hasattr(visual, "window_size"):
        return {}
    from transformers.vision_utils import get_vision_window_index

    with unset_fake_temporarily():
        thw = torch.tensor([list(grid.grid)] * images, dtype=torch.long)
        index, cu = get_vision_window_index(
            thw, spatial_merge_size=v.merge_size, window_size=visual.window_size, patch_size=v.patch_size
        )
        index_list, cu_list = index.tolist(), cu.tolist()
    return {
        "window_index": torch.tensor(index_list, dtype=torch.long),
        "cu_window_seqlens": torch.tensor(cu_list, dtype=torch.int32),
    }


@contextmanager
def vision_trace(hf: Any, train: TrainSpec) -> Iterator[None]:
    """While a traced step with images runs: small tensors made from data keep their values (fake mode
    constants), and a Qwen-VL tower gets its window tables precomputed. Restores both on exit; a no-op without
    images."""
    found = _vision(hf, train)
    if found is None:
        yield
        return
    import torch._subclasses.fake_tensor as fake_tensor

    v, grid = found
    before = fake_tensor.CONSTANT_NUMEL_LIMIT
    fake_tensor.CONSTANT_NUMEL_LIMIT = _CONSTANT_LIMIT
    if v.rule is not ImageRule.DYNAMIC:  # Gemma 3: the placeholder count and the image-block mask need constants only
        try:
            yield
        finally:
            fake_tensor.CONSTANT_NUMEL_LIMIT = before
        return
    visual = _visual(hf)

    def add_tables(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict]:
        images = train.micro_batch * train.images
        return args, {**kwargs, **_window_tables(hf, v, grid, images)}

    handle = visual.register_forward_pre_hook(add_tables, with_kwargs=True)
    model = _base(hf).model
    model.get_rope_index = _on_real_values(model.get_rope_index)  # this instance only; removed below
    try:
        yield
    finally:
        handle.remove()
        del model.get_rope_index
        fake_tensor.CONSTANT_NUMEL_LIMIT = before


def _on_real_values(rope_index: Any) -> Any:
    """``get_rope_index`` (the 3-D rope positions of text and image tokens) run on the real values of its
    constant inputs: Qwen2-VL and Qwen3-VL build the positions through ``torch.arange`` and a Python list of
    0-d tensors, which fake tensors cannot hold values for. It runs outside every mode (its few small index
    tensors are not recorded, fake or real); the positions (3·B·L int64) come back as a recorded constant."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import _disable_current_modes
    from torch.utils._pytree import tree_map

    def real(x: Any) -> Any:
        if isinstance(x, FakeTensor):
            assert x.constant is not None, "get_rope_index got a tensor whose values the trace does not know"
            return x.constant
        return x

    def run(*args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            out = rope_index(*tree_map(real, args), **tree_map(real, kwargs))
            values = [(t.tolist(), t.dtype) for t in out]
        return tuple(torch.tensor(v, dtype=dt) for v, dt in values)

    return run
