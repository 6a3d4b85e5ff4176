"""Full fine-tuning with AdamW: the blocks step 2 makes again beyond the fp32 logits blocks that step 1's states
were counted in (``full.relaid_counted``), where the states reach every fp32 logits block.

Both follow from step 2's requests against the blocks step 1 leaves, by the allocator's rules alone
(CUDACachingAllocator.cpp ``get_free_block``: the smallest cached block at least as large; ``alloc_found_block``
splits a larger one; blocks of different segments never merge, ``try_merge_blocks``):

- the c·V·T logits block (``hole_remade``): step 2's forward asks for it first; where the states were cut from every
  fp32 logits block and from the c·V·T block itself, no whole block of that size is left and a new segment is made;
- one fp32 logits block beside a tied embedding's V·H block (``tied_remade``): where 4·V·T is no larger than the V·H
  gradient, step 2's loss takes its three fp32 blocks from the two freed V·H blocks, which hold ⌊V·H·b / 4·V·T⌋
  each; the rest is made again; at the edge 4·V·T = V·H·b (``at_tied_edge``) only where the chain's other two
  blocks both hold something (shape.py ``_tied_relaid``).

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
    """fp32 logits blocks step 2 makes again beside a tied embedding's V·H block (``full.tied_gradient_block``),
    where 4·V·T is no larger than the V·H gradient.

    After step 1 two V·H blocks are free at step 2's loss: the gradient sum's (freed by ``zero_grad``) and the
    foreach temporary's. The loss needs the fp32 logits blocks the states were cut from; best fit takes them from
    the V·H blocks, each holding ⌊V·H·b / 4·V·T⌋ = ⌊H·b / 4·T⌋ of them (a split block's rest serves the next); what
    they cannot hold is made again. So where T > H·b/8 and the states reach all three fp32 blocks, one fp32 block
    is made again (Llama-3.2-1B full 1 × 1856, Qwen3-1.7B full 2 × 896: 0.9 and 1.0 GiB over the shapes beside
    them; at T ≤ H·b/8 the replay makes none). A bound: the count puts the states in all three fp32 blocks, the
    replay at some lengths only (the rests the gradients leave, not modelled). Fused AdamW makes no temporaries, so
    one V·H block is free there: optimizers.py ``fused_relaid_switch`` counts its fp32 block.
    """
    if train.optimizer not in _ADAM_INIT_GROUP or not p.step_temp_bytes:
        return 0
    hole, blocks = remade_blocks(m, train)
    fp32 = blocks[: len(logits_blocks(m, train)) - (1 if hole else 0)]
    if not fp32 or fp32[0] > _head_gradient(p):
        return 0
    held = 2 * (_head_gradient(p) // fp32[0])
    reached = blocks_with_states(p.state_bytes - beside, hole, fp32)
    return max(reached - held, 0) * fp32[0]


def at_tied_edge(m: ModelSpec, train: TrainSpec, p: StepParts) -> bool:
    """Whether an fp32 logits block is exactly the size F of a tied embedding's V·H gradient (4·V·T = V·H·b, that is
    4·T = H·b: 2048 tokens for H = 2048 and fp32 trainable weights, a common shape), the edge of runs.py's ``tied``
    switch (4·T < H·b), where ``tied_remade``'s rule still holds and ``full.tied_gradient_block``'s no longer does.

    What the allocator's rules do there (CUDACachingAllocator.cpp ``get_free_block``: the smallest free block at least
    as large; segments never merge), in the replays of the three checkpointed grid configs at the edge (Qwen3-1.7B
    bf16-mixed 2 × 1024, Llama-3.2-1B fp32 2 × 1024 and bf16-mixed 1 × 2048; ``bench/reserve/replay_states.jsonl``):
    step 1 makes six segments of F: the loss's three fp32 blocks, the embedding's ``embedding_dense_backward`` and
    AccumulateGrad's ``add`` (the chain's freed blocks hold gradients by then), and the foreach temporary
    (``_foreach_sqrt``). lm_head's V·H gradient is cut from a freed logits block, so ``Adam._init_group``
    (torch/optim/adam.py; the embedding is the first parameter) puts ``exp_avg`` there and ``exp_avg_sq`` in the
    dense gradient's block. Step 2's three logits requests then find the sum's block (freed by ``zero_grad``) and
    the temporary's, so one is made again only where the chain's two other blocks both hold something: the backward
    workspace and 32 MiB of states in Qwen3-1.7B's (1.16 GiB made again), states after the gradients in
    Llama-3.2-1B fp32's (24 and 424 MiB; 0.98 GiB made again); Llama-3.2-1B bf16-mixed 1 × 2048 leaves both whole
    and makes none. The gradient sum's own V·H request fits a freed logits block, so no V·H block is made again."""
    wb = p.weights
    fp32 = 4 * m.vocab_size * train.tokens
    return (
        m.tie_word_embeddings and wb.embedding_trainable and bool(logits_blocks(m, train)) and fp32 == _head_gradient(p)
    )
