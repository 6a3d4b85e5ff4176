"""Freeze fine-tuning (the last decoder layers train; the embedding and the head stay frozen): the fp32 logits blocks
step 2 makes again because step 1 left the backward thread's cuBLAS workspace, the trained layers' gradients and
AdamW's states in them.

Full fine-tuning's count (full.py ``relaid_counted``) does not carry over, for two reasons:
- without a trained head or embedding there is no V·H gradient block (or its foreach temporary's) to serve step 2's
  4·V·T request, so the rule that drops the term where 4·V·T ≤ V·H·b does not apply;
- the states of a few layers are about the size of the c·V·T block, so the other tenants of the chain decide how
  many fp32 blocks are reached: the workspace, which lands in the fp32 copy's block where no block forward freed
  holds it (workspace.py ``workspace_lost``, the same rule as with adapters), and, where no block the trained
  layers' activations free holds a decoder matrix's gradient, the gradients, cut from the chain in step 1's
  backward before the states come.
The trace replay of bench/reserve/'s mid model, 1 × 1024, bf16-mixed, two trained layers (S = 172 MiB of states,
c·V·T = 62.5 MiB, 4·V·T = 125 MiB): the workspace is cut from the fp32 copy's block, four 11 MiB states from the
c·V·T block and six from the copy's block beside the workspace; the other states take blocks that step 2's forward
needs for its saved activations, which are then cut from a third block. Step 2 makes two 126 MiB segments again:
1,264 MiB reserved, where the estimate had 1,094 (no reserve at all, −13.4%); S + workspace = 204 MiB spill
141.5 MiB past the c·V·T block: two fp32 blocks, 1,235 MiB (−2.3%). Over 22 traced freeze steps (0.5B to 3B shapes
and the mid model; checkpointing on and off; sdpa and eager; 1 to 3 blocks made again) the count is the replay's on
21; the mid model with eager attention makes two where one is counted (its states take the trained layers' 64 MiB
fp32 softmax blocks, and step 2's softmax, displaced whole, is cut from the logits blocks): not modelled.
"""

from __future__ import annotations

from collections.abc import Callable

from vramledger.allocator.conf import K_LARGE_BUFFER, K_SMALL_SIZE
from vramledger.analytic.parts import StepParts
from vramledger.analytic.reserve.full import (
    _ADAM_INIT_GROUP,
    blocks_with_states,
    decoder_mlp_width,
    remade_blocks,
)
from vramledger.analytic.reserve.workspace import cublas_workspace_block, workspace_rivals_per_token
from vramledger.specs import Attention, Loss, ModelSpec, TrainSpec


def frozen_head(train: TrainSpec, p: StepParts) -> bool:
    """Trained decoder layers whose per-parameter tensors are large-pool blocks, the embedding and the head frozen,
    AdamW (states created by ``Adam._init_group``) and the standard loss: the freeze method, modelled here."""
    wb = p.weights
    return (
        not train.adapters
        and wb.trainable_layers > 0
        and not (wb.embedding_trainable or wb.head_trainable)
        and wb.largest_trainable_numel * wb.trainable_dtype.bytes > K_SMALL_SIZE
        and train.optimizer in _ADAM_INIT_GROUP
        and train.loss is Loss.STANDARD
    )


def workspace_in_logits(m: ModelSpec, train: TrainSpec, p: StepParts) -> bool:
    """Whether the backward thread's cuBLAS workspace is cut from an fp32 logits block at ``train``'s shape.

    torch CublasHandlePool.cpp gives autograd's thread its own handle, whose workspace (``getChosenWorkspaceSize``) is
    allocated through the caching allocator at that thread's first matmul, lm_head's backward in step 1, and never
    freed. Then the c·V·T block holds the logits gradient's cast and the fp32 blocks are free; best fit
    (``get_free_block``) takes an fp32 one unless a block forward freed holds the workspace: the fp32 norm
    intermediates (4·H·T), under checkpointing the trained layers' c·I·T MLP intermediates (workspace.py
    ``workspace_rivals_per_token``; without checkpointing the trained layers' saved activations are cut from what
    the frozen layers freed), eager's scores and its fp32 softmax (as ``runs.switches_on`` has it for adapters).
    Only with a 16-bit compute dtype, as there. The replay: in the fp32 copy's block for the mid model at 1 × 1024
    and 2 × 1024 (with and without checkpointing), Qwen2.5-0.5B at 1 × 512 and 4 × 1024, Qwen2.5-1.5B at 1 × 4096,
    Llama-3.2-1B at 1 × 1024; elsewhere for Llama-3.2-1B at 2 × 2048 and Qwen2.5-1.5B at 2 × 1024 with
    checkpointing (c·I·T ≥ 32 MiB) and for the mid model with eager attention (a 64 MiB softmax block). With eager
    attention the rule is the adapters' and can miss: Llama-3.2-1B at 4 × 512 puts it in the copy's block (the
    trained layers' saved softmax took the frozen layers' freed ones), where the count is the same either way.
    """
    if train.precision.compute.bytes == 4:
        return False
    ws = cublas_workspace_block(p)
    rivals = max(workspace_rivals_per_token(m, train, p)) * train.tokens
    if train.attn is Attention.EAGER:
        scores = m.num_heads * train.seq_len * train.seq_len * train.micro_batch
        rivals = max(rivals, train.precision.compute.bytes * scores)
        return rivals < ws and 4 * scores <= ws
    return rivals < ws


def gradients_in_logits(m: ModelSpec, train: TrainSpec, p: StepParts) -> bool:
    """Whether step 1's backward cuts the trained layers' gradients from the logits chain's blocks: where every block
    the trained layers' activations free in backward (their saved c·I·T MLP tensors, or under checkpointing the
    recomputed layer's) is smaller than a decoder matrix's gradient (b·H·I), best fit (``get_free_block``) finds
    only the chain's blocks, free once lm_head's backward is done, the c·V·T block first. A gradient of at most
    20 MiB is left out: requests under 10 MiB share 20 MiB segments (``get_allocation_size``: kLargeBuffer below
    kMinLargeAlloc), and one whose blocks are all freed is a 20 MiB block again (``try_merge_blocks``), which holds it
    (the mid model, 11 MiB gradients: at 1 × 1536 the c·V·T block holds only states and step 2 makes one fp32 block
    again, not the two that counting its gradients gives). Llama-3.2-1B with checkpointing, 2 × 1984 (c·I·T =
    62 MiB under the 64 MiB gradient): step 2 makes an fp32 block again though the states (928 MiB) fit in the
    c·V·T block (971 MiB); at 2 × 2048 (c·I·T = 64 MiB) it makes none. Closed downwards in the shape."""
    c, b = train.precision.compute.bytes, p.weights.trainable_dtype.bytes
    I = decoder_mlp_width(m)  # noqa: E741
    grad_HI = b * m.hidden_size * I
    return grad_HI > K_LARGE_BUFFER and c * I * train.tokens < grad_HI


def chain_tenants(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """Bytes step 1 leaves in the logits chain's blocks, counted as if they all go there: AdamW's states (as
    ``blocks_with_states`` counts them for full fine-tuning: those cut from other blocks displace step 2's forward
    tensors, which are then cut from the chain), the workspace where it lands there (``workspace_in_logits``), and
    the gradients where no activation block holds them (``gradients_in_logits``). Those are made in step 1's
    backward, after lm_head's, when the chain's blocks are free; best fit cuts each from the smallest that holds
    it, the c·V·T block first; the states, made next, go on from where the gradients stopped (``zero_grad`` frees
    the gradients at the step's end, but the states sit past them). Llama-3.2-1B, 1 × 1024: the gradients fill the
    c·V·T block, the states reach all three fp32 blocks (256, 448 and 64 MiB of them), and step 2 makes the three
    again.
    """
    grads = p.grad_bytes if gradients_in_logits(m, train, p) else 0
    ws = cublas_workspace_block(p) if workspace_in_logits(m, train, p) else 0
    return p.state_bytes + grads + ws


def frozen_head_blocks(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """How many of the blocks step 2 needs whole (full.py ``remade_blocks``: the fp32 logits blocks, then eager's
    backward blocks) step 1 leaves a tenant in, at ``train``'s shape: those the chain's tenants reach past the c·V·T
    block (``blocks_with_states``), and at least the one holding the workspace.

    A block with a tenant cannot serve step 2's request of its own size (``get_free_block``: one free block at least
    that large; blocks of different segments never merge), and no freed V·H gradient block can either (none is
    trained), so each is made again, whole. Non-increasing as the micro-batch or the length grows (the blocks grow;
    the workspace's and the gradients' terms switch off), so the shapes where it is at least k are closed downwards
    (``frozen_head_regions``). It over-counts a block that only gradients reach (they are freed before step 2's
    forward): that needs G > c·V·T + 4·V·T, which the grid's configs never reach.
    """
    hole, blocks = remade_blocks(m, train)
    if not blocks:
        return 0
    reached = blocks_with_states(chain_tenants(m, train, p), hole, blocks)
    return max(reached, 1 if workspace_in_logits(m, train, p) else 0)


def frozen_head_relaid(m: ModelSpec, train: TrainSpec, p: StepParts, counted: bool) -> int:
    """The blocks step 2 makes again (term 2 of shape.py ``single_shape``): counted at this shape
    (``frozen_head_blocks``; a run with dynamic padding holds it over the shorter shapes, runs.py), or, where the
    shape's mechanisms are not counted (``Switching.relaid`` off), the bound min(S, the fp32 logits blocks) (full.py
    ``relaid_bytes``, without its V·H-gradient rule: no gradient of the head or the embedding exists)."""
    _, blocks = remade_blocks(m, train)
    if counted:
        return sum(blocks[: frozen_head_blocks(m, train, p)])
    fp32 = [x for x in blocks if x == 4 * m.vocab_size * train.tokens]
    return min(p.state_bytes, sum(fp32))


def frozen_head_regions(m: ModelSpec, train: TrainSpec, p: StepParts) -> list[Callable[[int, int], bool]]:
    """For each k ≥ 1, the shapes (b, ℓ) where step 2 makes at least k blocks again (``frozen_head_blocks``): sets
    closed downwards, for runs.py's ``held_reserved`` as full.py ``relaid_regions`` gives them for full
    fine-tuning."""
    _, blocks = remade_blocks(m, train)
    out: list[Callable[[int, int], bool]] = []
    for k in range(1, len(blocks) + 1):

        def on(b: int, ell: int, k: int = k) -> bool:
            return frozen_head_blocks(m, train.at_shape(b, ell), p) >= k

        out.append(on)
    return out
