"""Activations saved for backward, per decoder layer, per token (and the length² terms per sequence).

Legend: H hidden, I MLP width, Dq = heads·head_dim, Dkv = kv_heads·head_dim, nh heads, L length, B batch,
c bytes of the compute dtype (2 for bf16/fp16, 4 for fp32), s bytes of the residual stream.

What autograd keeps is decided by PyTorch's derivative formulas (tools/autograd/derivatives.yaml): an op saves an
input only when the gradient of another input that requires grad needs it. So a frozen linear (LoRA base, QLoRA)
saves nothing for its weight's sake, and an RMSNorm whose weight is frozen does not save its normalised input.

Model code read (transformers 5.23):
- ``LlamaRMSNorm.forward``: ``x.to(float32)`` (saved by ``pow`` and ``mul``: 4H), ``h.to(input_dtype)`` (saved by
  ``weight * h`` when the weight trains: s·H). ``Gemma2RMSNorm`` multiplies by ``1 + weight`` in fp32 (4H).
  ``nn.LayerNorm`` (GPT-2, Phi, GPT-NeoX, Falcon) saves its input (s·H) and fp32 row statistics (8 bytes); the
  two norms of a parallel block (``GPTNeoXLayer``, Falcon-40B's ``ln_attn``/``ln_mlp``) read the same input.
- ``LlamaAttention`` + ``sdpa_attention_forward``: q/k after RoPE and v are saved by SDPA with its output and an
  fp32 logsumexp (B·nh·L). ``use_gqa_in_sdpa`` is true only without a mask: a padded batch (B > 1, no packing)
  builds a boolean 4-D mask, ``repeat_kv`` copies K and V to nh heads, and torch's
  ``convert_boolean_attn_mask`` (aten/src/ATen/native/transformers/attention.cpp) turns the mask into an additive
  tensor of the query dtype in every layer's call, which the memory-efficient kernel saves (c·B·L·⌈L⌉₁₆).
- ``eager_attention_forward``: ``repeat_kv`` copies, ``softmax(dtype=float32)`` output (saved: 4·nh·L per token)
  and its cast to the compute dtype (saved by the matmul with V: c·nh·L), Gemma 2's softcap adds a tanh output.
- ``LlamaMLP``: ``down(act(gate(x)) * up(x))`` saves gate (for SiLU), act and up (for the product) and the
  product (for down's weight gradient) — 4·c·I when trained, 3·c·I with a frozen down projection.
  GPT-2's and Phi's ``NewGELUActivation`` is Python arithmetic that saves x, tanh(·), 0.5·x and 1 + tanh(·):
  4·c·I; GPT-NeoX's ``GELUActivation`` and Falcon's ``nn.GELU`` are one ``gelu`` op saving its input: c·I.
- Parallel blocks (``PhiDecoderLayer``, ``GPTNeoXLayer`` with ``use_parallel_residual``, ``FalconDecoderLayer``):
  with one norm (Phi, Falcon-7B) attention and MLP read the same normed tensor, saved once by trained linears.
- Autocast (torch ``autocast_mode.cpp`` ``cached_cast``): each linear casts its fp32 input to bf16 itself, and
  only leaf parameters' casts are cached, so q/k/v under AMP save three 2H copies where pure bf16 saves one.
- PEFT ``lora.Linear.forward``: ``x.to(lora_A.weight.dtype)`` per adapter (an fp32 copy when adapters are fp32),
  ``lora_dropout`` (CUDA ``native_dropout`` saves a bool mask, 1 byte/element, and lora_A saves the dropped copy),
  lora_A's output (r) saved by lora_B. Under autocast lora_A re-casts its input to bf16 (2 bytes saved).
- bitsandbytes ``autograd/_functions.py`` ``MatMul4Bit.forward`` (QLoRA's frozen 4-bit linears) before 0.43.2:
  ``if any(ctx.needs_input_grad[:2]): ctx.tensors = (A, B)`` keeps the input A although backward needs only B for
  A's gradient, unlike a frozen ``nn.Linear``; from 0.43.2 on it keeps ``(None, B)`` and saves nothing more than a
  frozen ``nn.Linear`` (``TrainSpec.matmul4bit_keeps_input``: the LitGPT codes ran the old one). Under the
  old one each distinct input of the quantised linears stays alive: the attention input (q/k/v), o_proj's input
  (eager attention only: with SDPA it is the kernel's saved output), the MLP input (gate/up) and down's input,
  c bytes each, unless an adapter already keeps that very tensor (``adapters_share_input``). The trace runs the same
  rule (trace/shims.py ``bnb_linear4bit``).
- PEFT ``lora.bnb.Linear4bit.forward`` (LoRA over a 4-bit base): no cast of the input under autocast, so with no
  dropout ``lora_A`` saves the input itself, once for the adapters reading it (``adapters_share_input``).

Checked against ``shared/notes/tracing.md`` (Llama-3-8B shape, pure bf16, sdpa without mask): full fine-tuning
16H + 4Dq + 4Dkv + 8I = 200,704 bytes per token per layer (+ 4·nh logsumexp), matching the traced figure.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from vramledger.analytic.params import Linear, in_layers, layer_linears
from vramledger.analytic.sdpa_mask import mask_columns
from vramledger.analytic.weights import WeightBudget
from vramledger.specs import Attention, DType, Method, ModelSpec, TrainSpec
from vramledger.specs.vision import ImageRule


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerActivations:
    """Saved bytes of one trained decoder layer."""

    per_token: int
    """Bytes per token that grow with B·L."""
    scores_per_seq: int
    """Bytes per sequence that grow with L² (eager scores; the additive mask of padded SDPA)."""
    detail: tuple[tuple[str, int], ...]
    """(part, bytes per token) for the breakdown shown to users."""
    merged_bytes: int = 0
    """Bytes that do not grow with B·L: the merged expert weights of PEFT's ParamWrapper (``merged_experts``), in a
    layer that holds the experts."""


def residual_bytes(train: TrainSpec, wb: WeightBudget) -> int:
    """Bytes per element of the residual stream. Under AMP with an fp32 (trainable) embedding the stream is fp32,
    since bf16 linear outputs added to an fp32 residual promote to fp32."""
    if train.precision.compute is DType.FP32:
        return 4
    if train.precision.mixed and (wb.embedding_trainable or train.frozen_dtype is DType.FP32):
        return 4
    if train.precision.mixed and train.lora is not None and train.lora.dora and not peft_casts_adapter_input(train):
        # QLoRA with DoRA under autocast: PEFT's 4-bit layer leaves the DoRA result (fp32 magnitude × ...) in fp32
        # (``requires_conversion`` is off under autocast), and o_proj's adds it to the stream
        return 4
    return train.precision.compute.bytes


def padded_sdpa(train: TrainSpec) -> bool:
    """Whether SDPA gets an explicit mask: a padded batch (more than one sequence, not packed)."""
    return train.attn is Attention.SDPA and train.micro_batch > 1 and not train.packing


def sdpa_math(m: ModelSpec, train: TrainSpec) -> bool:
    """Whether SDPA on a CUDA GPU runs its math kernel, which keeps the fp32 probabilities (nh·L² per sequence): fp32
    compute with grouped-query heads.

    Without a mask transformers 5.23 asks for grouped heads (integrations/sdpa_attention.py ``use_gqa_in_sdpa``:
    ``attention_mask is None and key.shape[-1] == value.shape[-1] <= 256``; ``sdpa_attention_forward`` then skips
    ``repeat_kv`` and passes ``enable_gqa=True``). torch 2.13's dispatcher (aten/src/ATen/native/transformers/cuda/
    sdp_utils.cpp ``select_sdp_backend``: cuDNN, flash, efficient, math) finds no fused kernel for that in fp32:
    ``can_use_cudnn_attention`` and ``can_use_flash_attention`` take only fp16/bf16 (``check_dtypes_low_precision``),
    and ``can_use_mem_efficient_attention`` checks ``check_batch_size_and_num_heads_dense<false
    /*supports_grouped_query_attention=*/>`` (sdp_utils_cpp.h: without GQA support, query and key heads must
    match). Later PyTorch (the template's third ``supports_mqa`` argument) lets the efficient kernel take grouped
    heads; 2.13's header has two arguments.

    A padded batch (``padded_sdpa``) gets a mask and repeated K/V, which the efficient kernel takes in fp32, but
    only while some row is padded: a batch whose rows all reach the same length drops it (masking_utils.py
    ``_ignore_causal_mask_sdpa``: no masked token and ``kv_length == q_length``) and runs math, which saves more
    (4·nh·L² against the mask's c·L² per sequence), so the worst batch of a padded run is that one. Not: a mask
    every batch has (sliding windows the length reaches, Gemma 3's images), heads wider than 256 (``repeat_kv``
    instead), MLA and Falcon-40B (K/V made for every query head), LitGPT's code (analytic/litgpt.py)."""
    if train.attn is not Attention.SDPA or runs_eager(m, train) or train.model_code.litgpt:
        return False
    if m.num_kv_heads == m.num_heads or falcon_new_decoder(m) or m.head_dim > 256 or m.kv_lora_rank:
        return False
    fixed_image_mask = m.vision is not None and m.vision.rule is ImageRule.FIXED and bool(train.images)
    window_mask = bool(m.sliding_layers) and train.seq_len >= m.sliding_window
    return train.precision.compute is DType.FP32 and not (fixed_image_mask or window_mask)


def computes_scores(m: ModelSpec, train: TrainSpec) -> bool:
    """Whether attention runs as eager attention does, with length² tensors in every layer: eager asked for, or
    SDPA's math kernel (``sdpa_math``), whose forward (scores, the causal mask added, fp32 probabilities) and
    backward (the probabilities' gradient and ``_softmax_backward_data``'s output, fp32 nh·L² each) make the blocks
    of eager attention in fp32. The allocator's rules for eager's blocks (analytic/reserve/) apply to both."""
    return train.attn is Attention.EAGER or sdpa_math(m, train)


def explicit_mask(m: ModelSpec, train: TrainSpec) -> bool:
    """Whether SDPA gets an explicit mask: a padded batch, or Gemma 3 fed images, whose image tokens attend to each
    other both ways (modeling_gemma3.py ``create_masks_for_vision_model``, built when the batch carries
    ``token_type_ids``, as Gemma3Processor and LLaMA-Factory's collator give it)."""
    fixed = m.vision is not None and m.vision.rule is ImageRule.FIXED
    return padded_sdpa(train) or (train.attn is Attention.SDPA and bool(train.images) and fixed)


# native_layer_norm saves, besides its input, the mean and the reciprocal standard deviation of each row in the
# accumulation dtype, fp32 for bf16/fp16 inputs (derivatives.yaml ``native_layer_norm``: input, result1, result2;
# aten/src/ATen/native/cuda/layer_norm_kernel.cu allocates them with acc_type): 8 bytes per token.
LAYERNORM_ROW_STATS = 8


def _norm_bytes(m: ModelSpec, s: int, trainable: bool, width: int, amp: bool = False) -> int:
    if m.norm_bias:  # nn.LayerNorm saves its input; autocast runs layer_norm in fp32, so it saves an fp32 cast
        return (4 if amp else s) * width + LAYERNORM_ROW_STATS
    if m.family in ("gemma2", "gemma3_text"):  # Gemma 2/3: fp32 upcast and fp32 normalised value
        return 4 * width + (4 * width if trainable else 0)
    return 4 * width + (s * width if trainable else 0)


def _adapter_bytes(train: TrainSpec, in_features: int, out_features: int, base_bytes: int = 0) -> int:
    """Saved by one LoRA adapter per token: its input cast (and dropout mask), and lora_A's output.

    DoRA (PEFT ``tuners/lora/dora.py`` ``DoraLinearLayer.forward``): ``(m - 1) * base_result + m * lora_result``
    with a trainable magnitude m saves the base result (c·out, or ``base_bytes`` an element: fp32 where a 4-bit base
    returns fp32, ``quantised_outputs_fp32``) and the adapter result (out in the adapter's compute dtype).
    """
    assert train.lora is not None
    lora = train.lora
    c = train.precision.compute.bytes
    if train.precision.mixed:
        cast = 2  # autocast re-casts lora_A's input to the compute dtype
        mid = 2
    else:
        cast = 4 if (lora.adapter_fp32 or c == 4) else c
        mid = cast
    mask = in_features if lora.dropout > 0 else 0
    dora = ((base_bytes or c) + mid) * out_features if lora.dora else 0
    return cast * in_features + mask + mid * lora.rank + dora


# Which input each linear reads (the four distinct tensors a decoder layer feeds its linears).
_INPUT_OF = {
    "q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "qkv_proj": "attn_in", "c_attn": "attn_in",
    "query_key_value": "attn_in",
    "o_proj": "attn_out", "c_proj": "attn_out", "dense": "attn_out",
    "gate_proj": "mlp_in", "up_proj": "mlp_in", "gate_up_proj": "mlp_in", "c_fc": "mlp_in", "fc1": "mlp_in",
    "dense_h_to_4h": "mlp_in",
    "down_proj": "mlp_out", "fc2": "mlp_out", "dense_4h_to_h": "mlp_out",
}  # fmt: skip


def input_of(m: ModelSpec, name: str) -> str:
    """Which of the layer's distinct tensors the linear ``name`` reads ('' for none of them): a parallel block
    with one norm feeds the same tensor to attention and MLP (``attn_in``)."""
    group = _INPUT_OF.get(name, "")
    return "attn_in" if group == "mlp_in" and m.shared_block_input else group


def _four_bit_under_autocast(train: TrainSpec) -> bool:
    """QLoRA on a 4-bit base (bitsandbytes ``Linear4bit``, PEFT's ``lora.bnb.Linear4bit``) under autocast."""
    return train.method is Method.QLORA and train.quant is not None and train.quant.bits == 4 and train.precision.mixed


def peft_casts_adapter_input(train: TrainSpec) -> bool:
    """Whether PEFT casts a LoRA layer's input to the adapter's dtype (``_cast_input_dtype``, a copy where the dtypes
    differ): ``lora.Linear.forward`` always does; over a 4-bit base ``lora.bnb.Linear4bit.forward`` only without
    autocast (PEFT 0.21 ``tuners/lora/bnb.py``: ``requires_conversion = not torch.is_autocast_enabled()``)."""
    return not _four_bit_under_autocast(train)


def quantised_outputs_fp32(train: TrainSpec, wb: WeightBudget) -> bool:
    """Whether a 4-bit base's linears return fp32 under autocast: bitsandbytes' ``Linear4bit.forward`` casts its
    output back to the input's dtype (``matmul_4bit(...).to(inp_dtype)``), so with an fp32 residual stream
    (``residual_bytes``) every linear reading it, or reading what they make (the MLP's product), returns fp32, where
    an ``nn.Linear`` under autocast returns bf16; o_proj reads SDPA's bf16 output. Traced: Llama-3.2-1B QLoRA with
    DoRA, bf16-mixed, 1 × 512 (tests/trace/test_qlora_trace.py)."""
    return _four_bit_under_autocast(train) and residual_bytes(train, wb) == 4


def adapters_share_input(train: TrainSpec, wb: WeightBudget, group: str) -> bool:
    """Whether the LoRA adapters on linears reading ``group`` pass that very tensor to ``lora_A`` (so it is saved
    once, and is the tensor the linear reads) rather than a copy of their own.

    PEFT 0.21 ``lora.Linear.forward`` casts the input to the adapter's dtype (``_cast_input_dtype``): no copy only
    in pure precision with adapters in the compute dtype, and no dropout. Over a 4-bit base PEFT runs
    ``lora.bnb.Linear4bit.forward``, which casts only without autocast (``requires_conversion = not
    torch.is_autocast_enabled()``): under autocast ``lora_A`` reads the input as it is, and autocast casts it (a
    copy of each adapter's own) only where it is not in the compute dtype already: the layer's and the MLP's inputs
    are in the residual stream's dtype (``residual_bytes``), attention's output and the down projection's input
    in the compute dtype."""
    lora = train.lora
    assert lora is not None
    if lora.dropout > 0:
        return False
    if not train.precision.mixed:
        return not lora.adapter_fp32
    if peft_casts_adapter_input(train):
        return False
    if group == "mlp_out":  # the MLP's product, fp32 where the 4-bit linears return fp32
        return not quantised_outputs_fp32(train, wb)
    return group == "attn_out" or residual_bytes(train, wb) == 2


def quantised_inputs_bytes(m: ModelSpec, train: TrainSpec, wb: WeightBudget, skip: tuple[str, ...] = ()) -> int:
    """Per token per layer: the inputs that bitsandbytes' MatMul4Bit saves (see the module docstring).

    An adapter on a linear with the same input keeps the same tensor when it neither drops out nor casts it
    (pure precision, adapters in the compute dtype), so that input is not counted twice.
    """
    if m.is_moe:
        return 0  # expert projections are not nn.Linear: bitsandbytes does not quantise them
    assert train.lora is not None
    c = train.precision.compute.bytes
    adapted_groups = {input_of(m, a.linear.name) for a in wb.adapted}
    kept_by_adapter = {g for g in adapted_groups if adapters_share_input(train, wb, g)}
    kept_by_adapter |= set(skip)
    if not (train.attn is Attention.EAGER or m.attn_logit_softcapping or attention_output_copied(m)):
        # SDPA's flash/efficient kernels (and flash-attn) write their output as (B, L, nh, hd) and return a
        # transposed view, so the attention module's ``transpose(1, 2).contiguous()`` is a no-op and o_proj reads
        # the very tensor the kernel saved for backward (traced: trace/shims.py sdpa_as_cuda).
        kept_by_adapter.add("attn_out")
    widths: dict[str, int] = {}
    for lin in layer_linears(m):
        group = input_of(m, lin.name)
        if group and group not in kept_by_adapter:
            widths[group] = lin.in_features
    return c * sum(widths.values())


def dora_transient_bytes(train: TrainSpec, wb: WeightBudget) -> int:
    """DoRA's per-forward weight norm, for the largest adapted layer (PEFT ``get_lora_weight`` multiplies an
    in×in fp32 identity through the adapter to get the out×in update; ``get_weight_norm`` adds it to an fp32
    copy of the base weight): about in² + 4·in·out fp32 elements live at once."""
    if train.lora is None or not train.lora.dora or not wb.adapted:
        return 0
    return max(4 * (a.linear.in_features**2 + 4 * a.linear.in_features * a.linear.out_features) for a in wb.adapted)


def runs_eager(m: ModelSpec, train: TrainSpec) -> bool:
    """Whether attention runs the eager path: asked for, or SDPA asked of a model that cannot use it (Gemma 2's
    soft-capping; a class with ``_supports_sdpa = False`` such as gpt-oss, whose sinks need eager or a kernel)."""
    if train.attn is Attention.EAGER:
        return True
    no_sdpa = m.attn_logit_softcapping or (m.inventory is not None and not m.inventory.supports_sdpa)
    return train.attn is Attention.SDPA and bool(no_sdpa)


def activation_basis(m: ModelSpec, train: TrainSpec) -> str | None:
    """What the activation figure of a model without formulas rests on, for the ledger's warnings."""
    if m.inventory is None:
        return None
    inv = m.inventory
    merged = ""
    if train.adapters:
        from vramledger.analytic.weights import weight_budget

        # PEFT 0.21 tuners/lora/layer.py ParamWrapper (target_parameters, which its MoE conversion uses for fused
        # experts) adds B·A to the whole 3-D weight in every forward: one merged copy per adapted layer.
        merged_bytes = merged_experts(m, train, weight_budget(m, train)).one_layer
        if merged_bytes:
            merged = (
                "; PEFT adapts the fused experts through ParamWrapper, which builds a merged copy of each adapted "
                "expert weight per forward, saved for backward (counted: every adapted layer's, or the recomputed "
                "one's under checkpointing)"
            )
    return (
        f"{m.family}: no formula here; weights, gradients and optimizer state are exact (built on the meta device: "
        f"{inv.model_class}, transformers {inv.transformers_version}); activations are a generic estimate of a "
        f"pre-norm block with this model's linears ({len(inv.linears)} kinds), {m.norms_per_layer} norms, "
        f"{m.num_heads} heads of {m.head_dim} and MLP width {m.moe_intermediate_size or m.intermediate_size}; "
        f"`vramledger trace` gives the exact figure{merged}"
        + (
            ""
            if inv.supports_sdpa or train.attn is not Attention.SDPA
            else f"; {inv.model_class} has no SDPA (_supports_sdpa = False): modelled as eager, whose L² scores "
            "--attn flash_attention_2 (its kernel) avoids"
        )
    )


def layer_activations(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> LayerActivations:
    """Saved activations of one decoder layer whose weights (or adapters) train."""
    H = m.hidden_size
    s = residual_bytes(train, wb)
    amp = train.precision.mixed
    base_trains = train.method in (Method.FULL, Method.FREEZE)
    parts: list[tuple[str, int]] = []

    # Norms around attention and MLP (Gemma's post-norms act on sublayer outputs of the same width).
    parts.append(("norms (fp32 upcast)", _layer_norms_bytes(m, s, base_trains, amp)))
    if base_trains:
        parts.append(_linear_inputs(m, train))
    if train.adapters:
        parts.append(("LoRA inputs and dropout masks", _adapter_inputs_bytes(m, train, wb)))
        wrapped = _param_wrapper_inputs(m, train, wb)
        parts.append(("inputs kept for the experts' and router's LoRA (ParamWrapper)", wrapped))
    if train.quant is not None and train.quant.bits == 4 and train.matmul4bit_keeps_input:
        parts.append(("inputs kept by bitsandbytes MatMul4Bit", quantised_inputs_bytes(m, train, wb)))
    attention, scores = _attention_parts(m, train, base_trains, s)
    parts += attention
    parts += _mlp_parts(m, train, base_trains, quantised_outputs_fp32(train, wb))
    if m.resid_dropout > 0:  # GPT-2: a bool mask after attention and after the MLP (``resid_dropout``)
        parts.append(("residual dropout masks", 2 * H))
    if train.peft_config is not None:  # a PEFT method from adapter_config.json: analytic/peft_memory.py
        from vramledger.analytic.peft_memory import peft_activation_parts

        parts += peft_activation_parts(m, train, s, explicit_mask(m, train), _INPUT_OF)
    return LayerActivations(
        per_token=sum(b for _, b in parts),
        scores_per_seq=scores,
        detail=tuple(parts),
        merged_bytes=merged_experts(m, train, wb).one_layer,
    )


# PEFT 0.21 targets a model's fused expert weights (3-D ``nn.Parameter``s, which its MoE conversion of "all-linear"
# adds as ``target_parameters``) and a bare router weight through ``ParamWrapper`` (tuners/lora/layer.py). Each
# forward, ``_activate_lora`` registers a parametrization on the wrapped parameter: with one adapter and E > 1
# experts ``_LoraFactorsProxy.forward`` returns ``torch.baddbmm(W, lhs, rhs, alpha=scaling)``, autocast off (with
# several adapters ``_LoraParameterProxy``: W + the whole delta), a merged copy of the whole expert stack in W's
# dtype, which the experts' matmuls (transformers 5's ``grouped_mm`` experts implementation, or the eager loop's
# ``W[e]`` views) save for backward, and whose gradient backward makes whole before ``baddbmm``'s backward reduces it
# to the factors'. The matmuls then also keep their inputs, which a frozen expert weight needs no gradient from: the
# tokens gathered for each of their k experts (``hidden_states[token_idx]``, k·H per token) for ``gate_up_proj``, the
# activated product (k·I) for ``down_proj``, the normed hidden state (H) for the router. Traced (a Qwen3-30B-A3B
# layer, LoRA r 8 all-linear, 1 × 1024 tokens, transformers 5.24, peft 0.21.2): 1152 MiB of merged copies
# (768 + 384) and 48.5 MiB of inputs (32 + 12 + 4 + 0.5 for the router's merged weight) per layer beyond the same
# run with LoRA on the attention alone; the gradient of the 384 MiB copy at the backward's peak under checkpointing.


class MergedExperts(NamedTuple):
    """PEFT ParamWrapper's merged weights (``_LoraFactorsProxy``): in one layer that holds them, over every trained
    layer, and what their gradients add in that layer's backward beyond the layer's saved set."""

    one_layer: int
    all_layers: int
    backward_extra: int
    """Backward takes the layer's matmuls in reverse and makes each merged weight's gradient whole while the copies
    of the matmuls not yet reached are saved and the ones done are freed: the most of (its size − the sizes after it
    in forward order). The traced Qwen3-30B-A3B layer: down_proj's 384 MiB gradient beside both copies, then
    gate_up_proj's 768 MiB beside its own copy alone: 384 MiB either way."""


def _wrapped(wb: WeightBudget) -> list[Linear]:
    """The parameters PEFT adapts through ParamWrapper: the ones ``all-linear`` does not pick as modules."""
    return [a.linear for a in wb.adapted if not a.linear.lora_targetable]


def merged_experts(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> MergedExperts:
    """The merged copies of ``_wrapped``'s parameters, in the frozen weights' dtype (``merged_bytes``)."""
    wrapped = _wrapped(wb) if train.adapters else []
    if not wrapped:
        return MergedExperts(0, 0, 0)
    w = train.frozen_dtype.bytes
    order = {lin.name: i for i, lin in enumerate(layer_linears(m))}  # forward order (PEFT lists in its own)
    wrapped.sort(key=lambda lin: order.get(lin.name, len(order)))
    sizes = [(lin.per_layer * lin.in_features * lin.out_features * w, lin) for lin in wrapped]
    share = wb.trainable_layers / m.num_layers  # layers_to_transform: the adapted share of the layers
    every = sum(round(in_layers(m, lin) * share) * b for b, lin in sizes)
    after = [sum(b for b, _ in sizes[i + 1 :]) for i in range(len(sizes))]
    extra = max(b - rest for (b, _), rest in zip(sizes, after, strict=True))
    return MergedExperts(one_layer=sum(b for b, _ in sizes), all_layers=every, backward_extra=max(extra, 0))


def _param_wrapper_inputs(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> int:
    """Per token, what the matmuls of ParamWrapper-adapted parameters keep for their weight's gradient
    (``merged_experts``' comment): each expert stack's input for its k experts, the router's input. A parameter
    adapted in only some of the trained layers (DeepSeek's MoE layers, a layer-indexed target parameter) counts
    for its share of them, as ``_adapter_inputs_bytes`` counts adapters."""
    c = train.precision.compute.bytes
    k = m.experts_per_token or 1
    n = max(wb.trainable_layers, 1)
    return sum(
        (k if lin.per_layer > 1 else 1) * lin.in_features * c * min(in_layers(m, lin), n) // n for lin in _wrapped(wb)
    )


# Which linears' inputs come after eager attention's softmax in a sequential decoder layer (o_proj, the MLP's).
_AFTER_SOFTMAX = frozenset(("attn_out", "mlp_in", "mlp_out"))


def softmax_backward_freed_bytes_per_token(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> int:
    """Per token: what one trained layer saved (``layer_activations``) that its backward has freed by the time eager
    attention's softmax backward runs, the moment the layer's length² tensors peak (3 of nh·L² at once: the fp32
    softmax output, its fp32 gradient, ``_softmax_backward_data``'s result).

    The autograd engine releases a node's saved tensors as soon as the node has run (torch 2.13
    ``torch/csrc/autograd/engine.cpp`` ``Engine::evaluate_function``: ``if (!graph_task->keep_graph_)
    fn.release_variables()``; under non-reentrant checkpointing the unpack hook drops its handle to the recomputed
    tensor, ``torch/utils/checkpoint.py`` ``_checkpoint_hook.unpack_hook``), and a sequential layer's backward
    runs its forward in reverse (transformers 5.23 ``LlamaDecoderLayer.forward``: input norm, attention, residual,
    post-attention norm, MLP, residual; ``eager_attention_forward``: q·kᵀ, softmax, dropout, probabilities · v,
    then o_proj). So when the softmax's backward runs, the nodes after it have released what they kept: the MLP's
    intermediates, its linears' inputs (or their adapters' casts), the norms after attention, o_proj's input, and
    the repeated v that ``matmul(attn_weights, value_states)`` saved. Left: the input norm's, q/k/v's inputs and
    adapters, the q/k norms, q and the repeated k. Traced (bench/reserve, Llama-3-8B LoRA 1 × 4096 eager under
    checkpointing): at ``_softmax_backward_data`` the recomputed layer holds 57,440 bytes per token of its
    221,408.

    0 where the order is not that one or is not modelled: SDPA (its kernel's backward is not a length² peak),
    parallel blocks (attention and MLP read the same input), LitGPT's blocks, other PEFT methods' parts. Bitsandbytes'
    kept inputs are left counted (an upper bound)."""
    if not runs_eager(m, train) or m.parallel_residual or train.model_code.litgpt or train.peft_config is not None:
        return 0
    H, c = m.hidden_size, train.precision.compute.bytes
    s = residual_bytes(train, wb)
    base_trains = train.method in (Method.FULL, Method.FREEZE)
    # Every norm but the input norm (Llama's post_attention_layernorm; Gemma's post-attention, pre- and
    # post-feedforward norms).
    freed = (m.norms_per_layer - 1) * _norm_bytes(m, s, base_trains, H, train.precision.mixed)
    if base_trains:
        mlp_consumers = 1 if (m.fused_gate_up or not m.gated_mlp or m.is_moe) else 2
        freed += 2 * H * mlp_consumers if train.precision.mixed else c * H
        freed += c * m.q_dim  # the attention output o_proj saves (``_attention_parts``: "output")
    if train.adapters:
        freed += _adapter_inputs_bytes(m, train, wb, groups=_AFTER_SOFTMAX)
    freed += c * m.q_dim  # v repeated to nh heads, saved by the matmul with the probabilities
    freed += sum(b for _, b in _mlp_parts(m, train, base_trains, quantised_outputs_fp32(train, wb)))
    if m.resid_dropout > 0:  # GPT-2's two residual dropout masks, after attention and after the MLP
        freed += 2 * H
    return freed


def frozen_weights_grad_bytes_per_token(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> int:
    """Per token per adapted layer: what the layer saves more when its frozen weights require grad too, as under
    FSDP1, whose flat parameter requires grad when any tensor in it does and whose modules compute with views of it
    (analytic/distributed/fsdp_root_flatten.py): each norm saves its normalised input for its weight's gradient, and
    each linear without an adapter keeping the same tensor saves its input (the rule bitsandbytes' old MatMul4Bit
    follows: ``quantised_inputs_bytes``). ``train`` is the step as computed (FSDP's compute dtype, adapters in it)."""
    if train.lora is None:
        return 0
    s, amp = residual_bytes(train, wb), train.precision.mixed
    norms = _layer_norms_bytes(m, s, True, amp) - _layer_norms_bytes(m, s, False, amp)
    if m.qk_norm:
        width = m.q_dim + m.kv_dim
        c = train.precision.compute.bytes
        norms += _norm_bytes(m, c, True, width) - _norm_bytes(m, c, False, width)
    return norms + quantised_inputs_bytes(m, train, wb)


def _layer_norms_bytes(m: ModelSpec, s: int, trainable: bool, amp: bool) -> int:
    """What the norms of one layer save. A parallel block's two LayerNorms (GPT-NeoX ``input_layernorm`` and
    ``post_attention_layernorm``, Falcon-40B ``ln_attn`` and ``ln_mlp``) both read the layer input: they save that
    one tensor (each its own row statistics), unless autocast casts it to fp32 for each of them."""
    if m.norm_bias and m.parallel_residual and not (amp and s != 4):
        return (4 if amp else s) * m.hidden_size + m.norms_per_layer * LAYERNORM_ROW_STATS
    return m.norms_per_layer * _norm_bytes(m, s, trainable, m.hidden_size, amp)


def _linear_inputs(m: ModelSpec, train: TrainSpec) -> tuple[str, int]:
    """Inputs saved by trained linears. Pure precision: one shared tensor per sublayer (one for both sublayers
    when a parallel block's single norm feeds attention and MLP: Phi, Falcon-7B). AMP: one bf16 cast per
    consumer."""
    H = m.hidden_size
    c = train.precision.compute.bytes
    qkv_consumers = 1 if m.fused_qkv else 3
    mlp_consumers = 1 if (m.fused_gate_up or not m.gated_mlp or m.is_moe) else 2
    if train.precision.mixed:
        return ("linear inputs (autocast copies)", 2 * H * (qkv_consumers + mlp_consumers))
    return ("linear inputs", c * H * (1 if m.shared_block_input else 2))


def _adapter_inputs_bytes(
    m: ModelSpec, train: TrainSpec, wb: WeightBudget, groups: frozenset[str] | None = None
) -> int:
    """What the LoRA adapters of one layer save, per token (only those on linears reading ``groups``, if given).

    Without dropout and without a cast (pure precision, adapters in the compute dtype), PEFT's ``lora_A`` saves
    the layer's own input tensor (``nn.Identity`` dropout, ``_cast_input_dtype`` a no-op): adapters reading the
    same tensor (q, k and v; gate and up; Phi's attention and MLP) keep it once, and o_proj's adapter keeps the
    output SDPA saves already. Measured on LitGPT's block, whose adapters share their input the same way
    (bench/published/litgpt_layer_probe.py ``--families``, dropout 0).
    """
    adapter = 0
    assert train.lora is not None
    seen: set[str] = set() if runs_eager(m, train) or attention_output_copied(m) else {"attn_out"}
    for a in wb.adapted:
        if not a.linear.lora_targetable:
            continue  # a ParamWrapper on fused experts or a router: it merges weights, keeps no input copy
        if m.vision is not None and m.vision.holds(a.linear.name):
            continue  # in the vision tower: it saves per image patch (analytic/vision.py), not per token
        group = input_of(m, a.linear.name)
        if groups is not None and group not in groups:
            continue
        base_bytes = 4 if quantised_outputs_fp32(train, wb) and group != "attn_out" else 0
        per_token = _adapter_bytes(train, a.linear.in_features, a.linear.out_features, base_bytes)
        if group and adapters_share_input(train, wb, group):
            if group in seen:
                per_token -= train.precision.compute.bytes * a.linear.in_features
            seen.add(group)
        # An adapter in only some layers (a meta-built model's MoE layers) counts for its share.
        share = per_token * in_layers(m, a.linear)
        adapter += a.linear.per_layer * share // m.num_layers
    return adapter


def attention_saved_bytes(m: ModelSpec, train: TrainSpec) -> int:
    """Per token, what transformers' attention saves (``_attention_parts``; q/k norms aside), for the model codes
    that replace it (analytic/litgpt.py)."""
    parts, _ = _attention_parts(dataclasses.replace(m, qk_norm=False), train, base_trains=False)
    return sum(b for _, b in parts)


def _attention_parts(
    m: ModelSpec, train: TrainSpec, base_trains: bool, resid: int = 0
) -> tuple[list[tuple[str, int]], int]:
    """Attention's saved parts per token, and its length² bytes per sequence (eager scores, padded SDPA's mask);
    ``resid``: an element of the residual stream (``residual_bytes``; c by default)."""
    Dq, Dkv, nh = m.q_dim, m.kv_dim, m.num_heads
    c = train.precision.compute.bytes
    resid = resid or c
    L = train.seq_len
    parts: list[tuple[str, int]] = []
    if m.qk_norm:
        parts.append(("q/k norms", _norm_bytes(m, c, base_trains, Dq + Dkv)))
    scores = 0
    if runs_eager(m, train):
        # q and the repeated k and v (saved by the two matmuls); the contiguous output copy only when o_proj's
        # own weight trains (a PEFT adapter saves its own cast instead).
        parts.append(("q, repeated k/v" + (", output" if base_trains else ""), c * (4 if base_trains else 3) * Dq))
        probs = 4 + (c if c != 4 else 0)
        if m.attn_dropout > 0:
            # native_dropout keeps a bool mask; the dropped copy (instead of the cast probabilities) feeds the
            # matmul with V, so the cast is freed: fp32 softmax + mask + dropped copy.
            probs += 1
        softcap = c if m.attn_logit_softcapping else 0
        scores = (probs + softcap) * nh * L * L
    else:
        if sdpa_math(m, train):
            # _scaled_dot_product_attention_math (see ``sdpa_math``) saves q·√scale, K and V copied to every query
            # head (repeat_interleave, K then scaled), its fp32 probabilities (``_safe_softmax`` output, also what
            # the matmul with V keeps) and no logsumexp; o_proj reads the module's ``transpose(1, 2).contiguous()``
            # copy of the output. Per token the eager path's tensors, per sequence its fp32 probabilities.
            parts.append(("q, k/v repeated, output (SDPA math kernel)", c * (4 if base_trains else 3) * Dq))
            return parts, 4 * nh * L * L
        # FalconAttention._split_heads (new_decoder_architecture) broadcasts K and V to every query head and
        # flattens them: copies of nh heads, whatever the mask.
        grouped = m.num_kv_heads != m.num_heads
        repeat = grouped and ((explicit_mask(m, train) and repeat_kv_copies(m)) or falcon_new_decoder(m))
        kv = 2 * (Dq if repeat else Dkv)
        if grouped and explicit_mask(m, train) and not repeat_kv_copies(m):
            # one K/V head: ``repeat_kv`` makes views, but autocast casts an fp32 k (RoPE's products with an fp32
            # stream's cos and sin) from the expanded view, a c-byte copy with every query head; v (a c-byte
            # projection output) stays a view (traced: gemma-3-1b's sliding layers, a tiny one-K/V-head Llama)
            kv += Dq - Dkv if train.precision.mixed and resid == 4 else 0
        parts.append(("q, k, v, output" + (" (k/v repeated: explicit mask)" if repeat else ""), c * (2 * Dq + kv)))
        if v_views_fused_qkv(m):
            # Phi-3: v is a slice of qkv_proj's output, so SDPA keeping v keeps the whole fused tensor alive.
            parts.append(("fused qkv output kept alive by v", c * (Dq + Dkv)))
        if base_trains and attention_output_copied(m):
            parts.append(("attention output copy read by the trained o_proj", c * Dq))
        parts.append(("attention logsumexp (fp32)", 4 * nh))
        if explicit_mask(m, train):
            scores = c * L * mask_columns(L)
    return parts, scores


def v_views_fused_qkv(m: ModelSpec) -> bool:
    """Whether transformers' attention passes SDPA a value that is a view of the fused q/k/v output, keeping that
    whole output alive: Phi-3 (``qkv[..., query_pos + kv_dim:]``) and GPT-NeoX (``qkv.chunk(3, dim=-1)``), and a
    meta-built model with a fused projection (assumed). Not GPT-2 (its eager path), nor Falcon, whose
    ``_split_heads`` indexes K and V with a list (copies) or, in the new decoder architecture, flattens broadcast
    copies."""
    return m.fused_qkv and not m.learned_positions and m.family != "falcon"


def attention_output_copied(m: ModelSpec) -> bool:
    """Whether o_proj reads a copy of SDPA's output rather than the tensor SDPA keeps. The kernels' output takes the
    query's layout: a query RoPE'd in place of its transposed view (Llama's ``q * cos + rotate_half(q) * sin``) has
    the (B, L, nh, hd) layout, and the module's ``transpose(1, 2).contiguous()`` is a no-op; partial rotary
    (``PhiAttention`` and ``GPTNeoXAttention``: ``torch.cat((query_rot, query_pass), dim=-1)``) makes the query a
    fresh contiguous (B, nh, L, hd) tensor, and the transpose copies (traced: bench/published's tiny Phi and GPT-NeoX,
    c·Dq per token more than the other families when dense trains). transformers 5's ``Phi3`` writes full rotary the
    same way (``modeling_phi3.py`` ``apply_rotary_pos_emb``: ``torch.cat([(q_rot * cos) + (rotate_half(q_rot) *
    sin), q_pass], dim=-1)`` with an empty ``q_pass``): traced, Phi-3-mini LoRA bf16-true 1 × 512, whose adapters
    keep o_proj's input, held c·Dq per token and layer more than the estimate without it."""
    return m.rotary_dim > 0 or m.family in _CAT_ROTARY


# Families whose transformers 5.24 ``apply_rotary_pos_emb`` concatenates the rotated part with the rest even at full
# rotary (``q_embed = torch.cat([...], dim=-1)``) among those the catalog builds as dense decoders.
_CAT_ROTARY = frozenset({"phi3", "glm", "glm4", "nemotron"})


def repeat_kv_copies(m: ModelSpec) -> bool:
    """Whether transformers' ``repeat_kv`` (modeling_llama.py and the models that copy it, SDPA's path with a mask:
    integrations/sdpa_attention.py ``sdpa_attention_forward``) copies K and V to every query head: more than one K/V
    head and fewer than the query heads. ``hidden_states[:, :, None, :, :].expand(b, kv, n_rep, L, hd).reshape(b,
    kv * n_rep, L, hd)`` with one K/V head merges a size-1 dimension into the expanded one, a view with a zero stride:
    nothing is allocated, and SDPA's kernel keeps the view (traced: gemma-3-1b's sliding layers, a padded batch of a
    one-K/V-head Llama; tests/trace/test_crosscheck.py)."""
    return 1 < m.num_kv_heads < m.num_heads


def falcon_new_decoder(m: ModelSpec) -> bool:
    """Falcon's new decoder architecture (Falcon-40B): two norms in a parallel block."""
    return m.family == "falcon" and m.norms_per_layer == 2


def _mlp_parts(m: ModelSpec, train: TrainSpec, base_trains: bool, fp32_outputs: bool = False) -> list[tuple[str, int]]:
    """The MLP's saved parts per token: routed experts and the router, GPT-2's NewGELU, or a gated MLP
    (``fp32_outputs``: a 4-bit base's gate and up return fp32, ``quantised_outputs_fp32``, and so does the
    activation of the gate)."""
    H, I = m.hidden_size, m.intermediate_size
    c = train.precision.compute.bytes
    if m.is_moe:
        k, Im, E = m.experts_per_token, m.moe_intermediate_size, m.num_experts
        per_route = (4 if base_trains else 3) * c * Im + c * H + (c * H if base_trains else 0)
        return [("experts (routed tokens)", k * per_route), ("router logits and softmax", (c + 4) * E)]
    if not m.gated_mlp and not new_gelu(m):
        # GPTNeoXMLP (ACT2FN["gelu"], GELUActivation: F.gelu) and FalconMLP (nn.GELU): one op, which saves its
        # input, the up projection's output (derivatives.yaml ``gelu``: self); the down projection saves the GELU
        # output when its weight trains. Autocast runs gelu in the compute dtype (not on its fp32 list).
        width = 2 if train.precision.mixed else c
        return [("MLP activation (GELU)", width * I * (2 if base_trains else 1))]
    if not m.gated_mlp:
        # GPT-2: c_fc → NewGELU, Python arithmetic saving x (for pow), tanh(·), 0.5·x and 1 + tanh(·) → c_proj.
        # Under autocast ``pow`` runs in fp32 (autocast's fp32 op list), so x is saved as an fp32 copy and
        # everything after it promotes to fp32 except 0.5·x; c_proj then saves a bf16 cast of the product.
        if train.precision.mixed:
            gelu, proj_in = 4 * I + 4 * I + 2 * I + 4 * I, 2 * I
        else:
            gelu, proj_in = 4 * c * I, c * I
        return [("MLP activation (NewGELU)", gelu + (proj_in if base_trains else 0))]
    if fp32_outputs:
        return [("MLP gate/act/up (fp32: the 4-bit linears return their input's dtype)", 4 * I * 3)]
    return [("MLP gate/act/up/product", c * I * (4 if base_trains else 3))]


def new_gelu(m: ModelSpec) -> bool:
    """Whether the MLP's activation is transformers' ``NewGELUActivation`` (``gelu_new``: GPT-2, Phi), Python
    arithmetic that saves four I-wide tensors, rather than one ``F.gelu``."""
    return m.hidden_act == "gelu_new" or m.family == "gpt2"


def checkpoint_input_bytes_per_token(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> int:
    """Per layer under gradient checkpointing: only the layer's input hidden state is kept
    (torch.utils.checkpoint, non-reentrant, as transformers' ``GradientCheckpointingLayer`` calls it)."""
    return residual_bytes(train, wb) * m.hidden_size


def checkpoint_reused_bytes_per_token(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> int:
    """Per token, the part of one layer's saved tensors (``layer_activations``) that is the layer's input itself,
    which under checkpointing is the checkpoint's saved input, not a second tensor.

    The non-reentrant recompute runs the layer on the very tensors the checkpoint saved (torch 2.13
    ``torch/utils/checkpoint.py``: ``_CheckpointFrame.save_inputs`` keeps them, the unpack hook calls
    ``frame.recompute_fn(*frame.get_inputs())``). The layer's first norm saves its input unchanged when it needs no
    cast: ``LlamaRMSNorm``'s ``x.to(float32)`` (Gemma's ``x.float()``) of an fp32 residual stream is ``x`` itself,
    and ``nn.LayerNorm`` saves its input (under autocast an fp32 cast of it, which is ``x`` again for an fp32
    stream). Traced (tiny Llama in fp32 and bf16-true, tiny GPT-2 in bf16-true): the recomputed input norm
    allocates its fp32 copy only when the stream is not fp32, and GPT-2's ``ln_1`` no copy at all.
    Simplification: OLMo-2 normalises sublayer outputs (no norm reads the layer input), counted as 0.
    """
    if m.family == "olmo2":
        return 0
    s = residual_bytes(train, wb)
    saved = (4 if train.precision.mixed else s) if m.norm_bias else 4  # as _norm_bytes: the input's saved copy
    return s * m.hidden_size if saved == s else 0


def final_norm_bytes_per_token(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> int:
    """The final norm's saved tensors."""
    s = residual_bytes(train, wb)
    return _norm_bytes(m, s, wb.norms_trainable and wb.head_trainable, m.hidden_size, train.precision.mixed)


def head_input_bytes_per_token(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> int:
    """lm_head's input, saved for its weight gradient when lm_head trains (its bf16 cast under autocast), and
    what a LoRA adapter on lm_head saves (its input cast, dropout mask and lora_A's output, as for any adapter).

    Simplification: the adapter's V-wide output (lora_B(·) · scaling, added to the logits) is a transient of the
    forward, smaller than the loss's own (c + 8)·V per token, so it never sets the forward peak."""
    head = (2 if train.precision.mixed else train.precision.compute.bytes) * m.hidden_size if wb.head_trainable else 0
    if train.adapters and train.lora is not None and train.lora.head:
        head += _adapter_bytes(train, m.hidden_size, m.vocab_size)
    return head


def final_hidden_live_bytes_per_token(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> int:
    """The final hidden state, alive while the loss runs inside the model's forward (``last_hidden_state`` of
    the base model's output), unless it is the very tensor lm_head saved (pure precision, lm_head trains)."""
    if wb.head_trainable and not train.precision.mixed:
        return 0
    return residual_bytes(train, wb) * m.hidden_size


def first_layer_unsaved_bytes_per_token(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> int:
    """What the first trained layer's input norm does not save because its input does not require grad.

    With a frozen embedding (LoRA, freeze) the hidden states entering the first trained layer carry no grad, so
    the norm's ``pow``/``mul`` keep no fp32 copy of them (a LayerNorm with a frozen weight keeps no input). Under
    gradient checkpointing transformers calls ``enable_input_require_grads`` for PEFT models, and the copy is kept.
    """
    if wb.embedding_trainable or (train.adapters and train.grad_ckpt):
        return 0
    # The adapters fed by the input norm (q/k/v) keep no dropout mask either: no gradient flows to their input.
    masks = 0
    if train.adapters and train.lora is not None and train.lora.dropout > 0:
        attn_inputs = {"q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn"}
        masks = sum(a.linear.in_features for a in wb.adapted if a.linear.name in attn_inputs)
    # bitsandbytes' MatMul4Bit keeps A only when an input needs grad: not for the first layer's q/k/v.
    if train.quant is not None and train.quant.bits == 4 and not m.is_moe and train.matmul4bit_keeps_input:
        masks += quantised_inputs_bytes(m, train, wb) - quantised_inputs_bytes(m, train, wb, skip=("attn_in",))
    if m.norm_bias:
        return masks + (0 if train.method is Method.FREEZE else residual_bytes(train, wb) * m.hidden_size)
    return masks + 4 * m.hidden_size


def rope_bytes_per_token(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> int:
    """cos and sin, computed once per forward and shared by every layer (``LlamaRotaryEmbedding``).

    Their shape is (1, L, head_dim): positions are shared by the batch, so per token this is divided by B
    (rounded up to a whole byte).
    """
    if m.learned_positions:
        # GPT-2: no rotary tables; its embedding dropout keeps a bool mask when its output needs a gradient (a
        # trained embedding, or enable_input_require_grads under checkpointing with adapters).
        needs_grad = wb.embedding_trainable or (train.adapters and train.grad_ckpt)
        return m.hidden_size if (m.resid_dropout > 0 and needs_grad) else 0
    return -(-2 * residual_bytes(train, wb) * m.rope_dim // train.micro_batch)
