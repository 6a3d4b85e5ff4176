"""LoRA under checkpointing with eager attention: what the length² blocks and the logits chain leave cached at step 2's
peak (``eager_checkpointed_stranded``), from the caching allocator's rules applied to the blocks in program order.

Eager attention (transformers ``eager_attention_forward``, models/llama/modeling_llama.py) makes, per layer and
sequence, four nh·ℓ² tensors one after the other: ``matmul(query, key_states.transpose(2, 3))`` (c·a, "bmm"),
``* scaling`` (c·a), ``+ attention_mask`` (c·a), and ``softmax(attn_weights, dim=-1, dtype=torch.float32)``, which
for a bf16 input is ``input_.toType(dtype)`` then ``_softmax`` (aten/src/ATen/native/SoftMax.cpp ``softmax``: only a
CUDA Half input takes the fused ``half_to_float`` path): two fp32 blocks (4·a each), then ``.to(query.dtype)`` (c·a);
``dropout`` with p = 0 returns its input (aten/src/ATen/native/Dropout.cpp). Under ``torch.utils.checkpoint``
(``use_reentrant=False``) the forward saves none of them, so each is freed when the layer drops it, and the first
layer's make the segments every later layer reuses: 2·c·a and 2·4·a. The standard loss (transformers
``ForCausalLMLoss``: ``logits.float()``, ``log_softmax``, ``nll_loss``) then asks for c·V·T and three fp32 4·V·T
blocks, and step 1's backward recomputes each layer (``_recomputation_hook``: its length² tensors saved this time, the
fp32 probabilities and the bf16 ones) before its own backward, whose softmax moment holds three 4·a blocks at once
(the probabilities, the gradient's fp32 cast, ``_softmax_backward_data``'s output).

Which block serves which request is CUDACachingAllocator.cpp's: ``get_free_block`` takes the smallest cached block at
least as large (best fit by size, then address), ``should_split`` cuts a large block when more than 1 MiB is left,
and blocks of different segments never merge; a request no cached block holds makes a new segment
(``alloc_block``). So it changes with ℓ: below ℓ = V/nh the fp32 logits blocks (4·V·T) are larger than the fp32
scores (4·a = 4·nh·ℓ²·b), and the loss makes three segments of its own beside the scores'; above it, the scores'
segments hold the loss's blocks, and the loss makes one (``_log_softmax_backward_data``'s, while the saved
log-softmax holds the other) or none (from ℓ = 4·V/(c·nh), where the bf16 scores' blocks hold them too), and the
recomputed layer's softmax backward makes a third fp32 scores segment. Meanwhile each checkpoint's saved input
(s·H·T, the layer's output) is cut from the smallest free block that holds it, between the layer's requests, and
where that is a scores block, a later layer's scores no longer fit whole. And 2 MiB rests decide ties: where the
bf16 scores are cut from a split fp32 block (the product ``* scaling`` while ``matmul``'s output lives), the rest
of that segment (``get_allocation_size``: 2 MiB steps from 10 MiB) is smaller than a bf16 scores segment when the
request is in the lower half of its 2 MiB step, and best fit gives it the masked scores: the forward then makes a
third fp32 segment. Replayed through ``allocator/model.py`` (the port of the allocator), these blocks give the
segments the trace replay makes and what is free at step 2's peak (Llama-3-8B LoRA 1 × 4096 26.23 GiB against the
replay's 26.13, 1 × 3968 29.41 against 29.40; Llama-3.2-1B LoRA 2 × 2048, 1 × 4096 and 1 × 8192 within 0.5%,
bench/reserve/eager_ckpt.jsonl).

What the sequence leaves out: the layers' other transients (projections, norms, RoPE, the MLP: blocks of c·I·T and
less, cut from whatever is free), DoRA's weight-norm blocks (``DoraLinearVariant``: left to ``stranded_bytes``), the
cuBLAS workspaces (``workspace.py``). Where the fp32 scores are the larger and an fp32 scores segment cut for a bf16
scores block leaves a rest smaller than a bf16 scores segment (``_rest_smaller``), the trace also cuts the saved
inputs and those transients from such a split block and makes one more fp32 scores segment and
``_log_softmax_backward_data``'s than the sequence: there a packed run gets the closed form of that layout
(``_worst_free``; Llama-3.2-1B LoRA 1 × 4128: 14.91 GiB against the replay's 14.86, the sequence alone 12.84;
Llama-3-8B 1 × 11584: 97.07 against 96.88). Where the bf16 scores or the saved inputs are under kMinLargeAlloc
(10 MiB), requests of 1 to 10 MiB share 20 MiB segments and the layers' other blocks decide what is cached:
``stranded_bytes`` stands.

A packed run gets the larger of the replays with the requests' sizes and with their segments' sizes (and
``_worst_free`` where ``_rest_smaller`` holds), never more than a run with dynamic padding. That run meets every
length ≤ L and keeps what each made (docs/reserve.md "Runs"), and the single shape's figure falls at each edge and
flips every few tokens: it gets the largest replay over lengths that do not depend on L, a geometric grid up to the
first at or above L, the last length below each edge, with the scores also as the smallest request of their 2 MiB
step (met every few tokens); the closed form of the layout the trace keeps off the 2 MiB steps where the fp32 scores
are the larger (``_worst_free``); and ``stranded_bytes`` below the first length whose blocks are their own: a figure
that never falls as L grows (property-tested, with B).

Legend: a = nh·ℓ²·b scores per layer, T = b·ℓ tokens, V vocabulary, H hidden, c compute-dtype bytes, s
residual-stream bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from vramledger.allocator.conf import K_MIN_LARGE_ALLOC, K_ROUND_LARGE, allocation_size, round_size
from vramledger.analytic.activations import residual_bytes
from vramledger.analytic.parts import StepParts
from vramledger.analytic.reserve.events import Events, replay_excess
from vramledger.analytic.reserve.forward_cache import one_copy_weights
from vramledger.analytic.weights import weight_budget
from vramledger.specs import Attention, DType, Loss, ModelSpec, TrainSpec

# Layers whose recompute and backward are replayed: from the second on, each finds the cache the first left.
_BACKWARD_LAYERS = 2


@dataclass(frozen=True, slots=True)
class _Chain:
    """What the replayed sequence depends on: the blocks' sizes in bytes, and the decoder layers."""

    scores: int  # c·a: one bf16 nh·ℓ² block
    scores32: int  # 4·a
    logits: int  # c·V·T
    logits32: int  # 4·V·T
    saved_input: int  # s·H·T: a checkpoint's saved input
    layers: int


def eager_checkpointed_stranded(
    m: ModelSpec, train: TrainSpec, p: StepParts, shorter: Callable[[TrainSpec], int]
) -> int | None:
    """Bytes cached and free at step 2's peak that the length² blocks and the logits chain leave (see above), for a
    LoRA model with eager attention under checkpointing (bf16 compute, the standard loss, whole base weights) whose
    bf16 scores and saved inputs are blocks of their own (``_own_segments``); None elsewhere.

    A run with dynamic padding meets every length ≤ L and keeps what each made (``_padded``); a packed run gets its
    one shape's replay, never more than that."""
    if not _modelled(m, train, p):
        return None
    B, L = train.micro_batch, train.seq_len
    if not _own_segments(m, train, B, L):
        return None
    padded = _padded(m, train, p, shorter)
    if not train.packing:
        return padded
    single = _stranded_at(m, train, p, B, L, _SIZES[:2])
    if _edges(m, train)[1] <= L and _rest_smaller(m, train, B, L):
        single = max(single, _worst_free(m, train, p, B, L))
    return min(single, padded)


def _rest_smaller(m: ModelSpec, train: TrainSpec, b: int, ell: int) -> bool:
    """Whether an fp32 scores segment cut for a bf16 scores block leaves a rest smaller than a bf16 scores segment
    (``get_allocation_size`` of each, less the request, ``round_size``): best fit then gives that rest to the masked
    scores, and from V/nh the trace keeps the layout of ``_worst_free``: at each length of Llama-3-8B's sweep from
    4096 (bench/reserve/runs.jsonl) and of Llama-3.2-1B's every 32 tokens from 4032 to 4608 (the simulate engine on
    the traced step) where this holds, and at none where it does not."""
    c, a = train.precision.compute.bytes, m.num_heads * ell * ell * b
    x = round_size(c * a)
    return allocation_size(round_size(4 * a)) - x < allocation_size(x)


# Lengths per octave at which a run with dynamic padding is replayed (``_padded``).
_PER_OCTAVE = 8
# Of that grid, the lengths replayed: the last few up to the first at or above L. The figure grows by about a fifth
# from one to the next (∝ ℓ² within a range between edges), and the most it flips between two (an fp32 scores
# segment of four or five) is less than it grows over these.
_LAST = 3


def _padded(m: ModelSpec, train: TrainSpec, p: StepParts, shorter: Callable[[TrainSpec], int]) -> int:
    """The most a run with dynamic padding at micro-batch B and lengths ≤ L leaves free, so that the figure never
    falls as L grows: the replay at the last lengths of a geometric grid up to the first at or above L (``_grid``: a
    little longer than L, since the figure grows with the length and L's own replay can sit above the grid point
    below it), at the first length whose blocks are their own and the last below each edge (``_edges``, where the
    single shape's figure falls); the closed form of the layout the trace keeps off the 2 MiB steps where the fp32
    scores are the larger (``_worst_free``, at the ends of those ranges); and ``shorter``, the figure below the
    first length whose blocks are their own."""
    B, L = train.micro_batch, train.seq_len
    first = _first_own(m, train, B)
    edges = _edges(m, train)
    fixed = [first, *(edge - 1 for edge in edges if first <= edge - 1 <= L)]
    # a grid length past an edge above L stands for the last length before it, in L's range
    grid = [min((edge - 1 for edge in edges if L < edge <= ell), default=ell) for ell in _grid(first, L)]
    replayed = max(_stranded_at(m, train, p, B, ell, _SIZES) for ell in sorted({*fixed, *grid}))
    beyond = edges[1]  # V/nh: from here the fp32 scores are the larger
    worst = max((_worst_free(m, train, p, B, ell) for ell in _corners(m, train, B, L) if ell >= beyond), default=0)
    below = shorter(train.at_shape(B, first - 1)) if first > 1 else 0
    return max(replayed, worst, below)


def _grid(first: int, L: int) -> list[int]:
    """The last ``_LAST`` lengths ⌈2^(k/``_PER_OCTAVE``)⌉ from ``first`` up to the first at or above L."""
    k = max(math.floor(_PER_OCTAVE * math.log2(L)) - 1, 0)
    while math.ceil(2 ** (k / _PER_OCTAVE)) < L:
        k += 1
    lengths = (math.ceil(2 ** (j / _PER_OCTAVE)) for j in range(k - _LAST + 1, k + 1))
    return [ell for ell in lengths if ell >= first]


# The sizes replayed (``_chain``): the requests', their segments' (``get_allocation_size``: 2 MiB steps from 10 MiB),
# and the scores as the smallest request of their 2 MiB step, which a run with dynamic padding meets every few tokens.
_SIZES = ("requests", "segments", "smallest")


def _stranded_at(m: ModelSpec, train: TrainSpec, p: StepParts, b: int, ell: int, sizes: tuple[str, ...]) -> int:
    """The replay's free bytes at step 2's peak at (b, ℓ), the largest over ``sizes``: which of two nearly equal
    blocks serves a request is decided by their 2 MiB rests, which the sequence, without the layers' other blocks,
    does not place as the trace does."""
    return max(_free_at_peak(_chain(m, train, p, b, ell, v)) for v in sizes)


def _worst_free(m: ModelSpec, train: TrainSpec, p: StepParts, b: int, ell: int) -> int:
    """What the replay leaves free at step 2's peak, in closed form, at a length where the bf16 scores are cut from
    a split fp32 segment (scores in the lower half of their 2 MiB step: every few tokens, so a run with dynamic
    padding meets one just below L) and the trace's saved inputs then hold an fp32 scores segment: the forward's
    segments 2·c·a + 3·4·a; the loss's 4·V·T blocks where no scores block holds them (three below ℓ = V/nh, with
    the c·V·T logits below c·V/(4·nh); from V/nh one, ``_log_softmax_backward_data``'s, up to 4·V/(c·nh)), and from
    V/nh the recomputed layer's fp32 scores segment; less the three largest chain blocks live at the peak (the
    loss's backward or the softmax's) and the checkpoints' saved inputs, cut from the free ones (not the first, the
    embedding's output, made before any scores segment exists). A convex quadratic in ℓ and linear in b between
    edges (``_edges``): the largest over the shapes ≤ (B, L) is at a corner (``_corners``)."""
    c, a, T = train.precision.compute.bytes, m.num_heads * ell * ell * b, b * ell
    x, x32, logits, logits32 = c * a, 4 * a, c * m.vocab_size * T, 4 * m.vocab_size * T
    if logits32 > x32:
        blocks = [x, x, x32, x32, x32, logits32, logits32, logits32] + ([logits] if logits > x32 else [])
    elif logits32 > x:
        blocks = [x, x, x32, x32, x32, x32, logits32]
    else:
        blocks = [x, x, x32, x32, x32, x32]
    saved = (m.num_layers - 1) * residual_bytes(train, p.weights) * m.hidden_size * T
    # each segment up to 2 MiB over its block (get_allocation_size): a constant between edges
    rests = K_ROUND_LARGE * len(blocks)
    return max(sum(blocks) + rests - 3 * max(logits32, x32) - saved, 0)


def _corners(m: ModelSpec, train: TrainSpec, b: int, L: int) -> list[int]:
    """For micro-batch b, the first and the last length ≤ L of each range between edges where the scores are blocks
    of their own (``_first_own``)."""
    first, out = _first_own(m, train, b), []
    bounds = [1, *sorted(_edges(m, train)), L + 1]
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        lo, hi = max(lo, first), min(hi, L + 1) - 1
        if lo <= hi:
            out += [lo, hi]
    return out


def _own_segments(m: ModelSpec, train: TrainSpec, b: int, ell: int) -> bool:
    """The bf16 scores and a checkpoint's saved input are at least kMinLargeAlloc (10 MiB): each block is served
    from a segment of its own size (``get_allocation_size``) or cut from a larger block; below, requests of 1 to
    10 MiB share 20 MiB segments and those of 1 MiB or less the small pool's 2 MiB ones, where the layers' other
    blocks decide what is cached."""
    return ell >= _first_own(m, train, b)


def _first_own(m: ModelSpec, train: TrainSpec, b: int) -> int:
    """The shortest length whose bf16 scores (c·nh·ℓ²·b) and saved inputs (s·H·ℓ·b) are both 10 MiB or more."""
    scores = -(-K_MIN_LARGE_ALLOC // (train.precision.compute.bytes * m.num_heads * b))  # ℓ² at least this
    saved = -(-K_MIN_LARGE_ALLOC // (residual_bytes(train, weight_budget(m, train)) * m.hidden_size * b))
    return max(math.isqrt(scores - 1) + 1, saved)


def _modelled(m: ModelSpec, train: TrainSpec, p: StepParts) -> bool:
    """Eager attention under checkpointing with adapters, as the sequence has it: bf16 compute (fp16's CUDA softmax
    takes ``half_to_float``, without the fp32 copy), the standard loss (c·V·T and 4·V·T blocks), whole base weights,
    no DoRA (its weight-norm blocks), no softcapping (Gemma 2's tanh blocks), dense decoder layers in
    transformers' order."""
    return bool(
        train.adapters
        and train.grad_ckpt
        and train.attn is Attention.EAGER
        and train.precision.compute is DType.BF16
        and train.loss is Loss.STANDARD
        and p.weights.trainable_layers
        and not p.dora_temp
        and one_copy_weights(train)
        and not train.distributed
        and not train.model_code.litgpt
        and not (m.is_moe or m.parallel_residual or m.attn_logit_softcapping or m.final_logit_softcapping)
    )


def _chain(m: ModelSpec, train: TrainSpec, p: StepParts, b: int, ell: int, sizes: str) -> _Chain:
    """The blocks at (b, ℓ), of the ``sizes`` (``_SIZES``)."""
    c, a, T = train.precision.compute.bytes, m.num_heads * ell * ell * b, b * ell
    s = residual_bytes(train, p.weights)
    V, H = m.vocab_size, m.hidden_size
    if sizes == "smallest" and c * a >= K_MIN_LARGE_ALLOC:  # its 2 MiB step's first request (512 B rounding)
        a = (allocation_size(c * a) - K_ROUND_LARGE + 512) // c
    blocks = [c * a, 4 * a, c * V * T, 4 * V * T, s * H * T]
    if sizes == "segments":
        blocks = [allocation_size(n) if n >= K_MIN_LARGE_ALLOC else n for n in blocks]
    scores, scores32, logits, logits32, saved_input = blocks
    return _Chain(scores, scores32, logits, logits32, saved_input, layers=m.num_layers)


def _edges(m: ModelSpec, train: TrainSpec) -> tuple[int, ...]:
    """The lengths ℓ from which one chain block is at least as large as another (independent of b): the bf16 logits
    and an fp32 scores block (c·V·T ≤ 4·a ⟺ c·V ≤ 4·nh·ℓ), the fp32 logits and the fp32 scores, or the bf16 logits
    and the bf16 scores (V ≤ nh·ℓ), the fp32 logits and the bf16 scores (4·V ≤ c·nh·ℓ)."""
    c, V, nh = train.precision.compute.bytes, m.vocab_size, m.num_heads
    return tuple(-(-n // d) for n, d in ((c * V, 4 * nh), (V, nh), (4 * V, c * nh)))


@lru_cache(maxsize=16384)
def _free_at_peak(ch: _Chain) -> int:
    """Reserved at the end of two steps less allocated at the peak, the sequence replayed (``replay_excess``). Both
    steps make the same requests, so the peak allocated is step 2's too; reserved only grows."""
    seq = Events()
    for _ in (1, 2):
        inputs = [seq.alloc(ch.saved_input)]  # the embedding's output, the first checkpoint's input
        for _ in range(ch.layers):
            probs, _ = _attention(seq, ch, saved=False)
            seq.free(probs)  # after the matmul with v
            inputs.append(seq.alloc(ch.saved_input))  # the layer's output, the next one's saved input
        seq.free(inputs.pop())  # the final norm's input, done with before the loss's backward
        _loss(seq, ch)
        for _ in range(min(ch.layers, _BACKWARD_LAYERS)):
            _layer_backward(seq, ch)
            seq.free(inputs.pop())
        _free(seq, *inputs)
    # its own cache holds the small ``_Chain``s, not these sequences (``replay_excess.__wrapped__``: uncached)
    reserved, allocated = replay_excess.__wrapped__(tuple(seq.events))
    return reserved - allocated


def _free(seq: Events, *ids: int) -> None:
    for i in ids:
        seq.free(i)


def _attention(seq: Events, ch: _Chain, *, saved: bool) -> tuple[int, int]:
    """``eager_attention_forward``'s length² blocks: returns (the bf16 probabilities, the fp32 softmax output or 0
    where it is not saved: the checkpointed forward frees it once cast back)."""
    qk = seq.alloc(ch.scores)
    scaled = seq.alloc(ch.scores)
    seq.free(qk)
    masked = seq.alloc(ch.scores)
    seq.free(scaled)
    up = seq.alloc(ch.scores32)  # softmax's ``input_.toType(float32)``
    soft = seq.alloc(ch.scores32)
    seq.free(up)
    probs = seq.alloc(ch.scores)  # ``.to(query.dtype)``
    if not saved:
        seq.free(soft)
        soft = 0
    seq.free(masked)
    return probs, soft


def _loss(seq: Events, ch: _Chain) -> None:
    """``ForCausalLMLoss`` and its backward: the logits, their fp32 copy, the saved log-softmax; then
    ``nll_loss_backward``'s and ``_log_softmax_backward_data``'s fp32 gradients, and the cast back for lm_head."""
    logits = seq.alloc(ch.logits)
    up = seq.alloc(ch.logits32)
    lsm = seq.alloc(ch.logits32)
    _free(seq, up, logits)
    nll = seq.alloc(ch.logits32)
    grad = seq.alloc(ch.logits32)
    _free(seq, nll, lsm)
    head = seq.alloc(ch.logits)
    _free(seq, grad, head)


def _layer_backward(seq: Events, ch: _Chain) -> None:
    """A layer recomputed (its length² tensors saved) and its attention's backward: the probabilities' gradient
    (bf16), its cast to fp32, ``_softmax_backward_data`` (three fp32 blocks live), the cast back and ``* scaling``."""
    probs, soft = _attention(seq, ch, saved=True)
    grad = seq.alloc(ch.scores)
    seq.free(probs)
    grad32 = seq.alloc(ch.scores32)
    seq.free(grad)
    dsoft = seq.alloc(ch.scores32)
    _free(seq, soft, grad32)
    down = seq.alloc(ch.scores)
    seq.free(dsoft)
    scaled = seq.alloc(ch.scores)
    _free(seq, down, scaled)
