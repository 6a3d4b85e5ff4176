"""Full fine-tuning without checkpointing: the saved activations' segments cached at step 1's optimizer peak where
no MLP per-parameter tensor fits them (the ``activations`` switch of runs.py), and the reserve they give.

Legend: H hidden, I MLP width, T tokens per micro-batch, c compute-dtype bytes, b trainable-parameter bytes,
A the saved activations (``StepParts``), S the optimizer states.

The allocator's rules (c10/cuda/CUDACachingAllocator.cpp):
- ``get_allocation_size``: a request of at most 1 MiB is cut from a 2 MiB small-pool segment, which large requests
  never use; one under 10 MiB from a 20 MiB segment (kLargeBuffer); a larger one gets a segment of its size rounded
  up to 2 MiB (kRoundLarge; ``allocator.conf.allocation_size``);
- ``free_block`` merges a freed block with the free rest of its segment (``try_merge_blocks``), so once backward
  has freed a layer's activations each of their segments offers its whole size; ``get_free_block`` serves a request
  from the smallest free block at least as large (best fit).

So a decoder matrix's per-parameter tensors (its gradient, the ``exp_avg`` and ``exp_avg_sq`` that
``Adam._init_group`` creates in step 1, torch/optim/adam.py, and foreach AdamW's ``_foreach_sqrt`` temporary, each
b bytes an element) fit an activation segment exactly when they are no larger than it. The largest saved block of a
layer is the MLP's c·I·T; where its segment is smaller than an MLP matrix's b·H·I tensors (``mlp_tensors_unfit``)
those tensors take no activation segment, and the activations' segments stay cached at the optimizer's peak, less
what the smaller matrices' tensors (q, k, v and o's b·H·Dq, b·H·Dkv) were cut from them; step 2 then makes its fp32
logits blocks again on top (``optimizer_peak_bound``). The edge is where the
segment, not the block, reaches b·H·I: Llama-3.2-3B full, bf16-true, 4 × ℓ: 39.55 GiB replayed at ℓ = 728, 38.10 at
736 (c·I·T = 46 MiB in a 46 MiB segment), 34.47 at 737 (46.06 MiB in 48 MiB = b·H·I); the block's own condition,
c·T < b·H, held it to 767.
"""

from __future__ import annotations

from collections.abc import Callable

from vramledger.allocator.conf import K_MIN_LARGE_ALLOC, K_ROUND_LARGE, K_SMALL_SIZE
from vramledger.analytic.params import in_layers, layer_linears
from vramledger.analytic.parts import StepParts
from vramledger.analytic.reserve.full import decoder_mlp_width, fp32_scores_block, held_room, scores_segments
from vramledger.specs import ModelSpec, TrainSpec


def mlp_tensors_unfit(c: int, bw: int, hidden: int, mlp_width: int, tokens: int) -> bool:
    """Whether the segment of one MLP activation block (c·I·T, c bytes an element) is smaller than an MLP matrix's
    per-parameter tensor (b·H·I, ``bw`` bytes an element): the ``activations`` switch at T tokens. Closed downwards in
    T (the segment grows with it).

    >>> mlp_tensors_unfit(2, 2, 3072, 8192, 4 * 736)  # Llama-3.2-3B 4 × 736: 46 MiB in a 46 MiB segment < 48 MiB
    True
    >>> mlp_tensors_unfit(2, 2, 3072, 8192, 4 * 737)  # 46.06 MiB in a 48 MiB segment
    False
    """
    return _room(c * mlp_width * tokens) < bw * hidden * mlp_width


def _room(block: int) -> int:
    """The free block a block forward made offers at step 1's optimizer peak, once backward has freed it: where it had
    a segment of its own (from 10 MiB, ``get_allocation_size``: its size rounded up to 2 MiB) the whole segment,
    ``try_merge_blocks`` merging it with the segment's rest. A smaller block shares a 20 MiB kLargeBuffer segment
    with other blocks, and whether that segment is whole by then depends on what backward cut from it (the replays
    say it often is: Qwen3-0.6B full 1 × 1016 keeps 0.2 GiB of its forward's segments free at step 1's optimizer peak,
    its 12 MiB fp32 MLP tensors taking them); not modelled: only the block's own bytes are counted, and
    ``optimizer_peak_bound`` keeps the earlier term there."""
    return held_room(block)


def _matrices(m: ModelSpec, p: StepParts) -> list[tuple[int, int]]:
    """The trained decoder matrices: (elements of one, how many across the trained layers)."""
    layers = p.weights.trainable_layers
    return [
        (lin.in_features * lin.out_features, lin.per_layer * min(in_layers(m, lin), layers)) for lin in layer_linears(m)
    ]


def decoder_casts(m: ModelSpec, train: TrainSpec, p: StepParts) -> list[tuple[int, int]]:
    """autocast's c-byte copies of the trained decoder matrices under AMP with wider trained weights (none
    otherwise), as (bytes of one, how many). torch autocast_mode.cpp ``cached_cast`` caches one per weight for the
    forward and each matmul saves it for backward, which frees it with the layer's activations; lm_head's copy (V·H)
    is left out: larger than every per-parameter tensor of a decoder matrix, it is the logits chain's kind of
    block."""
    c, bw = train.precision.compute.bytes, p.weights.trainable_dtype.bytes
    if not train.precision.mixed or c >= bw:
        return []
    return [(c * n, k) for n, k in _matrices(m, p)]


def tensors_in_forward_segments(m: ModelSpec, train: TrainSpec, p: StepParts, mlp_width: int) -> int:
    """The most bytes of per-parameter tensors at step 1's optimizer peak (gradients, states, step temporaries) that
    the segments forward freed can hold: the saved activations (A, every block of it at most the MLP's c·I·T, so its
    segments at most that block's) and the decoder casts (``decoder_casts``). A tensor takes only a segment at least its
    size (best fit), and one of at most 1 MiB is a small-pool block that takes none. Each decoder matrix's tensors are
    numel × b bytes apiece, its share of the trainable parameters times G + S + the temporaries. The segments a larger
    tensor fits are among those a smaller one fits, so filling them from the largest tensors down gives the most they
    can hold (bin packing's fractional bound: what best fit cuts off is not counted)."""
    c = train.precision.compute.bytes
    segments = [(_room(c * mlp_width * train.tokens), p.saved_layers_bytes + p.extra_saved_bytes)]
    segments += [scores_segments(m, train, p)]
    segments += [(_room(one), one * k) for one, k in decoder_casts(m, train, p)]
    return tensors_held(m, p, segments)


def tensors_held(m: ModelSpec, p: StepParts, segments: list[tuple[int, int]]) -> int:
    """The most bytes of per-parameter tensors (gradients, states, step temporaries) that freed ``segments``, as (the
    room of one, bytes in all), can hold (``tensors_in_forward_segments`` says how)."""
    wb = p.weights
    if not wb.trainable_params:
        return 0
    bw = wb.trainable_dtype.bytes
    per_param = p.grad_bytes + p.state_bytes + p.step_temp_bytes
    held = 0
    for n, k in sorted(_matrices(m, p), reverse=True):
        if n * bw <= K_SMALL_SIZE:
            continue
        room = sum(vol for size, vol in segments if size >= n * bw) - held
        held += min(per_param * n * k // wb.trainable_params, max(room, 0))
    return held


def activations_cached(m: ModelSpec, train: TrainSpec, p: StepParts, mlp_width: int) -> int:
    """The segments forward freed, cached and free at step 1's optimizer peak where ``mlp_tensors_unfit``: the saved
    activations A and the decoder casts (``decoder_casts``) less the per-parameter tensors that fit them
    (``tensors_in_forward_segments``). A lower bound, since nothing else there fits them (the V·H embedding's and
    head's tensors, the MLP's: under AMP a b-byte MLP tensor is larger than its c-byte cast). Replayed, Llama-3.2-3B
    full, bf16-true 4 × 456, 552, 648, 720: 1.59, 2.76, 4.20, 5.09 GiB free in the forward's segments; this: 1.46,
    2.89, 4.32, 5.39 (A 6.71 to 10.64 GiB less 5.25 GiB of q, k, v and o tensors). Llama-3.2-1B bf16-mixed 2 × 512:
    every activation block holds a tensor and 1.38 GiB of the 32 MiB casts' segments are free; this: 2.10 + 1.81 −
    2.50 = 1.41 GiB."""
    saved = p.saved_layers_bytes + p.scores_bytes + p.extra_saved_bytes
    casts = sum(one * k for one, k in decoder_casts(m, train, p))
    return max(saved + casts - tensors_in_forward_segments(m, train, p, mlp_width), 0)


def optimizer_peak_bound(m: ModelSpec, train: TrainSpec, p: StepParts, opt_peak: int, remade: int) -> int:
    """Reserved where ``mlp_tensors_unfit`` (term 3 of shape.py ``single_shape``): step 1's optimizer peak with the
    forward's segments it leaves free (``activations_cached``), and on top the blocks step 2 makes again (``remade``:
    the fp32 logits blocks the states reach and a tied embedding's, as term 2 counts them; not the c·V·T block,
    which the MLP gradients, fitting no forward segment, take first in step 1's backward, best fit's smallest freed
    chain block, so that the states find it full and step 2's logits find it whole: the replays of Llama-3.2-3B 4 ×
    696 to 736 and Llama-3-8B 1 × 3968 make fp32 blocks only, three, and two at 4 × 736). Replayed: Llama-3.2-3B
    bf16-true 4 × 720, 29.99 + 5.15 free + 4.13 made in step 2 = 39.27 GiB; Llama-3-8B 1 × 3968, 74.85 + 14.72 +
    5.69 = 95.26.

    Where the MLP block is under 10 MiB (``_room``), the earlier bound stays: every saved activation cached, nothing on
    top (the replays do not bear it out, Qwen3-0.6B full 1 × 1016 keeping 0.2 GiB of the forward's segments free, but
    what it over-counts there stands in for the optimizer's own segment rests the closed form leaves out: Qwen2.5-0.5B
    full eager 2 × 256, 0.48 GiB free at step 1's optimizer peak in 18 MiB segments of 16.6 MiB states and
    temporaries and in the weights' segments; docs/reserve.md). Where the two steps are written out for it (full
    fine-tuning of Llama-shaped layers with foreach AdamW, SDPA), a packed run replays them in its place, on one GPU as
    under DDP (analytic/distributed/ddp_reserve.py ``ddp_peak_reserved``)."""
    mlp = decoder_mlp_width(m)
    if train.precision.compute.bytes * mlp * train.tokens < K_MIN_LARGE_ALLOC:
        return opt_peak + p.saved_layers_bytes + p.scores_bytes + p.extra_saved_bytes
    return opt_peak + activations_cached(m, train, p, mlp) + remade


def eligibility_edges(m: ModelSpec, train: TrainSpec, p: StepParts, mlp_width: int) -> list[Callable[[int, int], bool]]:
    """Where the MLP activation's segment is still smaller than each decoder matrix's per-parameter tensor (b·n, above
    1 MiB and under the MLP's, whose edge is the switch itself), as predicates on (b, ℓ), each closed downwards.
    ``activations_cached`` falls where a segment grows past one of them (that matrix's tensors start fitting it) and
    grows with T between two such edges, so a run with dynamic padding holds the upper edge of each (runs.py; the
    replay of Llama-3.2-1B full in fp32, 1 × ℓ: 24.72 GiB at ℓ = 448, where q's and o's 16 MiB tensors fit no 14 MiB
    MLP block, 24.08 at 512)."""
    c, bw = train.precision.compute.bytes, p.weights.trainable_dtype.bytes
    sizes = sorted({bw * n for n, _ in _matrices(m, p)} - {bw * m.hidden_size * mlp_width})

    def shared(b: int, ell: int) -> bool:  # the MLP block under 10 MiB: the earlier term (optimizer_peak_bound)
        return c * mlp_width * b * ell < K_MIN_LARGE_ALLOC

    out: list[Callable[[int, int], bool]] = [shared]
    for t in sizes:
        if t <= K_SMALL_SIZE:
            continue

        def below(b: int, ell: int, t: int = t) -> bool:
            return _room(c * mlp_width * b * ell) < t

        out.append(below)
    return out


def scores_edges(m: ModelSpec, train: TrainSpec, p: StepParts) -> list[Callable[[int, int], bool]]:
    """Where the fp32 probabilities' segments (``scores_segments``) still offer each decoder matrix's per-parameter
    tensors no room, as predicates on (b, ℓ), each closed downwards: ``activations_cached`` falls where a larger shape's
    scores segment starts holding them (Qwen2.5-0.5B full, fp32, 2 × 387 → 388: the 16.0 MiB block's segment grows
    from 16 to 18 MiB, past the MLP's 16.6 MiB tensors, and the single shape's reserve falls by 0.37 GiB). Such a
    segment holds a tensor of t bytes from a block of 1 MiB (a 20 MiB kLargeBuffer segment, shared by two blocks up
    to 10 MiB) and, above 10 MiB, from a block whose 2 MiB-rounded segment reaches t (``get_allocation_size``): the
    edges are blocks of 1 MiB and of the largest multiple of 2 MiB under each t, so that a run with dynamic padding
    keeps the reserve of the shapes just below them (runs.py)."""
    one = fp32_scores_block(m, train, p)
    if not one or not p.weights.trainable_params:
        return []
    B, L, bw = train.micro_batch, train.seq_len, p.weights.trainable_dtype.bytes
    sizes = {bw * n for n, _ in _matrices(m, p)}
    caps = {K_SMALL_SIZE} | {(t - 1) // K_ROUND_LARGE * K_ROUND_LARGE for t in sizes if t > K_MIN_LARGE_ALLOC}

    def under(cap: int) -> Callable[[int, int], bool]:
        return lambda b, ell: one * b * ell * ell // (B * L * L) <= cap

    return [under(cap) for cap in sorted(caps)]
