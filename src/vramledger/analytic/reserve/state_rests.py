"""Full fine-tuning without checkpointing: where step 1's AdamW states sit in every MLP activation segment, what
those segments leave cached and free at step 2's loss peak (``state_rests_cached``), on a band of shapes
(``rests_band``; ``band_edges`` for a run with dynamic padding).

Legend: n decoder layers, H hidden, I MLP width, T tokens, c compute-dtype bytes, b trainable-parameter bytes, q
b·H·nh·hd (a q_proj or o_proj state or gradient), k b·H·kv·hd, seg(x) the segment ``get_allocation_size`` makes for
a request of x bytes (rounded up to 2 MiB from 10 MiB on).

What the replay of the traced step shows (Qwen2.5-1.5B full, bf16-mixed, 4 × ℓ; bench/reserve/state_rests.jsonl),
step by step, by the allocator's rules (CUDACachingAllocator.cpp ``get_free_block``: the smallest free block at
least as large; ``alloc_found_block``/``should_split``: a larger one is split where the rest is over 1 MiB;
``free_block``/``try_merge_blocks``: a freed block merges with its free neighbours in its own segment only):

1. step 1's forward saves four c·I·T blocks per layer, each in a segment of its own, seg(c·I·T) (transformers
   ``LlamaMLP.forward``, ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: SiLU saves its input, the product both
   factors, ``down_proj`` its input);
2. step 1's backward frees them layer by layer and cuts each of the layer's three b·H·I weight gradients from one of
   them (where c·I·T ≥ b·H·I): at ``optimizer.step()`` one segment per layer is free and whole, the other three
   hold a gradient beside a free rest r = seg(c·I·T) − b·H·I. The layer's attention gradients, made after its
   MLP's, take the smallest free block that holds them: where the pieces seg(4·H·T) − c·H·T (the fp32 segments of
   the residual stream and RMSNorm's fp32 temporaries, ``Qwen2RMSNorm.forward``, cut by the backward's c·H·T
   blocks) hold a q gradient and are smaller than r, they go there and the rests stay free; where the rests are
   the smaller, they take the attention's gradients, still live at ``optimizer.step()`` (Llama-3.2-1B bf16-true
   4 × 656: 38 of the 64 segments end up holding a state; bf16-mixed 2 × 2656: 48 of 64);
3. ``Adam._init_group`` (torch/optim/adam.py, which AdamW subclasses) creates ``exp_avg`` then ``exp_avg_sq`` for
   every parameter in ``named_parameters`` order, layer by layer: q_proj, k_proj, v_proj, o_proj, then the MLP's
   gate, up and down. The MLP's b·H·I states take the free whole segments (the smallest blocks that hold them), and
   q's and o's states the rests, where a rest is the smallest free block that holds one: smaller than the residual
   stream's c·H·T blocks, seg(c·H·T), each a segment of its own (c·H·T ≥ 10 MiB, ``kMinLargeAlloc``; smaller
   ones share 20 MiB segments, whose free pieces of any size compete), and holding a q state and then a k state
   (k's and v's states, made between q's and o's, go into the room q's state left rather than cut a fresh rest
   below a q state's size). A layer's four q/o states fill the rests as they come (three beside the gradients, one
   beside each whole segment's MLP state), so every one of the 4·n segments holds a state;
4. ``zero_grad`` (set_to_none, the Trainer's default) frees the gradients: each segment's largest free block, at
   most seg(c·I·T) − q, cannot serve a c·I·T request;
5. step 2's forward asks for the 4·n c·I·T blocks again. The blocks the end of step 1 freed that are at least that
   large hold some (the V·H gradient of each trained embedding or head and, with foreach AdamW, its ``_foreach_*``
   temporary, ⌊b·V·H / c·I·T⌋ each: a split block's rest serves the next); every other one gets a new segment.

So at step 2's loss peak the old segments hold free 4·n·seg(c·I·T) less the states in them (n MLP states, 4·n q/o
states), cached and unusable for the c·I·T requests, on top of what ``shape.single_shape``'s term 1 counts; and the
foreach temporary's V·H block, which term 1 counts as free (``full.temporaries_unused_by_activations``), holds
activations instead. Qwen2.5-1.5B 4 × ℓ: on for ℓ = 907 to 936, where all 112 segments hold a state and 4.2 to 4.4
GB of them is free at step 2's peak (4.0 GB counted); at 906 (57 segments: the k states cut the 9.5 MiB rests below
a q state) and 937 (35: the 13.5 MiB rests are larger than the residual stream's 12 MiB blocks) 0.84 and 0.24 GB,
not modelled (the estimate is within 3% of the replay there without it). The set is a band of lengths, not closed
downwards: a run with dynamic padding holds it at the longest shape ≤ (b, L) where it is on (runs.py), a packed run
counts it where it is on at its shape (``on_at``). Of the catalogue's models up to 8B, only Qwen2.5-1.5B (bf16-mixed,
3628 to 3744 tokens a micro-batch)
meets every condition at some shape; elsewhere some segments hold a state and the estimate leaves them out.
Qwen3-4B full, bf16-true, 2 × 2048 has a state in 137 of its 144 MLP segments with the band off (its rest, 28.5 MiB, is
larger than the residual stream's 20 MiB segments, but only 25 of those exist to take the 144 q and o states; its
``q_norm``'s 64 MiB fp32 blocks take two of a layer's three MLP gradients, so three of its four MLP segments are whole
at ``optimizer.step()``): a packed run gets it from the two steps replayed (spill.py ``_backward``), docs/reserve.md
"States in every MLP segment beyond Qwen2.5-1.5B".
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from functools import lru_cache, partial

from vramledger.allocator.conf import (
    K_LARGE_BUFFER,
    K_MIN_BLOCK_SIZE,
    K_MIN_LARGE_ALLOC,
    K_ROUND_LARGE,
    K_SMALL_SIZE,
    allocation_size,
    round_size,
)
from vramledger.analytic.parts import StepParts
from vramledger.analytic.reserve.full import _ADAM_INIT_GROUP, logits_blocks
from vramledger.specs import Method, ModelSpec, Optimizer, TrainSpec

_SAVED_PER_LAYER = 4
"""c·I·T blocks a gated MLP layer saves (step 1 above)."""


def _applies(m: ModelSpec, train: TrainSpec, p: StepParts) -> bool:
    """Full fine-tuning of every layer with AdamW, no checkpointing, the standard loss, a gated MLP with separate
    projections (Llama's, Qwen's), separate q/k/v projections."""
    wb = p.weights
    return (
        train.method is Method.FULL
        and not train.grad_ckpt
        and train.optimizer in _ADAM_INIT_GROUP
        and bool(logits_blocks(m, train))
        and wb.trainable_layers == m.num_layers
        and m.gated_mlp
        and not (m.fused_gate_up or m.fused_qkv or m.is_moe or m.kv_lora_rank)
        and m.intermediate_size > m.hidden_size
    )


def _sizes(m: ModelSpec, train: TrainSpec, p: StepParts) -> tuple[int, int, int]:
    """The rounded request sizes of a decoder MLP matrix's gradient (b·H·I), a q or o state (b·H·nh·hd) and a k
    state (b·H·kv·hd; 0 where it is a small-pool block, which never cuts a large block)."""
    b, H = p.weights.trainable_dtype.bytes, m.hidden_size
    k = round_size(b * H * m.kv_dim)
    return round_size(b * H * m.intermediate_size), round_size(b * H * m.q_dim), k if k > K_SMALL_SIZE else 0


def rests_band(m: ModelSpec, train: TrainSpec, p: StepParts) -> Callable[[int, int], bool] | None:
    """Whether at (b, ℓ) step 1's states sit in every MLP activation segment (steps 2 and 3 of the module's
    docstring): the rest r = seg(c·I·T) − b·H·I beside a gradient is larger than the pieces seg(4·H·T) − c·H·T
    that take the attention's gradients (which must hold one), holds a q state and then a k state, and is smaller
    than the residual stream's segment seg(c·H·T), of its own (c·H·T ≥ 10 MiB). None where the mechanism does not
    apply."""
    if not _applies(m, train, p):
        return None
    c, H, I = train.precision.compute.bytes, m.hidden_size, m.intermediate_size  # noqa: E741
    grad, q, k = _sizes(m, train, p)

    return partial(_on, c, H, I, grad, q, k)


def band_edges(m: ModelSpec, train: TrainSpec, p: StepParts) -> list[tuple[int, int]]:
    """For each micro-batch b ≤ B, the longest ℓ ≤ L where ``rests_band`` is on (micro-batches where it is on at no
    ℓ ≤ L are left out).

    The rest grows with T (seg is non-decreasing), so the band starts at the first ℓ whose rest holds q and k
    (found by bisection); it ends for good once r ≥ c·I·T − b·H·I reaches both c·H·T + 2 MiB + 512 B (above
    seg(c·H·T) from 10 MiB on) and 20 MiB (seg below 10 MiB): the lengths in between are scanned."""
    if rests_band(m, train, p) is None:
        return []
    c, H, I = train.precision.compute.bytes, m.hidden_size, m.intermediate_size  # noqa: E741
    grad, q, k = _sizes(m, train, p)
    out = []
    for b in range(1, train.micro_batch + 1):
        lengths = _band_lengths(c, H, I, grad, q, k, b)
        i = bisect_right(lengths, train.seq_len)
        if i:
            out.append((b, lengths[i - 1]))
    return out


@lru_cache(maxsize=4096)
def _band_lengths(c: int, H: int, I: int, grad: int, q: int, k: int, b: int) -> tuple[int, ...]:  # noqa: E741
    """Every ℓ where ``rests_band`` is on at b sequences, ascending, for ``band_edges`` (one scan per setup and b:
    the planner's searches ask for hundreds of (B, L)). The rest grows with T (seg is non-decreasing), so the band
    starts at the first ℓ whose rest holds q and k (found by bisection); it ends for good once
    r ≥ c·I·T − b·H·I reaches both c·H·T + 2 MiB + 512 B (above seg(c·H·T) from 10 MiB on) and 20 MiB (seg below
    10 MiB)."""
    off_tokens = max(
        -(-(grad + K_ROUND_LARGE + K_MIN_BLOCK_SIZE) // (c * (I - H))), -(-(grad + K_LARGE_BUFFER) // (c * I))
    )
    last = -(-off_tokens // b)

    def holds(ell: int) -> bool:
        return allocation_size(round_size(c * I * b * ell)) - grad >= q + k

    lo, hi = 1, last + 1  # the first ℓ whose rest holds q and k (hi: none up to the end)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds(mid) else (mid + 1, hi)
    return tuple(ell for ell in range(lo, last + 1) if _on(c, H, I, grad, q, k, b, ell))


def _on(c: int, H: int, I: int, grad: int, q: int, k: int, b: int, ell: int) -> bool:  # noqa: E741
    residual = round_size(c * H * b * ell)
    piece = allocation_size(round_size(4 * H * b * ell)) - residual
    rest = allocation_size(round_size(c * I * b * ell)) - grad
    return residual >= K_MIN_LARGE_ALLOC and q <= piece < rest and q + k <= rest < allocation_size(residual)


def state_rests_cached(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """What the MLP activation segments step 1's states sit in leave cached and free at step 2's loss peak, where
    the states sit in every one of them (the band of ``rests_band``; 0 where the mechanism does not apply), less the
    foreach temporary's V·H block that step 2's activations take instead (term 1 counts it free,
    ``full.temporaries_unused_by_activations``):

        4·n·seg(c·I·T) − n·b·H·I − 4·n·b·H·(nh·hd) − t·⌊b·V·H / c·I·T⌋·c·I·T

    n MLP states in the segments left whole, the 4·n q and o states in the rests (step 3 of the module's
    docstring), t the V·H foreach temporaries (one per trained embedding or head with foreach AdamW; step 5)."""
    if not _applies(m, train, p):
        return 0
    c, T, n = train.precision.compute.bytes, train.tokens, m.num_layers
    grad, q, _ = _sizes(m, train, p)
    act = round_size(c * m.intermediate_size * T)
    wb = p.weights
    t = 0
    if train.optimizer is Optimizer.ADAMW and p.step_temp_bytes:
        t = 1 if m.tie_word_embeddings else int(wb.embedding_trainable) + int(wb.head_trainable)
    vh = round_size(wb.lm_head_weight_numel * wb.trainable_dtype.bytes)
    free = _SAVED_PER_LAYER * n * allocation_size(act) - n * grad - 4 * n * q
    return max(free - t * (vh // act) * act, 0)
