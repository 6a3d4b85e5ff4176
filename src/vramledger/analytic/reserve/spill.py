"""Full fine-tuning with AdamW: the blocks step 2 makes again beyond the fp32 logits blocks that step 1's states
were counted in (``full.relaid_counted``), where the states reach every fp32 logits block.

Both follow from step 2's requests against the blocks step 1 leaves, by the allocator's rules alone
(CUDACachingAllocator.cpp ``get_free_block``: the smallest cached block at least as large; ``alloc_found_block``
splits a larger one; blocks of different segments never merge, ``try_merge_blocks``):

- the c·V·T logits block (``hole_remade``): step 2's forward asks for it first; where the states were cut from every
  fp32 logits block and from the c·V·T block itself, no whole block of that size is left and a new segment is made;
- one fp32 logits block beside a tied embedding's V·H block (``tied_remade``): where 4·V·T is no larger than the V·H
  gradient, step 2's loss takes its three fp32 blocks from the two freed V·H blocks, which hold ⌊V·H·b / 4·V·T⌋
  each; the rest is made again.

Whether a state reaches the last fp32 block and the c·V·T block at a given shape depends on the rests the gradients
and activations leave in the freed blocks (bench/reserve/replay_states.jsonl), which the estimate does not model:
both terms count the blocks as the states' count has them (``full.blocks_with_states``: every block filled in turn),
an upper bound that the replay meets at the shapes a run with dynamic padding holds (docs/reserve.md "Where the
states spill"). ``beside``: the states that stay outside the chain (shape.py ``states_beside_chain``), left out as
``full.relaid_counted`` leaves them out.
"""

from __future__ import annotations

from vramledger.analytic.parts import StepParts
from vramledger.analytic.reserve.full import _ADAM_INIT_GROUP, blocks_with_states, logits_blocks, remade_blocks
from vramledger.analytic.reserve.held_activations import gradients_in_forward_segments
from vramledger.specs import ModelSpec, TrainSpec


def _head_gradient(p: StepParts) -> int:
    return p.weights.lm_head_weight_numel * p.weights.trainable_dtype.bytes


def hole_remade(m: ModelSpec, train: TrainSpec, p: StepParts, beside: int = 0) -> int:
    """The c·V·T logits block step 2 makes again, on top of the fp32 blocks ``relaid_counted`` counts: where the
    count puts states in every fp32 logits block (and so in the c·V·T block, which it fills first), and no other
    block it counts as whole (eager attention's backward blocks) holds c·V·T.

    Step 2's forward asks for the c·V·T logits before any fp32 block: with a state in each logits block, the block
    of its size is gone and the request gets a new segment (Qwen2.5-3B full, bf16-true, 2 × 1984: an 8.4 MB layer
    state in the c·V·T block, 1.21 GB made again beside the three fp32 blocks; Llama-3.2-3B eager 2 × 2048: the
    ``mm`` block made again in step 2). A bound: the replay leaves the c·V·T block whole where the gradients fill
    it first (Qwen2.5-3B at 2 × 2048), or serves the logits from the rest of a split fp32 block. Not where 4·V·T
    is no larger than the V·H gradient (a freed V·H block serves every logits request, ``tied_remade``).
    """
    if train.optimizer not in _ADAM_INIT_GROUP:
        return 0
    hole, blocks = remade_blocks(m, train)
    n_fp32 = len(logits_blocks(m, train)) - 1
    if not hole or not blocks or blocks[0] <= _head_gradient(p):
        return 0
    reached = blocks_with_states(p.state_bytes - beside, hole, blocks)
    whole = [b for b in blocks[reached:] if b >= hole]
    return hole if reached >= n_fp32 and not whole else 0


def tied_remade(m: ModelSpec, train: TrainSpec, p: StepParts, beside: int = 0) -> int:
    """Blocks of the loss step 2 makes again beside a tied embedding's V·H block (``full.tied_gradient_block``), where
    4·V·T is no larger than the V·H gradient.

    After step 1 two V·H blocks are free at step 2's loss: the gradient sum's (freed by ``zero_grad``) and the
    foreach temporary's. Step 2's loss needs again the blocks of its chain that step 1's states were cut from (counted
    as ``full.blocks_with_states`` fills them, smallest first: the c·V·T logits, under AMP lm_head's c·V·H autocast
    copy, then the fp32 4·V·T ones), and asks for them in forward's order (the copy, the logits, the fp32 copy, the
    log-softmax, ``_log_softmax_backward_data``'s gradient); best fit cuts each from the V·H blocks' smallest rest that
    holds it (a split block's rest serves the next, ``alloc_found_block``), and what they cannot hold is made again.
    With the fp32 blocks alone each V·H block holds ⌊V·H·b / 4·V·T⌋ = ⌊H·b / 4·T⌋ of them: where T > H·b/8 and the
    states reach all three, one is made again (Llama-3.2-1B full 1 × 1856, Qwen3-1.7B full 2 × 896: 0.9 and 1.0 GiB
    over the shapes beside them; at T ≤ H·b/8 the replay makes none). Under AMP the copy and the logits, c·(H + T)·V
    bytes, share one V·H block where c·T ≤ (b − c)·H, and the fp32 blocks get the other: Qwen3-0.6B full 1 × 992 and
    1016 (bf16-mixed) make two fp32 blocks again (and the V·H block), 13.08 and 13.11 GiB replayed. A bound: the
    count puts the states in every block it reaches, the replay at some lengths only (the rests the gradients leave,
    not modelled). Fused AdamW makes no temporaries, so one V·H block is free there: optimizers.py
    ``fused_relaid_switch`` counts its fp32 block.
    """
    if train.optimizer not in _ADAM_INIT_GROUP or not p.step_temp_bytes:
        return 0
    hole, blocks = remade_blocks(m, train)
    fp32 = blocks[: len(logits_blocks(m, train)) - (1 if hole else 0)]
    head = _head_gradient(p)
    if not fp32 or fp32[0] > head:
        return 0
    c = train.precision.compute.bytes
    amp = train.precision.mixed and c < p.weights.trainable_dtype.bytes and p.weights.head_trainable
    cast = c * p.weights.lm_head_weight_numel if amp else 0
    if not gradients_in_forward_segments(m, train, p):
        hole = cast = 0  # the gradients fill them first (held_activations.py)
    # the blocks the states reach, smallest first, then asked for again in forward's order
    small = sorted(x for x in (hole, cast) if x)
    order = [x for x in (cast, hole) if x] + list(fp32)
    reached = blocks_with_states(p.state_bytes - beside, 0, (*small, *fp32))
    return _made_beside(_reached_in_order(order, (*small, *fp32), reached), [head, head])


def _reached_in_order(order: list[int], filled: tuple[int, ...], reached: int) -> list[int]:
    """The blocks of ``order`` among the first ``reached`` of ``filled`` (each size matched once)."""
    left = list(filled[:reached])
    out = []
    for x in order:
        if x in left:
            left.remove(x)
            out.append(x)
    return out


def _made_beside(requests: list[int], free: list[int]) -> int:
    """Bytes of ``requests`` that the free blocks ``free`` cannot serve, each request cut in turn from the smallest
    free block (or rest) that holds it (``get_free_block``, best fit; ``alloc_found_block`` keeps the rest).

    >>> _made_beside([300, 290, 580, 580, 580], [590, 590])  # the first two share one block, one 580 the other
    1160
    """
    rests, made = sorted(free), 0
    for r in requests:
        fits = [x for x in rests if x >= r]
        if not fits:
            made += r
            continue
        rests.remove(fits[0])
        rests.append(fits[0] - r)
        rests.sort()
    return made
