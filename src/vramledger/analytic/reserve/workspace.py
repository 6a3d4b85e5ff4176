"""The backward thread's cuBLAS workspace: which freed block best fit puts it in, and the fp32 logits block step 2
makes again when that is a logits block (adapters; eager attention's band of lengths)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from vramledger.allocator.conf import K_MIN_LARGE_ALLOC
from vramledger.analytic.activations import adapters_share_input, input_of, peft_casts_adapter_input
from vramledger.analytic.litgpt_qlora import lightning_quant_state
from vramledger.analytic.parts import StepParts
from vramledger.analytic.reserve.full import decoder_mlp_width
from vramledger.specs import Attention, DType, Loss, Method, ModelSpec, TrainSpec


def workspace_band(m: ModelSpec, train: TrainSpec, p: StepParts) -> list[tuple[int, int]]:
    """Adapters, eager attention, no checkpointing: for each micro-batch b ≤ B, the longest ℓ ≤ L at which the
    logits leave the workspace no eager block (the upper edge of a band of lengths, not a set closed downwards;
    ``workspace_band_on`` says where the band is).

    Without checkpointing every layer's freed score blocks are cut by the next layer's saved activations, and the
    last layer's by its MLP's; its fp32 softmax input (transformers ``eager_attention_forward``:
    ``softmax(attn_weights, dtype=torch.float32)``, 4·nh·ℓ² per sequence, freed once cast back) is the one left
    whole, and the c·V·T logits, made next, are cut from it where they fit (best fit, ``get_free_block``). Where
    the rest is smaller than the backward thread's workspace, and every other block forward freed is too
    (``workspace_rivals_per_token``), the workspace takes an fp32 logits block as ``workspace_lost`` describes.
    The trace replay (custom 8-layer Llama, LoRA, 2 × ℓ) shows it: 476 MiB over allocated at ℓ = 1024 (the logits,
    125 MiB, in the 128 MiB softmax block), 233 MiB at 864 (they do not fit) and 351 MiB at 1216 (the rest, 32.06
    MiB, holds the workspace) (bench/reserve/runs.jsonl). The band starts where the logits fit (ℓ ≥ c·V/(4·nh))
    and ends where the rest holds the workspace, or where a forward block does.
    """
    band = _band(m, train, p)
    if band is None:
        return []
    lo, top, holds, own_segment = band
    out = []
    for b in range(1, train.micro_batch + 1):
        top_b = min(train.seq_len, top(b))
        hi = _first(lo, max(lo, top_b) + 1, partial(holds, b))
        ell = min(top_b, top_b + 1 if hi is None else hi - 1)
        if ell >= lo and own_segment(b, ell):
            out.append((b, ell))
    return out


def workspace_band_on(m: ModelSpec, train: TrainSpec, p: StepParts) -> Callable[[int, int], bool] | None:
    """Where ``workspace_band``'s mechanism is on at (b, ℓ) (None: at no shape): the logits fit the last layer's
    fp32 softmax block, whose segment is its own, the rest they leave does not hold the workspace, and no block
    forward freed does. A packed run meets that one shape (runs.py ``on_at``): the trace replay of the 8-layer
    Llama, LoRA, eager, 2 × 1024 caches the fp32 logits block the workspace took (0.21 GiB free at step 2's peak,
    made by step 1's ``_to_copy``; one ``_log_softmax_backward_data`` block made in step 2:
    bench/reserve/replay_causes.jsonl), where the closed workspace predicate (runs.py ``switches_on``) is off."""
    band = _band(m, train, p)
    if band is None:
        return None
    lo, top, holds, own_segment = band
    return lambda b, ell: lo <= ell <= top(b) and not holds(b, ell) and own_segment(b, ell)


_Band = tuple[int, Callable[[int], int], Callable[[int, int], bool], Callable[[int, int], bool]]


def _band(m: ModelSpec, train: TrainSpec, p: StepParts) -> _Band | None:
    """The band's terms where it applies: the length from which the logits fit the softmax block; for each b the
    longest ℓ at which no block forward freed holds the workspace; whether the rest holds it (which, once it does,
    holds at every longer ℓ; the 2 MiB rounding of the softmax block's segment is left out, so that the band's
    edge never moves back as L grows); whether the softmax block is a segment of its own (≥ 10 MiB)."""
    wb = p.weights
    c = train.precision.compute.bytes
    eager = train.attn is Attention.EAGER and not train.grad_ckpt
    if not (train.adapters and eager and train.loss is Loss.STANDARD and c != 4 and wb.trainable_layers):
        return None
    ws = cublas_workspace_block(p)
    per_token = max(workspace_rivals_per_token(m, train, p))
    V, nh = m.vocab_size, m.num_heads
    if max(p.dora_temp, dequantised_block(train, p)) >= ws:
        return None

    def top(b: int) -> int:  # longer, a block forward freed holds the workspace
        return (ws - 1) // (per_token * b)

    def holds(b: int, ell: int) -> bool:
        return 4 * nh * b * ell * ell - c * V * b * ell >= ws

    def own_segment(b: int, ell: int) -> bool:
        return 4 * nh * b * ell * ell >= K_MIN_LARGE_ALLOC

    return -(-c * V // (4 * nh)), top, holds, own_segment  # the logits fit from here on: c·V·b·ℓ ≤ 4·nh·b·ℓ²


def _first(lo: int, hi: int, cond: Callable[[int], bool]) -> int | None:
    """The smallest ℓ in [lo, hi] with ``cond`` (which holds from some ℓ on), or None."""
    if not cond(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if cond(mid) else (mid + 1, hi)
    return lo


def cublas_workspace_block(p: StepParts) -> int:
    """One handle's cuBLAS workspace: the one large-pool block each thread's first matmul allocates. ``p`` holds
    both threads' cuBLAS + cuBLASLt workspaces (analytic/overhead.py ``cublas_workspace_bytes``); the architecture
    whose figures add up to it gives the cuBLAS one (catalog/device_overhead.json)."""
    from vramledger.catalog.device_overhead import device_overhead, known_archs

    for arch in ("hopper", *known_archs()):
        ov = device_overhead(arch)
        if sum(ov.workspace_sizes()) == p.workspace_bytes:
            return ov.cublas_workspace.bytes
    return device_overhead("hopper").cublas_workspace.bytes


def workspace_rivals_per_token(m: ModelSpec, train: TrainSpec, p: StepParts) -> list[int]:
    """Bytes per token of the blocks forward frees that could take the backward thread's workspace instead of a
    logits block: ``attention_rivals_per_token`` and the later ones: PEFT's fp32 casts of an adapted layer's input
    (4·in, with fp32 adapters, where PEFT casts it: ``peft_casts_adapter_input``), PEFT's scaled adapter output
    (c·out, freed once added to the base output), a layer's c·I MLP intermediates under checkpointing or where
    nothing keeps the MLP's product (``mlp_product_freed``). QLoRA's dequantised weight is a rival of a fixed size
    (``dequantised_block``)."""
    wb = p.weights
    out = attention_rivals_per_token(m)
    if wb.trainable_dtype.bytes == 4 and peft_casts_adapter_input(train):
        out.append(4 * max((a.linear.in_features for a in wb.adapted), default=0))
    out.append(train.precision.compute.bytes * max((a.linear.out_features for a in wb.adapted), default=0))
    if train.grad_ckpt or mlp_product_freed(m, train, p):
        out.append(train.precision.compute.bytes * decoder_mlp_width(m))
    return out


def mlp_product_freed(m: ModelSpec, train: TrainSpec, p: StepParts) -> bool:
    """Adapters: whether forward frees each layer's c·I MLP product (the down projection's input) once the down
    projection has read it. A frozen ``nn.Linear`` saves no input, nor does bitsandbytes' 4-bit matmul from 0.43.2
    (``ctx.tensors = (None, B)``), so only an adapter on the down projection that hands ``lora_A`` that very tensor
    keeps it (``adapters_share_input``). The trace replay of Qwen2.5-1.5B, QLoRA on q and v, 1 × 4096, puts the
    backward thread's workspace in the last layer's product block (bench/reserve/qlora_grid.py)."""
    if m.is_moe or not train.adapters or train.method not in (Method.LORA, Method.QLORA):
        return False
    down = [a for a in p.weights.adapted if input_of(m, a.linear.name) == "mlp_out"]
    if down:
        return not adapters_share_input(train, p.weights, "mlp_out")
    return not (train.method is Method.QLORA and train.matmul4bit_keeps_input)


def attention_rivals_per_token(m: ModelSpec) -> list[int]:
    """The rivals attention frees, before the MLP: the fp32 norm intermediates (4·H) and Qwen3's q_norm over the query
    heads (Qwen3RMSNorm's fp32 intermediates, 4·nh·hd)."""
    return [4 * m.hidden_size, *([4 * m.q_dim] if m.qk_norm else [])]


def rival_holds_workspace(m: ModelSpec, train: TrainSpec, p: StepParts) -> Callable[[int], bool]:
    """Whether a block forward frees, at a micro-batch of so many tokens, still holds the backward thread's workspace.

    Under QLoRA each of the MLP's matmuls dequantises its weight after attention's blocks were freed, and best fit
    cuts it from the smallest free block that holds it, which can be one of them: the trace replay of Qwen3-0.6B,
    QLoRA, 2 × 2048 (q_norm's 4·nh·hd·T block exactly 32 MiB, a 6 MiB dequantised weight) puts the workspace in a
    logits block (bench/reserve/qlora_grid.py). So attention's rivals hold it only with a dequantised weight cut
    from them."""
    ws = cublas_workspace_block(p)
    early = attention_rivals_per_token(m)
    later = max(workspace_rivals_per_token(m, train, p)[len(early) :])
    cut, first = dequantised_block(train, p), max(early)
    return lambda tokens: first * tokens - cut >= ws or later * tokens >= ws


def dequantised_block(train: TrainSpec, p: StepParts) -> int:
    """QLoRA: the largest weight bitsandbytes dequantises for one matmul (``dequantize_4bit``, in the quantisation
    state's dtype), a block forward frees after each matmul, that rivals the logits blocks for the workspace; 0
    without a 4-bit base."""
    if train.quant is None or train.quant.bits != 4:
        return 0
    state = DType.FP16 if lightning_quant_state(train.model_code) else train.frozen_dtype
    return p.weights.largest_frozen_matrix_numel * state.bytes


def workspace_lost(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """Adapters: an fp32 logits block lost to the backward thread's cuBLAS workspace, cached at the loss's peak.

    torch CublasHandlePool.cpp ``getCurrentCUDABlasHandle`` gives the autograd engine's thread its own handle,
    whose workspace (``getChosenWorkspaceSize``: 32 MiB on Hopper) is allocated through the caching allocator at
    that thread's first matmul (step 1's backward) and never freed. Best fit puts it in the smallest free block
    that holds it. With adapters the blocks freed in forward are PEFT's fp32 casts of an adapted layer's input
    (``lora.Linear.forward`` ``_cast_input_dtype``: 4·in·T), the fp32 norm intermediates (4·H·T), eager's
    scores, DoRA's weight norm and, under checkpointing, a layer's c·I·T MLP intermediates; when all are smaller
    than the workspace (``switches_on``) it lands in a freed fp32 copy of the logits (4·V·T), and from step 2 on
    backward makes one more 4·V·T block: 4·V·T − workspace more is cached at the loss's peak (the replay shows it
    in every LoRA config where the rule applies: bench/reserve/replay_causes.jsonl).
    """
    return max(4 * m.vocab_size * train.tokens - cublas_workspace_block(p), 0)
