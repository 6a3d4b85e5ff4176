"""Peak reserved of one steady-state shape, in closed form: the largest of the lower bounds the allocator's rules
give (``single_shape``), and the blocks stranded at the loss's backward peak (``stranded_bytes``)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from vramledger.allocator.conf import K_MIN_LARGE_ALLOC, K_ROUND_LARGE, K_SMALL_SIZE
from vramledger.analytic.activations import computes_scores, residual_bytes
from vramledger.analytic.parts import StepParts
from vramledger.analytic.reserve.ckpt_forward import eager_scores_segments, forward_segments
from vramledger.analytic.reserve.eager_ckpt import eager_checkpointed_stranded
from vramledger.analytic.reserve.forward_cache import (
    adapter_forward_cache,
    checkpointed_forward_cache,
    spilled_chain_blocks,
)
from vramledger.analytic.reserve.freeze import frozen_head, frozen_head_relaid, workspace_in_logits
from vramledger.analytic.reserve.full import (
    decoder_mlp_width,
    eager_backward_segments,
    gradients_in_chain,
    logits_blocks,
    relaid_bytes,
    relaid_counted,
    states_in_logits,
    temporaries_unused_by_activations,
    tied_gradient_block,
)
from vramledger.analytic.reserve.held_activations import optimizer_peak_bound
from vramledger.analytic.reserve.load_residue import load_tails, loss_tails, optimizer_tails
from vramledger.analytic.reserve.optimizers import end_of_backward_bound, temporaries_bound
from vramledger.analytic.reserve.replay import small_pool_excess
from vramledger.analytic.reserve.softcap import softcap_block
from vramledger.analytic.reserve.spill import (
    at_tied_edge,
    displaced_remade,
    hole_remade,
    tied_remade,
    two_steps_reserve,
)
from vramledger.analytic.reserve.state_rests import state_rests_cached
from vramledger.analytic.reserve.switches import ShapePeaks, Switching
from vramledger.analytic.reserve.trl import trl_stranded_bytes
from vramledger.analytic.reserve.workspace import cublas_workspace_block, workspace_lost
from vramledger.specs import Loss, ModelSpec, TrainSpec


def stranded_bytes(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """Cached blocks no request can use at the loss's backward peak, in closed form (monotone in B and L).

    What the replay of ``step_sequence`` (and of real traces) shows is left cached and free there:
    - the c·V·T logits block: forward frees it, and ``get_free_block`` cannot serve backward's 4·V·T requests
      from it (best fit needs a block at least as large; segments never merge), so one of them gets a new
      segment (only with a c < 4 compute dtype and the standard loss);
    - the segments made for one layer's transients before the loss: under checkpointing the whole forward of a
      layer runs unsaved (c·I·T twice, s·H·T, eager's scores) and, from step 1's backward, a recomputed layer
      with its backward's gradients (2·s·H·T + 3·c·I·T, eager's (c+4)·nh·L² per sequence); the cache holds the
      larger of the two (full fine-tuning with the head trained, off FSDP: ``_full_stranded``). Without
      checkpointing only eager's pre-softmax scores (forward_layer_temp) are transients made before the loss;
      backward's reuse the freed logits blocks (split, should_split);
    - TRL's ``chunked_nll``: the chunks' blocks its chain leaves cached (``trl_stranded_bytes``).
    """
    wb = p.weights
    logits_hole = _logits_hole(m, train)
    if train.loss is Loss.CHUNKED_NLL:
        return trl_stranded_bytes(m, train, cublas_workspace_block(p))
    if not wb.trainable_layers or train.loss is not Loss.STANDARD:
        # A fused or chunked loss makes no V·T-sized request at its peak: its chunk-sized requests are cut from
        # whatever the layers' transients left cached (get_free_block's best fit splits larger blocks), so
        # nothing is stranded there.
        return logits_hole
    if not train.grad_ckpt:
        return logits_hole + p.forward_layer_temp
    return logits_hole + max(_checkpointed_layer(m, train, p), _recomputed_layer(m, train, p))


def _checkpointed_layer(m: ModelSpec, train: TrainSpec, p: StepParts, scores: int | None = None) -> int:
    """A checkpointed layer's forward transients: c·I·T twice, s·H·T, eager's scores (``forward_layer_temp``, or
    ``scores``: full fine-tuning counts the segments eager's forward leaves, ckpt_forward.py
    ``eager_scores_segments``)."""
    c, s, T = train.precision.compute.bytes, residual_bytes(train, p.weights), train.tokens
    scores = p.forward_layer_temp if scores is None else scores
    return scores + (2 * c * decoder_mlp_width(m) + s * m.hidden_size) * T


def _full_stranded(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """``stranded_bytes`` for full fine-tuning under checkpointing (the head trained; the standard loss): the c·V·T
    hole and one checkpointed layer's forward transients, and of a recomputed layer with its backward's gradients
    only what the logits chain's blocks and those transients cannot hold.

    Step 1's backward recomputes each layer (torch/utils/checkpoint.py ``_recomputation_hook``) after the loss has
    freed its chain, and best fit (CUDACachingAllocator.cpp ``get_free_block``) cuts the recomputed layer and its
    gradients from those blocks, as with adapters (``_adapter_stranded``): in the replays of the mid model 4 × 2048,
    the 2-layer toy 8 × 1024 and the freeze configs step 1's backward makes no segment but the chain's second
    fp32 gradient. Counting the recomputed layer as stranded put step 1's reserve 0.29 GiB over the replay's for
    the mid model (5.11 against 4.82 GiB; +8.2% of its reference). The freeze method keeps the larger of the two:
    without it the mid model's freeze config at 2 × 1024 falls to −4.7% (its 4 MiB requests share 20 MiB
    segments, not modelled, which that term covered); so does FSDP, whose backward also gathers each layer's
    parameters and makes its unsharded gradients in the default pool before the reduce-scatter (without it the
    default pool of Llama-3.2-1B, FSDP2 on 8 ranks, 1 × 1024, falls 7.7% under the replay's,
    tests/analytic/test_stream_pools.py)."""
    trained_head = not frozen_head(train, p) and p.weights.trainable_layers
    if not train.grad_ckpt or not trained_head or train.loss is not Loss.STANDARD or train.fsdp is not None:
        return stranded_bytes(m, train, p)
    layer = _checkpointed_layer(m, train, p, sum(eager_scores_segments(m, train, p)))
    unserved = max(_recomputed_layer(m, train, p) - sum(logits_blocks(m, train)) - layer, 0)
    return _logits_hole(m, train) + layer + unserved


def workspace_in_chain(m: ModelSpec, train: TrainSpec, p: StepParts) -> bool:
    """Full fine-tuning: whether the backward thread's cuBLAS workspace is cut from an fp32 logits block in step 1
    (freeze.py ``workspace_in_logits``: no block forward freed, the fp32 norm intermediates or, under checkpointing, a
    layer's c·I·T MLP intermediates, holds it), so that step 2 makes that block again whatever the states reach.

    Under checkpointing: the 2-layer toy 8 × 1024 (c·I·T = 22 MiB under the 32 MiB workspace, 218 MiB of the copy's
    250 MiB block free at step 2's peak and one fp32 block made again, with every state outside the chain). Without
    checkpointing the saved activations are not freed in forward, and the fp32 norm intermediates (4·H·T) are the
    only rival: the same toy at 16 × 512 (bf16-true) and 2 × 4096 (4·H·T = 16 MiB) puts the workspace in the copy's
    250 MiB block and step 2's ``_log_softmax_backward_data`` makes a 250 MiB segment (218 MiB of the copy's block
    free at step 2's peak; the estimate was 10.5% and 8.0% under the replay without it). A trace with transformers'
    4-D boolean mask built (the padded path) does the same: the mask's 32 MiB blocks are freed early in forward, and
    the later layers' saved activations are cut from them before backward."""
    return workspace_in_logits(m, train, p)


def _recomputed_layer(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """A recomputed layer with its backward's gradients: 2·s·H·T + 3·c·I·T, eager's (c+4)·nh·L² per sequence."""
    T, c = train.tokens, train.precision.compute.bytes
    s, H, I = residual_bytes(train, p.weights), m.hidden_size, decoder_mlp_width(m)  # noqa: E741
    bwd = p.layer_bytes + p.layer_scores_bytes + (2 * s * H + 3 * c * I) * T
    if computes_scores(m, train):
        bwd += (c + 4) * m.num_heads * train.seq_len**2 * train.micro_batch
    return bwd


def states_beside_chain(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """Bytes of step 1's optimizer states that stay outside the logits chain without displacing anything step 2's
    loss peak holds (full fine-tuning under checkpointing; 0 without): the blocks one checkpointed layer's forward
    transients leave cached and free there (``_full_stranded`` less the c·V·T hole), less the gradients backward
    made into them first.

    Under checkpointing (``torch.utils.checkpoint``, ``use_reentrant=False``) a layer's forward frees its transients,
    so those segments are free when ``Adam._init_group`` (torch/optim/adam.py) creates ``exp_avg`` and ``exp_avg_sq``
    after step 1's backward; best fit (CUDACachingAllocator.cpp ``get_free_block``: the smallest cached block at least
    as large) takes them before the chain's blocks, the largest. Step 2's forward needs them again only for
    transients, freed before the loss, so a state there moves nothing into the chain at the loss's peak (the saved
    activations, whose blocks states also take, do: counted in the chain, ``full.blocks_with_states``). The
    gradients come first: backward cuts them from the same free blocks, and they are still live when the states are
    made. A lower bound of what the replays put outside the chain (test_reserve_full_ckpt.py): on the grid the
    gradients fill those blocks but for the 2-layer toy (7 MiB left); Qwen3-0.6B eager 8 × 1024 puts 1.39 GiB of
    states outside the chain, where this counts none (its 1.11 GiB of gradients exceed a layer's 0.36 GiB of
    transients)."""
    if not train.grad_ckpt:
        return 0
    return max(_full_stranded(m, train, p) - _logits_hole(m, train) - p.grad_bytes, 0)


def _logits_hole(m: ModelSpec, train: TrainSpec) -> int:
    """The c·V·T logits block the standard loss leaves cached at its peak (c < 4; ``stranded_bytes``)."""
    c = train.precision.compute.bytes
    return c * m.vocab_size * train.tokens if (train.loss is Loss.STANDARD and c != 4) else 0


def _adapter_stranded(
    m: ModelSpec, train: TrainSpec, p: StepParts, parts_at: Callable[[TrainSpec], StepParts] | None = None
) -> int:
    """``stranded_bytes`` with adapters: under checkpointing, where the layers are modelled, the logits hole and the
    cache the checkpointed forward leaves free (``checkpointed_forward_cache``) in place of one layer's transients.
    Step 1's backward recomputes each layer after the loss has freed its logits chain, so it cuts a recomputed layer
    and its gradients from the chain's blocks and that free cache, and makes segments only for what they cannot
    hold (none in the traced configs: bench/reserve/forward_cache_ckpt.jsonl); what is cached at step 2's loss peak
    is then what step 2's forward leaves of step 1's forward segments, and those segments. With eager attention,
    whose length² blocks outgrow the logits' as ℓ grows, what those blocks and the logits chain leave
    (``eager_checkpointed_stranded``), where the step at a shorter shape can be had (``parts_at``: runs.py passes
    the ``ShapePeaks``' parts; a call without it, the distributed engines', gets the form above)."""
    if parts_at is not None:
        shorter = partial(_shorter_stranded, m, parts_at)
        eager = eager_checkpointed_stranded(m, train, p, shorter)
        if eager is not None:
            return eager
    layers = checkpointed_forward_cache(m, train, p)
    if layers is None:
        return stranded_bytes(m, train, p)
    unserved = max(_recomputed_layer(m, train, p) - sum(logits_blocks(m, train)) - layers, 0)
    return _logits_hole(m, train) + layers + unserved


def _shorter_stranded(m: ModelSpec, parts_at: Callable[[TrainSpec], StepParts], t: TrainSpec) -> int:
    """``_adapter_stranded`` at the shape ``t``, with the step's parts there."""
    return _adapter_stranded(m, t, parts_at(t), parts_at)


def _segment_rest(block: int) -> int:
    """What a block of at least 10 MiB leaves of the segment made for it: ``get_allocation_size`` rounds it up to
    2 MiB (kRoundLarge). Counted with adapters for the whole segments cached at the loss's peak (the logits hole and
    the fp32 block the backward workspace took) and for two fp32 logits blocks live at the loss's peak, whichever it
    is (forward's cross-entropy holds the copy and the log-softmax; backward's peak the log-softmax output and the two
    gradients of ``nll_loss_backward`` and ``_log_softmax_backward_data``): each is a segment of its own, so its rest
    is cached and free there, and no request of the loss's size fits it. A live block's bytes are in the loss's peak
    and its rest on top: the two add up to its segment, which never shrinks as T grows (a rest beside a block the
    peak lacks would fall as it grows: the third at backward's peak is left out). Up to 2 MiB each: felt only by
    small models (the 2-layer toy of bench/reserve/: at 1 × 2048 and 4 × 512 a 31.25 MiB hole in 32 MiB and 62.5 MiB
    fp32 blocks in 64 MiB, 1.5 MiB free in each of the three live ones at step 2's peak). Under 10 MiB the segment is
    kLargeBuffer's 20 MiB, shared with whatever else best fit cuts from it, and is not counted here."""
    return -(-block // K_ROUND_LARGE) * K_ROUND_LARGE - block if block >= K_MIN_LARGE_ALLOC else 0


def single_shape(
    m: ModelSpec,
    train: TrainSpec,
    p: StepParts,
    loss_peak: int,
    step_peak: int,
    opt_peak: int,
    on: Switching,
    parts_at: Callable[[TrainSpec], StepParts] | None = None,
) -> int:
    """Peak reserved of a steady-state step at one shape: the largest of these lower bounds (``parts_at``: the step's
    parts at another shape, for the terms that look at shorter ones).

    CUDACachingAllocator.cpp never releases a segment during training and serves a request only from a cached
    block at least as large (``get_free_block``, best fit; segments never merge), so reserved is the sum of the
    segments made so far:

    1. at step 2's loss peak, the stranded blocks (``stranded_bytes``; full fine-tuning under checkpointing
       ``_full_stranded``; with adapters ``_adapter_stranded``, and the 2 MiB rests of the logits chain's
       segments, ``_segment_rest``) are cached on top of ``loss_peak``, less
       the states that sit in the c·V·T logits hole (allocated there, not stranded); plus, where a layer's c·I·T
       activations are larger than a decoder matrix's per-parameter tensors (b·H·I), the foreach temporaries'
       own segments, which no activation fits (``temporaries_unused_by_activations``), and where step 1's states
       sit in every MLP activation segment, what those segments have free (``on.state_rests``,
       ``state_rests_cached``); with adapters, plus an
       fp32 logits block lost to the backward thread's cuBLAS workspace (``on.workspace``, ``workspace_lost``);
    2. full fine-tuning: the optimizer creates its states S inside step 1 (torch/optim/adamw.py ``_init_group``,
       after backward), so step 1's loss peak reserves R1 = ``loss_peak`` − S + stranded (under checkpointing, at
       least the segments its forward made, autocast's cached casts among them, and the loss's on top:
       ``forward_segments``), and step 1's optimizer at least ``opt_peak``. The states take the smallest cached
       blocks that hold them, the logits chain's (the largest) last; a logits block with a state inside cannot
       serve step 2's request of its own size, so step 2 makes it again: reserved = max(R1 + eager's backward
       segments (``eager_backward_segments``), ``opt_peak``) + the blocks the states reach, counted at this shape
       (``on.relaid``, ``relaid_counted``, and the c·V·T block where they reach every fp32 one, ``hole_remade``) or
       bounded by min(S, 3·4·V·T) (``relaid_bytes``); with a tied embedding, the fp32 blocks the two freed V·H
       blocks cannot hold (``on.tied``, ``tied_remade``);
    3. full fine-tuning without checkpointing: ``opt_peak`` + the saved activations no per-parameter tensor of
       the optimizer fits (``on.activations``, ``activations_unused``);
    4. a tied embedding's V·H gradient block made again in step 2, on top (``on.tied``, ``tied_gradient_block``);
    5. an optimizer without step temporaries (SGD, fused AdamW): the end of backward (``end_of_backward_bound``);
    6. Adafactor: its temporaries' own segments where they cannot pair up in the logits blocks (``on.temporaries``,
       ``temporaries_bound``);
    7. full fine-tuning with foreach AdamW without checkpointing, where the two steps are written out (spill.py
       ``displaced_remade``: Llama-shaped layers or Gemma 3's (gemma_layer.py), SDPA without length² blocks, or
       fp32 layers running SDPA's math kernel, math_layer.py): the two steps replayed
       through the allocator model (``two_steps_reserve``). A packed run takes the replay's blocks made again in step
       2 (its states and the activations they displace into the chain) in place of term 2's count, and leaves the
       foreach temporaries and the c·V·T logits hole to it (term 1 without them, but the temporaries in the states'
       rests band); a run with dynamic padding keeps the closed forms, held over its shorter shapes; a packed run's
       figure is at most that (runs.py).
    Terms 1's temporaries and 2 to 6 are for trained base weights (full, freeze), whose per-parameter tensors are
    large-pool blocks the size of decoder matrices; adapters' are small, and the small pool's cached bytes
    (``small_pool_excess``) are added on top. The ``on`` terms switch off as the shape grows (``NONE``: left out).
    """
    wb = p.weights
    if train.adapters or wb.largest_trainable_numel * wb.trainable_dtype.bytes <= K_SMALL_SIZE:
        stranded = _adapter_stranded(m, train, p, parts_at)
        lost = workspace_lost(m, train, p) if on.workspace else 0
        # the fp32 blocks live at the loss's peak whichever it is: forward's cross-entropy holds the copy and the
        # log-softmax, backward's a third; a rest beside a block not in ``loss_peak`` would fall as the block grows
        fp32 = logits_blocks(m, train)[-2:]
        rests = _segment_rest(_logits_hole(m, train)) + sum(map(_segment_rest, fp32 + fp32[:1] if lost else fp32))
        cached = adapter_forward_cache(m, train, p) + spilled_chain_blocks(m, train, p, workspace_lost=bool(lost))
        remade = softcap_block(m, train) if on.softcap else 0
        tails = load_tails(m, train, p) + rests
        return max(step_peak, loss_peak + stranded + lost + cached + remade + tails) + small_pool_excess(train, p)
    stranded = _full_stranded(m, train, p)
    r1 = step1_loss_reserve(m, train, p, loss_peak)
    chain = logits_blocks(m, train)
    hole = chain[0] if len(chain) == 4 else 0  # the c·V·T logits block (c < 4): the first the states fill
    in_hole = min(states_in_logits(m, train, p, r1, stranded), hole)
    grads = gradients_in_chain(m, train, p, r1)
    base = max(r1 + eager_backward_segments(m, train), opt_peak + optimizer_tails(m, train, p))
    # the two steps replayed where the sequence is written out (spill.py); None elsewhere
    displaced = displaced_remade(m, train, p) if on.relaid and train.packing else None
    if displaced is None:
        remade = _relaid(m, train, p, on, grads) + _tied_relaid(m, train, p, on, grads)
        hole_again, temporaries = _hole_remade(m, train, p, on), temporaries_unused_by_activations(m, train, p)
        # a run with dynamic padding keeps the closed forms, held over its shorter shapes (the replay's count is not
        # closed downwards, and a lower bound from it at B × L made the estimate fall as the shape grew: Qwen2.5-1.5B
        # bf16-true 5 × 2277 → 2405, 72.11 → 70.66 GiB); a packed run's figure is at most this one (runs.py)
        sequence = 0
    else:  # a packed run: what step 2 makes again, its displaced activations with the states; the temporaries placed
        remade, hole_again, sequence = displaced, 0, two_steps_reserve(m, train, p) or 0
        # by the replay, but where the states sit in every MLP activation segment they do get segments of their own,
        # which ``state_rests_cached`` counts with term 1's (less the V·H one step 2's activations take)
        temporaries = temporaries_unused_by_activations(m, train, p) if on.state_rests else 0
        # and the c·V·T logits hole: term 1 counts it free at step 2's peak less the states in it, but the replay lays
        # out who holds it, the states and step 2's activations they displace into it (Qwen3-0.6B bf16-true 8 × 1024:
        # the trace's step 2 makes nothing, the hole holds 594 MiB of states and the rest of its 2.32 GiB step 2's
        # activations, as the replay has it; term 1 put it +5.6% over the trace, the replay −0.2%)
        in_hole = hole
    return (
        max(
            step_peak,
            loss_peak
            + stranded
            - in_hole
            + temporaries
            + (state_rests_cached(m, train, p) if on.state_rests else 0)
            + (loss_tails(m, train, p) if on.loss_tails else 0),
            base + remade + hole_again,
            optimizer_peak_bound(m, train, p, opt_peak, remade) if on.activations else opt_peak,
            end_of_backward_bound(m, train, p, opt_peak, on),
            temporaries_bound(m, train, p, loss_peak + stranded, on),
            sequence,
        )
        + small_pool_excess(train, p)
        + (tied_gradient_block(p) if on.tied else 0)
    )


def step1_loss_reserve(m: ModelSpec, train: TrainSpec, p: StepParts, loss_peak: int) -> int:
    """R1 of ``single_shape``'s term 2, full fine-tuning: step 1's reserve at its loss peak, ``loss_peak`` less the
    states (made after it) plus the stranded blocks, and under checkpointing at least its forward's segments."""
    return max(loss_peak - p.state_bytes + _full_stranded(m, train, p), forward_segments(m, train, p), 0)


def chain_gradients_at(m: ModelSpec, train: TrainSpec, at: ShapePeaks) -> Callable[[TrainSpec], int] | None:
    """``gradients_in_chain`` at another shape (from its step, ``at``), for runs.py's regions of a run with dynamic
    padding (full.py ``relaid_regions``); None where it is 0 at every shape (c < 4, or no checkpointing)."""
    if not train.grad_ckpt or train.precision.compute.bytes != 4:
        return None

    def grads(t: TrainSpec) -> int:
        pt, loss_peak, _, _ = at(t)
        return gradients_in_chain(m, t, pt, step1_loss_reserve(m, t, pt, loss_peak))

    return grads


def _relaid(m: ModelSpec, train: TrainSpec, p: StepParts, on: Switching, grads: int = 0) -> int:
    """Term 2's blocks step 2 makes again, the c·V·T block aside (``_hole_remade``): counted at this shape
    (``on.relaid``; ``grads``: the gradients in the chain before the states, full.py ``gradients_in_chain``) or
    bounded; the freeze method's own count where the head and the embedding are frozen (freeze.py)."""
    if frozen_head(train, p):
        return frozen_head_relaid(m, train, p, counted=on.relaid)
    if on.relaid:
        beside, workspace = states_beside_chain(m, train, p), workspace_in_chain(m, train, p)
        return relaid_counted(m, train, p, beside, workspace, grads)
    return relaid_bytes(m, train, p)


def _tied_relaid(m: ModelSpec, train: TrainSpec, p: StepParts, on: Switching, grads: int) -> int:
    """The fp32 logits blocks step 2 makes again beside a tied embedding's two freed V·H blocks (spill.py
    ``tied_remade``): where runs.py's ``tied`` switch is on (4·T < H·b), and at its edge (4·T = H·b, spill.py
    ``at_tied_edge``, counted with ``on.relaid``) where step 1 cut something besides the states from the chain's
    blocks: the backward workspace (``workspace_in_chain``) or gradients (``grads``, full.py ``gradients_in_chain``).
    At the edge the embedding's own states fill one fp32 block (lm_head's V·H gradient was cut from it) and the
    dense gradient's; the two V·H blocks replace two of the three logits requests, so a block is made again only
    where both other fp32 blocks hold something too (spill.py ``at_tied_edge``)."""
    edge = on.relaid and at_tied_edge(m, train, p) and (grads > 0 or workspace_in_chain(m, train, p))
    return tied_remade(m, train, p, states_beside_chain(m, train, p)) if on.tied or edge else 0


def _hole_remade(m: ModelSpec, train: TrainSpec, p: StepParts, on: Switching) -> int:
    """The c·V·T logits block step 2 makes again where the counted states reach every fp32 block (spill.py
    ``hole_remade``; counted with ``on.relaid``, full fine-tuning with the head trained)."""
    if frozen_head(train, p) or not on.relaid:
        return 0
    return hole_remade(m, train, p, states_beside_chain(m, train, p))
