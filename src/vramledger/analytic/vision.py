"""Images in a training step of a vision-language model: their tokens in the language model, and the vision tower.

Legend: P patches per sample (all its images), h the tower's width, I its MLP width, nh its heads, r the LoRA
rank, c bytes of the compute dtype, s bytes of the tower's stream (the dtype its frozen weights are loaded in).

Tokens per image: ``analytic/image_tokens.py`` (the processors' rules).

Memory (the tower runs first, inside the model's forward, and its output is scattered into the input embeddings:
``modeling_qwen2_5_vl.py`` ``Qwen2_5_VLModel.forward`` ``masked_scatter``):
- The language model sees seq_len + images·tokens positions (unless the length already counts them, as
  LLaMA-Factory's ``cutoff_len`` does): every LM term grows with it. ``lm_view`` gives that TrainSpec.
- The tower keeps activations for backward only when a gradient flows through it: its weights train (full
  fine-tuning; LLaMA-Factory ``freeze_vision_tower: false``), PEFT put adapters in it (``all-linear`` adapts the
  tower's linears too: tuners_utils.py ``_maybe_include_all_linear_layers`` excludes only the output layer), or
  PEFT made its input require grad: under gradient checkpointing ``PeftModel.__init__`` calls
  ``enable_input_require_grads`` (peft_model.py), which hooks every sub-model's input embedding, the tower's
  ``patch_embed`` among them (modeling_utils.py ``enable_input_require_grads``; ``_input_embed_layer =
  "patch_embed"``). A frozen tower off the gradient path keeps nothing: only its output lives on.
- The batch's ``pixel_values`` (fp32, as the processor returns them; the Trainer moves them without a cast) live
  through the step.

Per patch per block, a tower on the gradient path saves (Qwen2.5-VL blocks, ``Qwen2_5_VLVisionBlock``): the two
RMSNorms' fp32 upcast and rsqrt, 4h + 4 each (their weight's cast c·h more when they train); q and k after RoPE,
the fused qkv output that v is a view of, and the SDPA output, 6·c·h, with an fp32 logsumexp 4·nh (the tower
calls SDPA once per window or image: ``Qwen2_5_VLVisionAttention``); the gated MLP's gate, act and up, 3·c·I; and
what each adapter or trained linear saves of its input, as in the decoder (``analytic/activations.py``). LayerNorm
towers (SigLIP, Llama 4, Qwen2-VL, Qwen3-VL) keep an fp32 copy and mean/rstd, separate q/k/v projections 4·c·h,
quick_gelu two tensors. Under checkpointing each block keeps its input only. The merger (``Qwen2_5_VLPatchMerger``)
saves its norm's upcast and its MLP's inputs; Qwen3-VL's deepstack mergers alike. Checked against the trace of
tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL models (tests/trace/test_vision_trace.py).

Simplifications: the tower's transient peak (one block's temporaries while nothing of the LM is alive yet) is
not a candidate moment: it is far below the loss's; the tower's recompute under checkpointing happens after the
LM's activations are freed; eager attention in the tower is modelled as SDPA (its scores per window).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vramledger.analytic.image_tokens import default_image_size, image_grid
from vramledger.analytic.vision_params import (
    tower_trains,
    uncounted_tower_params,
)
from vramledger.errors import VramledgerError
from vramledger.ledger import Category, LineItem, Phase
from vramledger.specs import Attention, ModelSpec, TrainSpec
from vramledger.specs.vision import ImageRule, VisionSpec


def image_tokens(m: ModelSpec, train: TrainSpec) -> int:
    """Tokens the images of one sample add to the language model's sequence (0 without images or a tower)."""
    if not train.images or m.vision is None:
        return 0
    return train.images * image_grid(m.vision, train).tokens


def lm_view(m: ModelSpec, train: TrainSpec) -> TrainSpec:
    """``train`` as the language model sees it: ``seq_len`` counts the image tokens. Idempotent."""
    if not train.images:
        return train
    if m.vision is None:
        raise VramledgerError(
            f"--images: {m.name} has no vision tower vramledger models (Qwen2/2.5/3-VL, Gemma 3, Llama 4 configs with "
            "a vision_config); drop --images or pass the multimodal config"
        )
    tokens = image_tokens(m, train)
    if train.seq_includes_images:
        # A length with no room for the images (a planner's small candidate, a short cutoff_len) is modelled as the
        # images plus one token, and vision_notes says the real run would fail.
        return train if train.seq_len > tokens else replace(train, seq_len=tokens + 1)
    return replace(train, seq_len=train.seq_len + tokens, seq_includes_images=True)


def tower_on_grad_path(m: ModelSpec, train: TrainSpec, adapter_names: tuple[str, ...]) -> bool:
    """Whether backward runs through the tower (see the module docstring): its weights train (full fine-tuning, the
    tower not frozen), an adapter inside it, or ``enable_input_require_grads`` under checkpointing, which
    transformers' ``_activation_checkpointing_enable`` calls for every model whose main input is ``input_ids``
    (modeling_utils.py), full fine-tuning with a frozen tower included, and PEFT calls again."""
    v = m.vision
    if v is None or not train.images:
        return False
    if tower_trains(train) or (train.grad_ckpt and v.input_hooked):
        return True
    return bool(train.adapters) and any(v.holds(name) for name in adapter_names)


@dataclass(frozen=True, kw_only=True, slots=True)
class VisionBytes:
    """What the images of one micro-batch add beside the language model's longer sequence, in bytes."""

    saved: int
    """The tower's activations saved for backward (0 when no gradient flows through it)."""
    lm_extra: int
    """What the language model saves more because the image embeddings carry a gradient: the first decoder
    layer's norm input, ``masked_scatter``'s placeholder mask, and (adapters under checkpointing) the text
    embeddings beside their scattered copy; and Gemma 3's image-block attention masks (with or without a
    gradient)."""
    pixels: int
    """``pixel_values`` of the batch (fp32)."""
    weights: int
    """A tower the language model's formula does not count (Gemma 3), frozen in the frozen dtype; 0 when the
    model's count includes it (built on the meta device)."""
    casts: int
    """Under AMP with a trained fp32 tower: the bf16 copy autocast makes of each of its matmul weights (the
    language model's are counted by analytic/step.py, which does not see the tower's)."""
    detail: tuple[tuple[str, int], ...]
    """(part, bytes) of ``saved``."""


def _tower_saved(
    v: VisionSpec,
    train: TrainSpec,
    adapted: tuple[tuple[str, int, int], ...],
    stream_grad: bool,
    patches: int,
    tokens: int,
) -> tuple[tuple[str, int], ...]:
    """The tower's saved bytes for ``patches`` patches and ``tokens`` merged tokens (see the module docstring).

    ``adapted``: (module path, in, out) of each adapter inside the tower; ``stream_grad``: the patch embedding's
    output requires grad (the first block's norm then saves its input too)."""
    from vramledger.analytic.activations import _adapter_bytes  # one home for what a PEFT adapter saves

    c = train.precision.compute.bytes
    h, i_w, nh, depth = v.hidden_size, v.intermediate_size, v.num_heads, v.depth
    base = tower_trains(train)
    merge_rows = v.merge_size**2
    parts: list[tuple[str, int]] = []
    siglip = v.rule is ImageRule.FIXED  # Gemma 3's SigLIP: learned positions, no rotary, a pooling projector
    # Llama 4 (modeling_llama4.py Llama4VisionModel.forward): its rotary table is a buffer made at init; the class
    # token and positions are added to the patch embedding, then layernorm_pre, which autocast runs in fp32, so the
    # residual stream through the blocks stays fp32.
    llama4 = v.rule is ImageRule.TILES
    stream = 4 if (llama4 and train.precision.mixed) else c
    if not (siglip or llama4):
        # Rotary cos and sin (fp32, one head_dim each per patch), shared by the blocks and saved by q·cos, k·sin
        # (``apply_rotary_pos_emb_vision`` computes in fp32); the merged tokens' reverse index (int64).
        parts.append(("rotary tables and merge index", 8 * v.head_dim * patches + 8 * tokens))
    if base:  # the trained patch embedding keeps its input's cast (Conv3d over 3·temporal·patch² values)
        parts.append(("patch embedding input", c * 3 * v.temporal_patch_size * v.patch_size**2 * patches))
    elif stream_grad and (v.window_patches or siglip or llama4):  # enable_input_require_grads makes the frozen patch
        # embedding's output a leaf that requires grad, which autograd's AccumulateGrad node holds until backward;
        # Qwen2.5-VL then reorders it into windows (a copy), SigLIP adds its learned positions
        # (modeling_siglip.py ``SiglipVisionEmbeddings.forward``): the leaf is one tensor more than the blocks' inputs
        parts.append(("patch embeddings (made to require grad)", c * h * patches))
    if llama4 and stream_grad:  # layernorm_pre: the fp32 copy of its input, mean and rstd
        parts.append(("pre-LayerNorm (fp32)", (4 * h + 8) * patches))
    if train.grad_ckpt:  # GradientCheckpointingLayer: each block keeps its input only
        parts.append(("block inputs (checkpointed)", depth * stream * h * patches))
    else:
        # RMSNorm: fp32 upcast and rsqrt (a trained weight also saves the normalised value it multiplies);
        # LayerNorm, in fp32 under autocast: an fp32 copy of its input, mean and rstd.
        per_norm = (4 * h + 8) if v.layer_norm else (4 * h + 4 + (c * h if base else 0))
        parts.append(("norms (fp32 upcast)", (2 * depth - (0 if stream_grad else 1)) * per_norm * patches))
        # q and k (after RoPE), v and SDPA's output with its fp32 logsumexp; a fused qkv output stays whole (v is a
        # view of it).
        qkv = 6 * h if v.fused_qkv else 4 * h
        parts.append(("q, k, v, attention output", depth * (c * qkv + 4 * nh) * patches))
        # gate, act, up (SwiGLU), or fc1's output kept by the act (quick_gelu's x·σ(1.702x) keeps σ too)
        mlp = (3 if v.gated_mlp else 2 if v.hidden_act == "quick_gelu" else 1) * c * i_w
        if base:  # trained linears keep their inputs, autocast casting one per linear: q/k/v (or qkv), proj,
            # gate and up (or fc1), down (or fc2)
            mlp += c * (((1 if v.fused_qkv else 3) + 1 + (2 if v.gated_mlp else 1)) * h + i_w)
        parts.append(("MLP", depth * mlp * patches))
    # The merger (Qwen2_5_VLPatchMerger): norm upcast per patch, GELU's input per merged token (merge²·h wide),
    # and trained linears' inputs.
    merger = (4 * h + (8 if v.layer_norm else 4)) * patches + c * merge_rows * h * tokens
    if base:  # the norm's weight saves its normalised input; both linears keep their inputs
        merger += (0 if v.layer_norm else c * h * patches) + 2 * c * merge_rows * h * tokens
    if siglip:
        merger = _gemma3_projector(v, train, patches, tokens)
    # Qwen3-VL: a deepstack merger per listed block (Qwen3VLVisionPatchMerger, its norm after the merge), alike.
    parts.append(("merger" + (f" and {v.deepstack_layers} deepstack mergers" if v.deepstack_layers else ""),
                  merger * (1 + v.deepstack_layers)))  # fmt: skip
    adapters = 0
    for name, in_f, out_f in adapted:
        rows = tokens if "merger" in name or "multi_modal_projector" in name else patches
        if train.grad_ckpt and {"blocks", "layers"} & set(name.split(".")):
            continue  # recomputed inside the checkpointed block
        adapters += _adapter_bytes(train, in_f, out_f) * rows
    parts.append(("LoRA inputs in the tower", adapters))
    return tuple((k, n) for k, n in parts if n)


def _block_masks(m: ModelSpec, lm: TrainSpec) -> int:
    """Gemma 3 with images: the bool B×L×L masks ``create_masks_for_vision_model`` builds (modeling_gemma3.py), one
    for the full-attention layers and one for the sliding ones, alive through the forward (saved by SDPA, or by the
    checkpointed layers that take them as inputs). Under SDPA each layer's call also converts its mask into an
    additive one (analytic/activations.py ``explicit_mask``)."""
    v = m.vision
    if v is None or v.rule is not ImageRule.FIXED or lm.attn is not Attention.SDPA:
        return 0
    kinds = 2 if 0 < m.sliding_layers < m.num_layers else 1
    return kinds * lm.micro_batch * lm.seq_len**2


def _gemma3_projector(v: VisionSpec, train: TrainSpec, patches: int, tokens: int) -> int:
    """SigLIP's ``post_layernorm`` and Gemma 3's projector, saved for backward (modeling_siglip.py
    ``SiglipVisionTransformer.forward``; modeling_gemma3.py ``Gemma3MultiModalProjector.forward``): the LayerNorm's
    fp32 input copy and mean/rstd (autocast runs layer_norm in fp32), the contiguous copy of its output that
    ``avg_pool2d`` saves (fp32 under autocast), the pooled tokens that the RMSNorm's fp32 upcast keeps (already
    fp32: ``x.float()`` is the same tensor) with its rsqrt, and, when the projection trains, the normalised
    tokens it multiplies (cast by autocast)."""
    c, h = train.precision.compute.bytes, v.hidden_size
    stream = 4 if train.precision.mixed else c
    out = (4 * h + 8) * patches + stream * h * patches + (4 * h + 4) * tokens
    if tower_trains(train):
        out += (c + 4) * h * tokens  # the trained norm weight's normalised input, and the matmul's cast input
    return out


def vision_bytes(m: ModelSpec, train: TrainSpec) -> VisionBytes | None:
    """The images' own lines for ``train`` (as the user gave it, images counted separately); None without
    images."""
    v = m.vision
    if v is None or not train.images:
        return None
    from vramledger.analytic.activations import first_layer_unsaved_bytes_per_token
    from vramledger.analytic.weights import weight_budget

    lm = lm_view(m, train)
    wb = weight_budget(m, lm)
    adapted = tuple(
        (a.linear.name, a.linear.in_features, a.linear.out_features)
        for a in (wb.adapted if train.adapters else ())
        if v.holds(a.linear.name)
    )
    grid = image_grid(v, train)
    n = train.micro_batch * train.images
    weights = uncounted_tower_params(m, train) * train.frozen_dtype.bytes
    values = grid.patches - (grid.grid[0] if v.class_token else 0)  # Llama 4's class token is no pixel
    pixels = 4 * n * values * 3 * v.temporal_patch_size * v.patch_size**2
    masks = _block_masks(m, lm)
    if not tower_on_grad_path(m, train, tuple(name for name, _, _ in adapted)):
        return VisionBytes(saved=0, lm_extra=masks, pixels=pixels, weights=weights, casts=0, detail=())
    stream_grad = tower_trains(train) or (train.grad_ckpt and v.input_hooked)
    detail = _tower_saved(v, train, adapted, stream_grad, n * grid.patches, n * grid.tokens)
    # Qwen2_5_VLModel.forward: inputs_embeds.masked_scatter(image_mask, image_embeds) saves the bool mask for the
    # gradient of its source; the first layer's norm now upcasts an input that requires grad; under PEFT's
    # checkpointing the embedding output is a leaf AccumulateGrad holds, and the scattered copy is another tensor.
    extra = masks + lm.tokens
    extra += first_layer_unsaved_bytes_per_token(m, lm, wb) * lm.tokens if wb.trainable_layers else 0
    if train.adapters and train.grad_ckpt:
        extra += train.precision.compute.bytes * m.hidden_size * lm.tokens
    casts = 0
    if tower_trains(train) and train.precision.mixed and train.precision.trainable.bytes == 4:
        casts = 2 * tower_matrix_params(v)
    return VisionBytes(
        saved=sum(b for _, b in detail), lm_extra=extra, pixels=pixels, weights=weights, casts=casts, detail=detail
    )


def tower_matrix_params(v: VisionSpec) -> int:
    """Weights and biases of the tower's matmuls and convolution (what autocast casts: torch autocast_mode.cpp's
    lower-precision ops linear and conv3d), Qwen2.5-VL's layout: fused qkv and proj with biases, the MLP with
    biases, the merger's two linears, the patch embedding without bias."""
    h, i_w, m2 = v.hidden_size, v.intermediate_size, v.merge_size**2 * v.hidden_size
    mlp = (3 if v.gated_mlp else 2) * h * i_w + (2 if v.gated_mlp else 1) * i_w + h
    block = 3 * h * h + 3 * h + h * h + h + mlp
    merger = m2 * m2 + m2 + m2 * v.out_hidden_size + v.out_hidden_size
    return v.depth * block + merger + 3 * v.temporal_patch_size * v.patch_size**2 * h


_SOURCE = "analytic/vision.py: the tower's blocks (Qwen2_5_VLVisionBlock) and merger over every patch"
_PIXELS_SOURCE = (
    "Qwen2VLImageProcessor patchify: 3·temporal·patch² fp32 values per patch (Gemma 3 / Llama 4: "
    "3·side² per image or tile), moved to the GPU without a cast"
)


def vision_items(m: ModelSpec, train: TrainSpec) -> tuple[LineItem, ...]:
    """The images' lines at the forward and backward peaks: the tower's saved activations (alive from the tower's
    forward to its backward, which runs last), the first decoder layer's extra saved input, and the pixels."""
    vb = vision_bytes(m, train)
    if vb is None:
        return ()
    out = [
        LineItem(category=Category.WEIGHTS, phase=phase, bytes=vb.weights, label="vision tower and projector (frozen)",
                 source="analytic/vision_params.py siglip_params: the language model's formula leaves the tower out")
        for phase in (Phase.LOAD, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)
        if vb.weights
    ]  # fmt: skip
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        lines = (
            (Category.ACTIVATIONS, "vision tower (saved for backward)", vb.saved, _SOURCE),
            (Category.ACTIVATIONS, "language model inputs (image embeddings carry a gradient)", vb.lm_extra,
             "masked_scatter's bool mask; the first layer's norm input (first_layer_unsaved_bytes_per_token); "
             "the embeddings beside their scattered copy under PEFT checkpointing"),
            (Category.TEMPORARIES, "pixel values of the batch (fp32)", vb.pixels, _PIXELS_SOURCE),
            (Category.WEIGHTS, "bf16 copies of the vision tower's weights (autocast)",
             vb.casts if (phase is Phase.FORWARD or not train.grad_ckpt) else 0,
             "torch autocast_mode.cpp cached_cast: one per fp32 leaf weight the tower's forward uses"),
        )  # fmt: skip
        out += [LineItem(category=c, phase=phase, bytes=n, label=label, source=src)
                for c, label, n, src in lines if n]  # fmt: skip
    return tuple(out)


def vision_settings(m: ModelSpec, train: TrainSpec) -> dict[str, object]:
    """What the images were taken to be, for the ledger's settings (empty without images)."""
    if not train.images or m.vision is None:
        return {}
    grid = image_grid(m.vision, train)
    return {
        "images": {
            "per_sample": train.images,
            "size": list(train.image_size or default_image_size(m.vision)),
            "processed": [grid.width, grid.height],
            "patches": grid.patches,
            "tokens": grid.tokens,
            "text_seq_len": max(0, train.seq_len - (image_tokens(m, train) if train.seq_includes_images else 0)),
        }
    }


def vision_notes(m: ModelSpec, train: TrainSpec) -> list[str]:
    """One line saying what the images add, for the ledger's warnings."""
    if not train.images or m.vision is None:
        return []
    v, grid = m.vision, image_grid(m.vision, train)
    size = "x".join(map(str, train.image_size or default_image_size(v))) + ("" if train.image_size else " (default)")
    counted = "within" if train.seq_includes_images else "on top of"
    vb = vision_bytes(m, train)
    tower = (
        "the tower is on the gradient path: its activations are saved"
        if vb is not None and vb.saved
        else "the tower is frozen and off the gradient path: it saves nothing for backward"
    )
    notes = [
        f"images: {train.images} per sample of {size} → {grid.width}x{grid.height}, {grid.patches:,} patches, "
        f"{grid.tokens:,} tokens each, {counted} the sequence length; {tower}"
    ]
    tokens = image_tokens(m, train)
    if train.seq_includes_images and train.seq_len <= tokens:
        notes.append(
            f"sequence length {train.seq_len} leaves no room for the images' {tokens} tokens: LLaMA-Factory would cut "
            f"into their placeholders and the model refuses such a batch; modelled as {tokens + 1} tokens (raise "
            "cutoff_len or lower image_max_pixels)"
        )
    return notes
