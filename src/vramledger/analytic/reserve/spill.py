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

from functools import lru_cache

from vramledger.analytic.activations import computes_scores, sdpa_math
from vramledger.analytic.params import layer_linears
from vramledger.analytic.parts import StepParts
from vramledger.analytic.reserve.amp_layer import AmpLayer
from vramledger.analytic.reserve.forward_cache import _NAMES, _Layer, _leaf, _Replay, one_copy_weights
from vramledger.analytic.reserve.full import (
    _ADAM_INIT_GROUP,
    blocks_with_states,
    decoder_mlp_width,
    logits_blocks,
    remade_blocks,
)
from vramledger.analytic.reserve.gemma_layer import GemmaAmpLayer, GemmaLayer
from vramledger.analytic.reserve.held_activations import mlp_tensors_unfit
from vramledger.analytic.reserve.math_layer import MathLayer
from vramledger.analytic.reserve.workspace import cublas_workspace_block
from vramledger.specs import ModelSpec, Optimizer, TrainSpec


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


def displaced_remade(m: ModelSpec, train: TrainSpec, p: StepParts) -> int | None:
    """Bytes step 2 makes again up to its loss peak, full fine-tuning with AdamW without checkpointing, from
    the two steps written out and replayed through the allocator model at the step's own size; None where the
    sequence is not modelled (``_displacement_modelled``).

    Step 1's states are cut from the blocks backward freed (CUDACachingAllocator.cpp ``get_free_block``: the smallest
    cached block at least as large; ``alloc_found_block`` splits it), the forward's saved-activation segments before
    the logits chain's, larger. A segment with a state inside no longer holds the request it was made for, so in
    step 2 that request takes the next larger free block, whose own request takes the next, and so on up to the
    largest activation blocks (c·I·T), which land in the chain's blocks: the c·V·T block first, then an fp32 one
    (blocks of different segments never merge, ``try_merge_blocks``). Step 2's loss peak holds three fp32 blocks at
    once, so each fp32 block a state or a displaced activation sits in is made again, whole; where every one holds
    something the c·V·T logits block too. The mid toy model of bench/reserve/ at 4 × 1024, bf16-true: 360 MiB of
    states in the forward's 16 and 20 MiB segments displace 505.5 MiB of step 2's activations into the chain (fourteen
    22 MiB MLP blocks, nine 16 MiB fp32 norm inputs, six 8 MiB blocks), and two fp32 blocks are made again where the
    states alone (S − c·V·T = 0.69 of a block) reach one.

    The sequence (forward_cache.py ``_Layer``, ``trained``; under autocast with fp32 weights amp_layer.py's
    ``AmpLayer``, whose residual stream is fp32; Gemma 3's, gemma_layer.py): each decoder layer's forward as
    transformers' ``LlamaDecoderLayer`` (or ``Gemma3DecoderLayer``) runs it, the final norm, the standard loss's
    chain (``full.logits_blocks``), backward freeing each layer's saved tensors node by node, each weight's gradient
    made before its saved input goes (``_backward``), both threads' cuBLAS workspaces,
    ``Adam._init_group``'s ``exp_avg`` and ``exp_avg_sq`` parameter by parameter (torch/optim/adam.py), the foreach
    temporaries (``_foreach_sqrt``; fused AdamW makes none) made and freed, ``zero_grad`` freeing the gradients,
    then step 2's forward and its loss to the peak. Left out: the weights (segments of their own, never freed), the
    norms' weights (small pool), backward's transient activation gradients."""
    key = _displacement_key(m, train, p)
    return None if key is None else _two_steps(*key)[0]


def two_steps_reserve(m: ModelSpec, train: TrainSpec, p: StepParts) -> int | None:
    """Reserved at step 2's loss peak from the same replay (``displaced_remade``): the weights' bytes (segments of
    their own from the load, never freed) and what the two steps' sequence reserves by then: step 1's forward
    segments, the chain's, what step 1's gradients, states and foreach temporaries needed beyond them (the
    temporaries get segments of their own only where the cache has no block left for them: Qwen2.5-1.5B full,
    bf16-mixed, 4 × 1024, whose states fill the chain's blocks), and what step 2 makes again. None where the sequence
    is not modelled."""
    key = _displacement_key(m, train, p)
    if key is None:
        return None
    return p.frozen_bytes + p.trainable_bytes + p.master_bytes + _two_steps(*key)[1]


def replayed_setup(m: ModelSpec, train: TrainSpec, p: StepParts) -> bool:
    """Whether some shape of the setup may have its two steps replayed (``_displacement_modelled`` and the
    projections' names, less what depends on the shape): runs.py's envelope of a run with dynamic padding searches
    its shapes only there."""
    return (
        _written_out(m, train, p)
        and train.optimizer in (Optimizer.ADAMW, Optimizer.ADAMW_FUSED)
        and train.world_size == 1
        and bool(p.step_temp_bytes) == (train.optimizer is Optimizer.ADAMW)
        and {_leaf(lin.name) for lin in layer_linears(m)} == set(_NAMES)
    )


def _displacement_modelled(m: ModelSpec, train: TrainSpec, p: StepParts) -> bool:
    """The sequence (``sequence_modelled``) with AdamW (foreach, with its temporaries, or fused, without), on one
    process, the MLP's per-parameter tensors fitting its blocks; SDPA without length² blocks, or in fp32 SDPA's math
    kernel (math_layer.py ``MathLayer``: its 3.5 and 7 MiB requests share 20 MiB segments as the trace has them,
    within 3% of the traced replay from 1,024 to 4,096 tokens, bench/reserve/fp32_math.jsonl). At any size of the
    residual stream's requests: under 10 MiB (kMinLargeAlloc) they share 20 MiB segments, which the sequence lays out
    as the trace does once each layer's input lives to the layer's end (``_Layer.held_by_caller``): the packed
    shapes of bench/reserve/two_steps.jsonl under 10 MiB (Qwen2.5-0.5B, Qwen3-0.6B, Llama-3.2-1B; bf16-true and
    bf16-mixed) replayed within 1.0% of their traces (docs/reserve.md, "Under 10 MiB")."""
    wb = p.weights
    c = train.precision.compute.bytes
    math = _math_kernel(m, train)
    return (
        _written_out(m, train, p)
        and (not computes_scores(m, train) or math)
        and train.optimizer in (Optimizer.ADAMW, Optimizer.ADAMW_FUSED)
        and train.world_size == 1  # one process: no DDP buckets (distributed/ddp_reserve.py has them)
        and bool(p.step_temp_bytes) == (train.optimizer is Optimizer.ADAMW)
        and not mlp_tensors_unfit(c, wb.trainable_dtype.bytes, m.hidden_size, decoder_mlp_width(m), train.tokens)
    )


def sequence_modelled(m: ModelSpec, train: TrainSpec, p: StepParts) -> bool:
    """What the two steps written out with Llama's layer cover (distributed/ddp_reserve.py's replay among them):
    full fine-tuning (every layer trained, the head and the embedding too), no checkpointing, the standard loss,
    Llama-named projections, whole weights, no FSDP and no ZeRO partitions of the states (the attention's length²
    blocks are the caller's to rule out or write out)."""
    return m.family in _LLAMA_LAYERS and _one_full_step(m, train, p)


def _written_out(m: ModelSpec, train: TrainSpec, p: StepParts) -> bool:
    """``sequence_modelled``, or Gemma 3's layer (gemma_layer.py) in bf16 compute (bf16-true, or bf16-mixed's
    autocast), no layer repeating K/V at any length (one K/V head, or as many as the query heads)."""
    if not _gemma(m):
        return sequence_modelled(m, train, p)
    c = train.precision.compute.bytes
    return c == 2 and not 1 < m.num_kv_heads < m.num_heads and _one_full_step(m, train, p)


def _gemma(m: ModelSpec) -> bool:
    return m.family in _GEMMA_LAYERS


def _one_full_step(m: ModelSpec, train: TrainSpec, p: StepParts) -> bool:
    wb = p.weights
    return (
        not train.adapters
        and not train.grad_ckpt
        and train.fsdp is None
        and train.zero_stage == 0
        and not (train.offload_optimizer or train.offload_activations or train.optimizer_in_backward or train.compile)
        and not train.images
        and one_copy_weights(train)
        and not m.is_moe
        and bool(logits_blocks(m, train))
        and wb.trainable_layers == m.num_layers
        and wb.embedding_trainable
        and bool(p.state_bytes)
    )


def _math_kernel(m: ModelSpec, train: TrainSpec) -> bool:
    """fp32 layers whose attention runs SDPA's math kernel (activations.py ``sdpa_math``), written out by
    math_layer.py's ``MathLayer``."""
    return sdpa_math(m, train) and train.precision.compute.bytes == 4 and not train.precision.mixed


# Decoder layers the sequence writes out (transformers' LlamaDecoderLayer: two RMSNorms, SiLU-gated MLP; Mistral's and
# Qwen2's and Qwen3's are the same, Qwen3 with q_norm and k_norm); Gemma 3's text decoder (four norms, GELU, the scaled
# embedding, sliding layers) is gemma_layer.py's. Gemma 2 caps its attention logits, which SDPA refuses: eager only.
_LLAMA_LAYERS = ("llama", "mistral", "qwen2", "qwen3")
_GEMMA_LAYERS = ("gemma3_text",)


# ``_two_steps``' arguments: the model, its layer's projections (name, in, out), c, the bytes an element of the
# gradient, of one state and of the temporary, autocast's weight copies, T, one cuBLAS workspace, (B, L) for the layers
# that need it (SDPA's math kernel's length² blocks, Gemma 3's sliding mask) or (0, 0)
_Key = tuple[ModelSpec, tuple[tuple[str, int, int], ...], int, tuple[int, int, int], bool, int, int, tuple[int, int]]


def _displacement_key(m: ModelSpec, train: TrainSpec, p: StepParts) -> _Key | None:
    if not _displacement_modelled(m, train, p):
        return None
    shapes = tuple((_leaf(lin.name), lin.in_features, lin.out_features) for lin in layer_linears(m))
    if {name for name, _, _ in shapes} != set(_NAMES):
        return None
    wb = p.weights
    n = max(wb.trainable_params, 1)
    # bytes an element of each per-parameter tensor (AdamW's two states in one, the gradient, the temporary)
    per = (p.grad_bytes // n, p.state_bytes // (2 * n), p.step_temp_bytes // n)
    c = train.precision.compute.bytes
    cast = train.precision.mixed and c < wb.trainable_dtype.bytes
    by_shape = _math_kernel(m, train) or _gemma(m)
    batch = (train.micro_batch, train.seq_len) if by_shape else (0, 0)
    return (m, shapes, c, per, cast, train.tokens, cublas_workspace_block(p), batch)


@lru_cache(maxsize=1024)
def _two_steps(
    m: ModelSpec,
    shapes: tuple[tuple[str, int, int], ...],
    c: int,
    per: tuple[int, int, int],
    cast: bool,
    T: int,
    workspace: int,
    batch: tuple[int, int] = (0, 0),
) -> tuple[int, int]:
    """``displaced_remade``'s replay: what step 2 reserves beyond step 1's cache up to its loss peak, and the
    sequence's reserve there."""
    r = _Replay()
    by_name = {name: (i, o) for name, i, o in shapes}
    layer: _Layer
    if _gemma(m):
        gemma = GemmaAmpLayer if cast else GemmaLayer
        layer = gemma(r, m, by_name, c, batch=batch[0], seq_len=batch[1])
    elif batch[0]:
        layer = MathLayer(r, m, by_name, batch=batch[0], seq_len=batch[1])
    elif cast:
        layer = AmpLayer(r, m, by_name, c, tokens=T)
    else:
        layer = _Layer(r, m, set(), by_name, c, False, tokens=T, trained=True)
    VH, L = m.vocab_size * m.hidden_size, m.num_layers
    params = [VH] + [i * o for _, i, o in shapes] * L + ([] if m.tie_word_embeddings else [VH])
    grad_b, state_b, temp_b = per
    r.alloc(workspace)  # the forward thread's cuBLAS workspace, at its first matmul (never freed)
    grads = forward_backward(layer, grad_b, workspace)
    # step 1's optimizer: Adam._init_group's states, parameter by parameter; the foreach temporaries; zero_grad
    for n in params:
        r.alloc(n * state_b)
        r.alloc(n * state_b)
    for i in [r.alloc(n * temp_b) for n in params if temp_b]:  # fused AdamW makes none
        r.free(i)
    for i in grads:
        r.free(i)
    before = r.model.reserved
    _forward(layer, L)
    _loss(r, m, c, T, cast)
    return r.model.reserved - before, r.model.reserved


def forward_backward(layer: _Layer, grad_b: int, workspace: int | None) -> list[int]:
    """One step's forward, loss and backward: the loss's chain, lm_head's gradient, then each layer's
    (``_backward``), the embedding's last (with a tied embedding, AccumulateGrad's sum of its two); returns the
    gradients' blocks. ``workspace``: the backward thread's cuBLAS workspace, made at lm_head's backward in step 1
    (None from step 2 on: the handle keeps it)."""
    r, m, c, T = layer.r, layer.m, layer.c, layer.T
    VH = m.vocab_size * m.hidden_size
    groups = _forward(layer, m.num_layers)
    *weight_cast, log_softmax, nll_grad, grad = _loss(r, m, c, T, layer.weight_casts)
    r.free(log_softmax)
    r.free(nll_grad)
    if c != 4:  # the logits' gradient cast to c bytes for lm_head's backward: the c·V·T block
        r.free(grad)
        grad = r.alloc(c * m.vocab_size * T)
    if workspace is not None:
        r.alloc(workspace)
    grads = [r.alloc(VH * grad_b)]
    for i in (grad, *weight_cast):
        r.free(i)
    *layers, final = groups
    for i in final:
        r.free(i)
    for group in reversed(layers):
        grads += _backward(layer, group, grad_b)
    embedding_gradients(r, m, grads, grad_b)
    return grads


def embedding_gradients(r: _Replay, m: ModelSpec, grads: list[int], grad_b: int) -> None:
    """The embedding's gradient, last in backward (``embedding_dense_backward``), appended to ``grads`` (lm_head's
    first); with a tied embedding AccumulateGrad's out-of-place sum of the two, which frees both."""
    VH = m.vocab_size * m.hidden_size
    grads.append(r.alloc(VH * grad_b))
    if m.tie_word_embeddings:
        grads.append(r.alloc(VH * grad_b))
        r.free(grads.pop(0))
        r.free(grads.pop(-2))


def _backward(layer: _Layer, saved: list[int], grad_b: int) -> list[int]:
    """One decoder layer's step-1 backward: its saved tensors freed node by node, each projection's weight gradient
    made before its saved input goes; returns the gradients' blocks.

    Autograd frees a node's saved tensors once the node has run (torch/csrc/autograd/engine.cpp ``evaluate_function``:
    ``fn.release_variables()`` after ``call_function`` unless ``keep_graph_``) and runs the nodes in the reverse of the
    order forward made them; a saved tensor is released by the last node using it, so the layer's saved tensors go in
    the reverse of their allocation order, and ``mm``'s backward makes the weight's gradient from the saved input
    before that input goes (down_proj's from the MLP's product, gate's and up's from the post-attention norm's output,
    o_proj's from SDPA's output, q's, k's and v's from the input norm's; ``layer.inputs``). So the MLP's and the
    post-attention norm's blocks are free when the attention's gradients are made: in the trace of Qwen3-4B full,
    bf16-true, 2 × 2048 (docs/reserve.md) o_proj's and q_proj's 20 MiB gradients are cut from the 20 MiB halves the
    norms' c·H·T tensors free in the 40 MiB fp32 segments (best fit, CUDACachingAllocator.cpp ``get_free_block``),
    which leaves the rests beside the MLP gradients free for ``Adam._init_group``'s q and o states. Freeing the whole
    layer after all seven gradients put those gradients in the rests instead (their states went elsewhere, and step 2
    found 29 more of its 76 MiB MLP blocks whole than the trace: −3.4% of its reserve). Backward's own transients
    (activation gradients) are left out."""
    r, sizes = layer.r, {name: fin * fout for name, (fin, fout) in layer.shapes.items()}
    grads = []
    for i in sorted(saved, reverse=True):  # block ids grow in allocation order
        grads += [r.alloc(sizes[name] * grad_b) for name in reversed(layer.inputs.get(i, ()))]
        r.free(i)
    return grads


def _forward(layer: _Layer, layers: int) -> list[list[int]]:
    """One forward's saved tensors, by layer (the embedding's output with the first), the final norm's last; the
    residual stream's blocks the model's code holds freed where it drops them (``_Layer.held_by_caller``)."""
    r = layer.r
    start, ends = r.count, []
    x = embedded = layer.embed()
    held = layer.held_by_caller  # each input freed as the loop rebinds it, the embedding's at the model's return
    for _ in range(layers):
        out = layer.forward(x, False)
        if held and x != embedded:
            r.free(x)
        x = out
        ends.append(r.count)
    layer.final_norm()
    if held:
        r.free(x)
    layer.forward_done()
    if held:
        r.free(embedded)
    groups: list[list[int]] = [[] for _ in range(layers + 1)]
    for i in (i for i in r.live if i > start):
        groups[next((k for k, end in enumerate(ends) if i <= end), layers)].append(i)
    return groups


def _loss(r: _Replay, m: ModelSpec, c: int, T: int, cast: bool) -> list[int]:
    """The standard loss to its peak (``full.logits_blocks``): lm_head's autocast weight copy (``cast``) and the
    c·V·T logits (c < 4), the fp32 copy and log-softmax, the logits and the copy freed, ``nll_loss_backward``'s and
    ``_log_softmax_backward_data``'s fp32 gradients; returns the blocks live there."""
    V, H = m.vocab_size, m.hidden_size
    live = [r.alloc(c * V * H)] if cast else []
    logits = r.alloc(c * V * T) if c != 4 else None
    copy, log_softmax = r.alloc(4 * V * T), r.alloc(4 * V * T)
    if logits is not None:
        r.free(logits)
    r.free(copy)
    return [*live, log_softmax, r.alloc(4 * V * T), r.alloc(4 * V * T)]
