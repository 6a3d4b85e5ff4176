"""Optimizers other than foreach AdamW: without step temporaries (SGD, fused AdamW, the 8-bit ones) the step's
reserve is set at the end of backward; Adafactor's temporaries get segments of their own where they cannot pair up
in the logits blocks (docs/reserve.md "Optimizers other than foreach AdamW")."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from vramledger.allocator.conf import K_SMALL_SIZE, allocation_size, round_size
from vramledger.analytic.activations import computes_scores
from vramledger.analytic.params import in_layers, layer_linears
from vramledger.analytic.parts import StepParts, embedding_gradient_before_accumulation, tied_gradient_sum
from vramledger.analytic.reserve.ckpt_forward import forward_block_width, forward_left_free
from vramledger.analytic.reserve.forward_cache import _Replay
from vramledger.analytic.reserve.freeze import workspace_in_logits
from vramledger.analytic.reserve.full import activations_unused, decoder_mlp_width, held_room, logits_blocks
from vramledger.analytic.reserve.switches import Switching
from vramledger.analytic.reserve.workspace import cublas_workspace_block
from vramledger.specs import Loss, ModelSpec, Optimizer, TrainSpec

# Optimizers whose step makes no temporaries (SGD, fused AdamW, the 8-bit ones): the step's last allocations are not
# in ``optimizer.step()`` but at the end of backward, where a tied embedding's gradient and its sum with lm_head's
# are live beside every gradient and state (analytic/parts.py ``tied_gradient_sum``). What the blocks freed before
# then cannot hold stays cached there: the bench's replays of SGD and fused AdamW put the step's peak reserved at
# that moment (bench/reserve/replay_causes.jsonl; docs/reserve.md "Optimizers other than foreach AdamW").


def end_of_backward_bound(m: ModelSpec, train: TrainSpec, p: StepParts, opt_peak: int, on: Switching) -> int:
    """Reserved at the end of backward for full fine-tuning with an optimizer that makes no step temporaries (0
    otherwise: a foreach step's temporaries make its own moment the larger, term 3 of ``single_shape``).

    Allocated there: the optimizer's moment (weights, gradients, states) plus the embedding's new V×H gradient and
    the tied sum (analytic/step.py ``_end_of_backward``). Cached and free:
    the saved activations where they are too small for a decoder matrix's gradient (``on.activations``, as in term
    3: backward has freed them all by then), the autocast copies no per-parameter tensor fits (``casts_unused``) or,
    under checkpointing where the MLP's per-parameter tensors fit no block of the forward's
    (``on.checkpointed_forward``), every segment the checkpointed forward made but what such tensors fill
    (ckpt_forward.py ``forward_left_free``: the copies among them),
    and with states the fp32 logits block step 2 makes again (``_relaid_without_temporaries``, ``on.fused_relaid``:
    it stops where 4·V·T outgrows the V·H gradient, so it switches off as the shape grows).
    """
    wb = p.weights
    if p.step_temp_bytes or train.adapters or wb.largest_trainable_numel * wb.trainable_dtype.bytes <= K_SMALL_SIZE:
        return 0
    allocated = opt_peak + embedding_gradient_before_accumulation(m, train, p) + tied_gradient_sum(m, train, p)
    casts = casts_unused(m, train, p)
    if on.checkpointed_forward:
        casts = max(casts, forward_left_free(m, train, p))
    cached = (activations_unused(m, train, p) if on.activations else 0) + casts
    return allocated + cached + (_relaid_without_temporaries(m, train, p) if on.fused_relaid else 0)


def _relaid_without_temporaries(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """One fp32 logits block (4·V·T) step 2 makes again when step 1's optimizer created states and freed no
    temporaries (fused AdamW), where 4·V·T is no larger than the V·H gradient (above it ``relaid_bytes`` counts
    them all).

    The states take the cached blocks best fit gives them (``_init_group``, after step 1's backward), the activation
    blocks among them; step 2's forward, finding fewer, cuts its activations and casts from the logits chain's bf16
    blocks, whose own requests then take the fp32 ones: the fp32 log-softmax finds no block left and gets a new
    segment, cached and nearly free at the end of backward (the replay of Llama-3.2-1B full, fused AdamW, 2 × 1024:
    made in step 2's forward, 0.79 of its 0.98 GiB free there). A foreach step's temporaries, freed after it, leave
    V·H blocks that serve it instead. Without states (SGD) step 2 finds step 1's blocks as step 1 left them.
    """
    fp32 = [x for x in logits_blocks(m, train) if x == 4 * m.vocab_size * train.tokens]
    head = p.weights.lm_head_weight_numel * p.weights.trainable_dtype.bytes
    if not p.state_bytes or not fp32 or fp32[0] > head:
        return 0
    return fp32[0]


def fused_relaid_switch(m: ModelSpec, train: TrainSpec, p: StepParts) -> Callable[[int, int], bool] | None:
    """Where ``_relaid_without_temporaries`` is on: 4·V·b·ℓ no larger than the head's V·H gradient, for full
    fine-tuning with states and no step temporaries under the standard loss (None: never). Beyond that edge the
    block is no longer made again (``relaid_bytes`` takes over with its own count), so the figure falls as the shape
    grows: a run with dynamic padding holds it from its shorter shapes (runs.py), a packed run counts it where it
    is on at its shape (Qwen2.5-0.5B, fp32, fused AdamW, 1 × 449: 8.69 GiB reserved, where 1 × 897 gave 8.59)."""
    wb = p.weights
    if p.step_temp_bytes or not p.state_bytes or train.adapters or train.loss is not Loss.STANDARD:
        return None
    if wb.largest_trainable_numel * wb.trainable_dtype.bytes <= K_SMALL_SIZE or not logits_blocks(m, train):
        return None
    V, head = m.vocab_size, wb.lm_head_weight_numel * wb.trainable_dtype.bytes

    def fused_relaid(b: int, ell: int) -> bool:
        return 4 * V * b * ell <= head

    return fused_relaid


def checkpointed_forward_switch(m: ModelSpec, train: TrainSpec, p: StepParts) -> Callable[[int, int], bool] | None:
    """Where ``forward_left_free`` is counted at the end of backward: full fine-tuning under checkpointing with an
    optimizer without step temporaries (``end_of_backward_bound``), SDPA (eager's score blocks, larger than the
    MLP's, are not among the forward's blocks ``forward_left_free`` sizes), and the segment of the forward's largest
    block (c·I·b·ℓ, ckpt_forward.py ``forward_block_width``) under an MLP matrix's per-parameter tensor (b·H·I, as
    held_activations.py ``mlp_tensors_unfit``; None: never).
    Beyond that edge the MLP gradients fit the transients' blocks, and the bound falls as the shape grows: a run with
    dynamic padding holds it from its shorter shapes (runs.py), a packed run counts it where it is on at its shape."""
    wb = p.weights
    if not train.grad_ckpt or p.step_temp_bytes or train.adapters or computes_scores(m, train):
        return None
    if wb.largest_trainable_numel * wb.trainable_dtype.bytes <= K_SMALL_SIZE or not wb.trainable_layers:
        return None
    c, mlp = train.precision.compute.bytes, wb.trainable_dtype.bytes * m.hidden_size * decoder_mlp_width(m)
    width = forward_block_width(m, c)

    def checkpointed_forward(b: int, ell: int) -> bool:
        return held_room(c * width * b * ell) < mlp

    return checkpointed_forward


def casts_unused(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """Blocks of autocast's copies of the trained decoder matrices that no gradient, state or temporary can use.

    Under AMP with fp32 trained weights, autocast caches a c-byte copy of each one for the whole forward (torch
    autocast_mode.cpp ``cached_cast``; analytic/step.py ``_autocast_casts``) and frees them all when forward ends.
    Each is half its matrix's fp32 gradient (c/b), so only the per-parameter tensors of the matrices whose b-byte
    size is at most the largest copy fit in those blocks (Llama: q, k, v and o's in the MLP's copies); the rest of
    the copies' bytes stay cached while the gradients of the larger matrices make segments of their own
    (Llama-3.2-1B full SGD with checkpointing, 2 × 1024: 1.4 GiB of 32 MiB blocks free at backward's end).
    """
    wb = p.weights
    c, b = train.precision.compute.bytes, wb.trainable_dtype.bytes
    if not train.precision.mixed or c >= b or not wb.trainable_layers:
        return 0
    mats = [
        (lin.in_features * lin.out_features, lin.per_layer * min(in_layers(m, lin), wb.trainable_layers))
        for lin in layer_linears(m)
    ]
    largest = max((n for n, _ in mats), default=0)
    copies = sum(c * n * k for n, k in mats)
    fitting = sum(b * n * k for n, k in mats if b * n <= c * largest)
    per_parameter = 1 + round(p.state_bytes / max(p.grad_bytes, 1))  # a gradient and its states
    return max(copies - per_parameter * fitting, 0)


# transformers ``Adafactor.step`` works one parameter at a time (analytic/optimizer.py): with the V×H embedding (the
# first parameter, and the largest) it holds k fp32 temporaries of t = 4·n bytes at once, k = 4 with 16-bit
# parameters (2 with fp32). They are made after backward has freed the logits chain, so best fit puts them in its
# three fp32 4·V·T blocks, two to a block where 4·V·T ≥ 2·t. Below that the temporaries cannot pair up, and the
# replay (Llama-3.2-1B full, bf16-true, Adafactor, checkpointing, 2 × ℓ: bench/reserve/runs.jsonl) shows the step
# with k segments of t of its own over the two steps: step 1's gradients fill the chain's blocks, so the step makes
# segments for its temporaries, and step 2's gradients, best fit, are cut from those (the smallest blocks that hold
# them) while the temporaries take the chain's blocks and a new one: at 2 × 1984 reserved = the loss's 9.54 GiB + 4
# · 0.98 GiB (13.46 GiB), against 10.75 GiB at 2 × 2048, where the chain's 2·t blocks hold them. The reserve above
# the analytic loss bound (loss peak + stranded) is 3.6·t to 3.8·t at every length from 2 × 1024 to 2 × 1984 (the
# bound over-counts the checkpointed layer's transients by about 0.4·t), 3.6·t to 4.7·t below, 0.6·t at 2 × 2048.
# It switches off as the shape grows, like the three mechanisms above (``Switching.temporaries``): a packed run's
# estimate counts it where it is on at its shape, a run with dynamic padding holds it at the edge of the shapes
# where it is on.


def temporaries_switch(m: ModelSpec, train: TrainSpec, p: StepParts) -> Callable[[int, int], bool] | None:
    """Where the step's k temporaries of t bytes cannot pair up in the fp32 logits blocks: the 4·V·T segment (its
    cudaMalloc size, ``get_allocation_size``: rounded up to 2 MiB) under 2·t (None: never, or not an optimizer that
    steps one tensor at a time with temporaries of its own). The rounding matters: at 2 × 2047 tokens 4·V·T is 1 MiB
    under 2·t for Llama-3.2-1B, its segment exactly 2·t, and the replay reserves the 2 × 2048 figure."""
    t = _step_temporary(m, train, p)
    if not t or train.loss is not Loss.STANDARD or not logits_blocks(m, train):
        return None
    V = m.vocab_size

    def temporaries(b: int, ell: int) -> bool:
        return allocation_size(round_size(4 * V * b * ell)) < 2 * round_size(t)

    return temporaries


def _step_temporary(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """t: one of Adafactor's fp32 temporaries of the largest trained tensor, 4·n (0 for other optimizers, for
    adapters, whose tensors live in the small pool, and without step temporaries)."""
    wb = p.weights
    if train.optimizer is not Optimizer.ADAFACTOR or train.adapters or not p.step_temp_bytes:
        return 0
    if wb.largest_trainable_numel * wb.trainable_dtype.bytes <= K_SMALL_SIZE:
        return 0
    return 4 * wb.largest_trainable_numel


def temporaries_bound(m: ModelSpec, train: TrainSpec, p: StepParts, loss_reserved: int, on: Switching) -> int:
    """Where Adafactor's temporaries cannot pair up (``on.temporaries``): the loss's reserve (``loss_reserved``, term
    1's loss peak + stranded) plus k segments of t made for them (see above); where they pair up but the tied
    gradients' sum leaves too few rests of t (``on.tied_sum``), plus the segments step 1's optimizer makes for them
    (``tied_sum_segments``); 0 otherwise."""
    t = _step_temporary(m, train, p)
    if not t:
        return 0
    if on.temporaries:
        return loss_reserved + p.step_temp_bytes // t * t
    return loss_reserved + tied_sum_segments(m, train, p) if on.tied_sum else 0


# Where the temporaries pair up (the fp32 4·V·T segment at least 2·t), a trained tied embedding still takes room in
# the chain's blocks before them, under checkpointing. The replay of Llama-3.2-1B full, bf16-true, Adafactor, 2 × 2048
# (bench/reserve/packed_adafactor.jsonl; 4·V·T = 2·t = 4·g, g the 16-bit V×H gradient): step 1's backward cuts the
# logits gradient's 16-bit cast from the c·V·T block, the backward thread's cuBLAS workspace (where no forward block
# holds it, freeze.py ``workspace_in_logits``) and lm_head's g from the fp32 copy's block (the older of the free fp32
# blocks, best fit: CUDACachingAllocator.cpp ``get_free_block`` orders equal sizes by address); the recomputed layers'
# gradients then fill the c·V·T block (the smallest free block that holds them once the cast is freed) and spill into
# the copy's; ``embedding_dense_backward``'s g follows them, and AccumulateGrad's out-of-place sum of the two
# (torch/csrc/autograd/input_buffer.cpp ``accumulate``: ``old_var + var``) finds no rest of g left in the copy's block
# and is cut from the start of the log-softmax's: 1.5·t is left there, one temporary's room, not two.
# transformers ``Adafactor.step`` (optimization.py) steps the embedding first with four fp32 temporaries live at once
# (``grad.float()``, ``p_data_fp32.float()``, ``grad**2`` and ``+ eps``, then ``_approx_sq_grad``'s product, then
# ``-update``): three find a block, the fourth gets a segment of its own (10.75 GiB reserved, 9.77 before the step).
# At 2 × 2304 the copy's block holds the sum beside the other two and the temporaries pair up in the other two blocks.


def tied_sum_segments(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """Bytes of the segments step 1's ``Adafactor.step`` makes for the embedding's fp32 temporaries beside the tied
    gradients' sum and the layers' gradients in the logits chain (see above; 0 where ``tied_sum_switch`` is None).

    The blocks replayed through the allocator model in program order (``_tied_sum_replay``): the chain's free blocks
    after step 1's loss, the workspace and lm_head's gradient, every trained layer's gradients in backward order, the
    embedding's gradient and the sum, the two V×H gradients freed, then the temporaries as ``Adafactor.step`` makes and
    frees them. It errs towards more segments: every layer gradient is counted in the chain, where the replays put 0.37
    to 0.42 GiB of Llama-3.2-1B's 1.81 GiB in the forward's blocks; but they also leave the recomputed layers'
    transients freed between the gradients in the copy's block (0.10 to 0.29 GiB) and part of the c·V·T block free
    (0.02 to 0.19 GiB), so the span counted in the copy's block is 70 to 104 MiB over the replay's at 2 × 2048,
    2 × 2176, 2 × 2304 and 2 × 2560 (bench/reserve/packed_adafactor.jsonl). Against the replays: the same segments at
    Llama-3.2-1B 2 × 2048, 1 × 4096, 4 × 1024 and 2 × 2176; one t more at 2 × 2240 (the count's edge is 4,574 tokens,
    the replay's between 4,352 and 4,480) and at Llama-3.2-3B 1 × 6144, whose larger forward blocks hold more of its
    5.25 GiB of layer gradients (at 1 × 6656 the replay's step 2 makes the second segment the count has in step 1)."""
    if tied_sum_switch(m, train, p) is None:
        return 0
    return _tied_sum_replay(*_tied_sum_key(m, train, p))


def tied_sum_switch(m: ModelSpec, train: TrainSpec, p: StepParts) -> Callable[[int, int], bool] | None:
    """Where ``tied_sum_segments`` makes a segment at (b, ℓ), for full fine-tuning with Adafactor of a model with a
    trained tied embedding, under checkpointing (backward frees only the recomputed layer's blocks, so the layers'
    gradients land in the chain: ``full.gradients_in_chain``), with the standard loss (None: never). A longer
    batch brings larger chain blocks, which hold the sum beside the other two V×H gradients, so it switches off as the
    shape grows: a packed run counts it where it is on at its shape, a run with dynamic padding holds it at the edge
    (runs.py), where ``temporaries_switch``'s region, below it, adds more."""
    wb = p.weights
    t = _step_temporary(m, train, p)
    if not t or not train.grad_ckpt or train.loss is not Loss.STANDARD or not logits_blocks(m, train):
        return None
    if not (m.tie_word_embeddings and wb.embedding_trainable) or m.is_moe or not wb.trainable_layers:
        return None

    def tied_sum(b: int, ell: int) -> bool:
        at = train.at_shape(b, ell)
        return _tied_sum_replay(*_tied_sum_key(m, at, p)) > 0

    return tied_sum


def _tied_sum_key(
    m: ModelSpec, train: TrainSpec, p: StepParts
) -> tuple[tuple[int, ...], int, int, tuple[int, ...], int, int]:
    """``_tied_sum_replay``'s arguments at ``train``'s shape: the chain's blocks, the workspace in the copy's block (0
    where a forward block holds it), the V×H gradient g, the layers' gradients in backward order, one temporary t and
    the fp32 copies ``Adafactor.step`` makes of a 16-bit parameter and its gradient."""
    wb = p.weights
    b = wb.trainable_dtype.bytes
    ws = cublas_workspace_block(p) if workspace_in_logits(m, train, p) else 0
    layer = [b * lin.in_features * lin.out_features for lin in reversed(layer_linears(m)) for _ in range(lin.per_layer)]
    t = _step_temporary(m, train, p)
    copies = p.step_temp_bytes // t - 2
    return logits_blocks(m, train), ws, b * m.vocab_size * m.hidden_size, tuple(layer * wb.trainable_layers), t, copies


@lru_cache(maxsize=4096)
def _tied_sum_replay(chain: tuple[int, ...], ws: int, g: int, grads: tuple[int, ...], t: int, copies: int) -> int:
    """Reserved bytes the temporaries add to a cache that holds only the chain's blocks (``tied_sum_segments``);
    ``copies``: ``grad.float()`` and ``p.float()`` of a 16-bit parameter (none for fp32)."""
    r = _Replay()
    *hole, copy, log_softmax, backward_data = chain
    # step 1's loss (transformers ``ForCausalLMLoss``): the logits, their fp32 copy and the log-softmax, each a
    # segment; the logits and the copy freed before backward, whose first gradient is cut from the copy's block
    logits = [r.alloc(x) for x in hole]
    fp32 = [r.alloc(copy), r.alloc(log_softmax)]
    for i in logits + fp32[:1]:
        r.free(i)
    nll = r.alloc(copy)
    grad = r.alloc(backward_data)
    r.free(nll)
    r.free(fp32[1])
    cast = [r.alloc(x) for x in hole]  # the logits gradient's cast for lm_head's backward
    r.free(grad)
    head = [r.alloc(x) for x in (ws, g) if x]  # the workspace (never freed) and lm_head's gradient
    for i in cast:
        r.free(i)
    for x in grads:
        r.alloc(x)
    embedding = r.alloc(g)
    r.alloc(g)  # AccumulateGrad's sum of the head's and the embedding's gradients
    r.free(head[-1])
    r.free(embedding)
    before = r.model.reserved
    for _ in range(copies):
        r.alloc(t)
    square, update = r.alloc(t), r.alloc(t)  # grad**2, then + eps
    r.free(square)
    r.alloc(t)  # _approx_sq_grad's product, while the old update lives
    r.free(update)
    r.alloc(t)  # -update
    return r.model.reserved - before
