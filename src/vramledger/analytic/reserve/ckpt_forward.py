"""Full fine-tuning under checkpointing: what step 1 has reserved by its loss's backward, from the segments its
forward made (``forward_segments``), and what of those segments is still free at the end of backward
(``forward_left_free``).

Under autocast with fp32 weights every decoder matrix's low-precision copy is cached for the whole forward (torch
``aten/src/ATen/autocast_mode.cpp`` ``cached_cast``: the copy of a leaf that requires grad is cached whatever the grad
mode, so the checkpointed layers' forward caches it too, though it saves nothing), and the cache is cleared only when
the outermost autocast context exits (``torch/amp/autocast_mode.py`` ``autocast.__exit__``:
``torch.clear_autocast_cache()`` at nesting level 0), after the loss: accelerate's ``Accelerator.prepare_model`` wraps
``model.forward`` in the autocast context (``get_mixed_precision_context_manager``), and transformers' causal LM
computes its loss inside that forward (``self.loss_function``), before ``accelerator.backward``; the trace shows the
casts freed right after ``nll_loss_forward``. So at its last decoder layer the forward holds the weights, every
checkpointed layer input (torch/utils/checkpoint.py: a checkpointed layer keeps only its inputs), every layer's casts
and that layer's transients, in blocks no larger than a layer's largest transient. The caching allocator never gives a
segment back (``CUDACachingAllocator.cpp``: only ``empty_cache`` or a failed ``cudaMalloc`` releases one), and the loss
then asks for blocks none of those can serve (``get_free_block``: best fit among the free blocks at least as large;
blocks of different segments never merge), so each block of its chain gets a segment on top. When autocast exits the
casts' blocks are freed, and they stay cached and free at the loss's backward peak, where ``stranded_bytes`` counts only
one layer's transients.

The trace replay (bench/reserve/ckpt_forward.jsonl, Qwen2.5-0.5B full, bf16-mixed, 8 × 512, 24 layers): the forward
makes 1.42 GB of segments, mostly thirty-two 38 MiB ones for its c·I·T MLP blocks; at step 1's loss backward 1.00 GB
of them is free where ``stranded_bytes`` counts 0.44 GB beyond the logits hole, the 24 layers' casts (0.72 GB) most
of the difference; step 1 reserves 12.52 GB before its optimizer, ``single_shape``'s R1 without this bound 11.86 GB,
with it 12.27 GB (docs/reserve.md "Step 1's checkpointed forward").

With eager attention the forward's largest segments are the attention's own: each layer's scores, their fp32 copy
and softmax leave (2·c + 8)·nh·L² bytes per sequence cached (``eager_scores_segments``), six times the c·nh·L² scores
block counted before (bench/reserve/ckpt_forward.jsonl: Qwen3-0.6B bf16-true 8 × 1024 and Llama-3.2-3B 2 × 2048,
−8% and −13% under the replay's step 1 reserve with the scores block alone, −1.4% and −1.7% with the segments).

Legend: T tokens per micro-batch, H hidden, I intermediate (``decoder_mlp_width``), c compute-dtype bytes, s
residual-stream bytes, V vocabulary.
"""

from __future__ import annotations

from functools import lru_cache

from vramledger.allocator.conf import K_SMALL_SIZE, allocation_size
from vramledger.analytic.activations import residual_bytes
from vramledger.analytic.params import layer_linears
from vramledger.analytic.parts import StepParts
from vramledger.analytic.reserve.full import decoder_mlp_width, logits_blocks
from vramledger.analytic.reserve.held_activations import decoder_casts, tensors_held
from vramledger.analytic.reserve.load_residue import weight_tails
from vramledger.analytic.reserve.workspace import cublas_workspace_block
from vramledger.specs import Attention, ModelSpec, Precision, TrainSpec


def forward_segments(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """Bytes step 1 has reserved by its loss's backward, full fine-tuning of a dense model under checkpointing (0
    otherwise): a lower bound on what it reserves before its optimizer (``single_shape``'s R1).

    The segments made by the product in the last decoder layer's MLP (transformers ``LlamaMLP.forward``:
    ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``): the weights' (each of at least 10 MiB in a segment of its
    own rounded up to 2 MiB, ``get_allocation_size``, whose tail no counted request fits: ``weight_tails``), the
    forward thread's cuBLAS workspace, the checkpointed inputs (and eager's masks), autocast's cached casts of the
    decoder matrices but that layer's ``down_proj``, and the transients live there (``_mlp_product``), or with eager
    attention the blocks its scores leave cached, if larger (``eager_scores_segments``); then the
    segments the loss makes on top: one per block of the logits chain (``logits_blocks``), and lm_head's cast by
    what it exceeds the largest transient block (it gets a segment of its own where no freed block holds it;
    counted so, the bound never falls as T grows). Left out, so that it stays a lower bound: what best fit wastes in
    cutting the casts and the checkpointed inputs from the transients' blocks (Qwen2.5-0.5B 8 × 512: 0.18 GB free in
    the forward's segments at the MLP product of its last layer), the final norm's saved tensors, the backward
    thread's workspace.
    """
    wb = p.weights
    if not train.grad_ckpt or train.adapters or not wb.trainable_layers or m.is_moe:
        return 0
    c, T = train.precision.compute.bytes, train.tokens
    weights = p.frozen_bytes + p.trainable_bytes + p.master_bytes + cublas_workspace_block(p)
    casts = p.autocast_copy_bytes - p.head_cast_bytes
    if casts:
        casts -= c * m.hidden_size * decoder_mlp_width(m)  # the last layer's down_proj, cast after the product
    scores = eager_scores_segments(m, train, p)
    largest = max(c * decoder_mlp_width(m) * T, scores[0])
    head = max(p.head_cast_bytes - largest, 0)
    counted = _smallest_large_request(m, train, p, casts > 0)
    tails = _tails_below(m, wb.trainable_dtype.bytes, counted) if not p.frozen_bytes else 0
    return weights + tails + _saved_and_transients(m, train, p) + casts + head + sum(logits_blocks(m, train))


def _saved_and_transients(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """What the forward holds at its last layer's MLP product besides the weights and the casts: every checkpointed
    input (and eager's masks) and that layer's transients (``_mlp_product``), or with eager attention the blocks its
    scores leave cached, if larger (``eager_scores_segments``)."""
    transients = max(_mlp_product(m, train, p), sum(eager_scores_segments(m, train, p)))
    return p.saved_layers_bytes + p.scores_bytes + transients


def forward_left_free(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """Bytes of the segments step 1's checkpointed forward made that are cached and free at the end of backward, full
    fine-tuning of a dense model (0 otherwise): what ``forward_segments`` counts of the forward's own tensors (the
    checkpointed inputs, the last layer's transients and autocast's casts but that layer's ``down_proj``), all freed
    by then, less the per-parameter tensors that can sit in them and one cuBLAS workspace.

    Backward frees each checkpointed input once its layer is recomputed (torch/utils/checkpoint.py), the transients
    with their layer, and autocast's casts when the outermost autocast exits (torch/amp/autocast_mode.py
    ``autocast.__exit__``), so at the end of backward those segments hold only what backward and the optimizer cut
    from them: gradients and states no larger than a block there (CUDACachingAllocator.cpp ``get_free_block``, best
    fit; a block of one segment never serves a request larger than its segment), at most ``tensors_held``'s
    fractional bin packing of them, with every block of the inputs and transients taken as large as the layer's
    largest (``forward_block_width``) and each block's room its whole segment (``get_allocation_size``: a block
    under 10 MiB shares a 20 MiB kLargeBuffer segment, which a tensor up to 20 MiB can take once it is whole again)
    so that no tensor that could fit is left out; and the backward thread's cuBLAS
    workspace, made in step 1's backward and never freed (CublasHandlePool.cpp). The V·H tensors of
    the end of backward fit none of them. Llama-3.2-1B full, SGD, bf16-mixed, 2 × 1024 (bench/reserve/replay_grid):
    the forward makes 67 segments of 32 MiB, the casts of the MLP matrices and a layer's transients, and 1.44 GiB of
    them are whole and free at step 2's end of backward, where the fp32 gradients of q, k, v and o (0.63 GiB) fill
    the rest and the 64 MiB MLP gradients fit none; this: 0.25 GiB of inputs + 0.13 of transients + 1.78 of casts −
    0.63 − 0.03 = 1.50 GiB (``casts_unused``, the casts alone, 1.19).
    """
    wb = p.weights
    if not train.grad_ckpt or train.adapters or not wb.trainable_layers or m.is_moe:
        return 0
    c = train.precision.compute.bytes
    block = allocation_size(c * forward_block_width(m, c) * train.tokens)
    casts = decoder_casts(m, train, p)
    segments = [(block, _saved_and_transients(m, train, p)), *((allocation_size(one), one * k) for one, k in casts)]
    free = sum(vol for _, vol in segments) - tensors_held(m, p, segments) - cublas_workspace_block(p)
    if casts:  # the last layer's down_proj, cast after the product
        free -= c * m.hidden_size * decoder_mlp_width(m)
    return max(free, 0)


def forward_block_width(m: ModelSpec, c: int) -> int:
    """w such that c·w·T is the largest block of a checkpointed layer's forward: the MLP's c·I·T, or RMSNorm's fp32
    intermediates (transformers ``LlamaRMSNorm.forward``: ``hidden_states.to(torch.float32)``, ``pow(2)``: 4·H·T)
    where they are larger (c·I < 4·H)."""
    return max(decoder_mlp_width(m), -(-4 * m.hidden_size // c))


def eager_scores_segments(m: ModelSpec, train: TrainSpec, p: StepParts) -> tuple[int, ...]:
    """The blocks a checkpointed layer's eager attention leaves cached after its forward, largest first (full
    fine-tuning under checkpointing; ``forward_layer_temp``, the c·nh·L² scores per sequence, where attention is
    not eager). X = nh·L² per sequence × B.

    transformers ``eager_attention_forward`` (modeling_llama.py, modeling_qwen3.py): ``matmul(q, kᵀ) * scaling``
    (the ``bmm`` block, then the ``mul`` block: two c·X), ``+ attention_mask`` (the mask's dtype and the scores'
    promoted: c·X in a pure 16-bit run, cut from the freed ``bmm`` block; 4·X fp32 under autocast, whose mask has
    the fp32 weights' dtype), then ``softmax(dim=-1, dtype=torch.float32).to(query.dtype)``. ATen's ``softmax``
    with a dtype (aten/src/ATen/native/SoftMax.cpp) fuses the upcast only for Half on CUDA
    (``_softmax(input, dim, half_to_float=true)``); otherwise ``input_.toType(float)`` copies the scores to fp32
    (4·X) and ``_softmax`` makes a fourth block (4·X), and an fp32 input is not copied. The freed c·X blocks cannot
    hold a 4·X request (``get_free_block``: best fit needs a block at least as large; segments never merge), so
    with c < 4 two fp32 4·X segments are made on top of the two c·X ones (bf16: the copy and the softmax; under
    autocast: the masked scores and the softmax), and the next layer's blocks reuse all four: (2·c + 8)·X; with
    fp16 weights (no autocast) the fused upcast makes one, (2·c + 4)·X; in fp32 the masked scores and the softmax
    reuse the ``bmm`` and ``mul`` blocks, 8·X. The trace (bench/reserve/, Qwen3-0.6B full, bf16-true, 8 × 1024,
    X = 128 Mi): 256 + 256 + 512 + 512 MiB made by layer 0's forward, where ``forward_layer_temp`` is 256 MiB;
    Qwen2.5-0.5B 2 × 512 in bf16-mixed, fp16-mixed and fp32: 12·X, 12·X and 8·X (fp16-true: 12·X, the trace
    running on CPU tensors, where ATen takes the copy)."""
    if train.attn is not Attention.EAGER or not p.forward_layer_temp or not train.grad_ckpt:
        return (p.forward_layer_temp,)
    c = train.precision.compute.bytes
    X = m.num_heads * train.seq_len * train.seq_len * train.micro_batch
    if c == 4:
        return (4 * X, 4 * X)
    fp32 = (4 * X,) if train.precision is Precision.FP16 else (4 * X, 4 * X)
    return (*fp32, c * X, c * X)


def _mlp_product(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """The transients of a checkpointed layer at its MLP's product: ``act_fn(gate)``, ``up`` and their product (three
    c·I·T), the attention's residual sum and the post-attention norm's output, the MLP's input (two s·H·T)."""
    c, s, T = train.precision.compute.bytes, residual_bytes(train, p.weights), train.tokens
    return (3 * c * decoder_mlp_width(m) + 2 * s * m.hidden_size) * T


def _smallest_large_request(m: ModelSpec, train: TrainSpec, p: StepParts, casts: bool) -> int:
    """The smallest request ``forward_segments`` counts that a weight's tail could hold: a checkpointed input (s·H·T,
    taken even where it is at most kSmallSize, 1 MiB, and served from the small pool, so that the bound never falls
    as T grows) and, with autocast's casts, the smallest decoder matrix's copy above 1 MiB (smaller ones are served
    from the small pool, ``get_pool``). A tail smaller than this holds none of them."""
    checkpointed = residual_bytes(train, p.weights) * m.hidden_size * train.tokens
    return min(checkpointed, _smallest_large_cast(m, train.precision.compute.bytes)) if casts else checkpointed


@lru_cache(maxsize=256)
def _smallest_large_cast(m: ModelSpec, c: int) -> int:
    """The smallest decoder matrix's c-byte copy above kSmallSize (a large-pool request); 2^62 if none."""
    return min(
        (x for lin in layer_linears(m) if (x := c * lin.in_features * lin.out_features) > K_SMALL_SIZE), default=1 << 62
    )


@lru_cache(maxsize=4096)
def _tails_below(m: ModelSpec, dtype_bytes: int, size: int) -> int:
    """Bytes of the weights' segment tails smaller than ``size`` (``weight_tails``)."""
    return sum(t for t in weight_tails(m, dtype_bytes) if t < size)
