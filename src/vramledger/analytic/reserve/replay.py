"""The training step spelled out as an allocation sequence built from the analytic quantities (``parts.StepParts``),
replayed through the allocator model (``step_sequence``, ``reserve_excess``), and the small pool's closed form
(``small_pool_excess``). The sequence lumps the saved activations into one block, so it is a cross-check of the
closed form (bench/reserve/ "sequence replay"), cruder than it; the small pool's figure is used by both."""

from __future__ import annotations

from vramledger.allocator.conf import K_SMALL_BUFFER, K_SMALL_SIZE
from vramledger.analytic.activations import computes_scores, residual_bytes
from vramledger.analytic.logits import LogitsBytes, logits_bytes, trl_chunk
from vramledger.analytic.params import layer_linears
from vramledger.analytic.parts import StepParts
from vramledger.analytic.reserve.events import Events, Seq, replay_excess
from vramledger.analytic.reserve.full import decoder_mlp_width
from vramledger.analytic.reserve.trl import trl_chain
from vramledger.specs import Loss, ModelSpec, TrainSpec

# step_sequence: full fine-tuning's per-parameter tensors as at most this many blocks per group (sequence length).
_CHUNKS = 48


def step_sequence(m: ModelSpec, train: TrainSpec, p: StepParts) -> Seq:
    """Allocations and frees of two training steps, in program order, built from ``p``.

    Each tensor group is one block where its tensors are allocated and freed together (the saved activations
    of the layers below the top one; the weights), and one block per tensor where the order decides what can
    reuse what (the logits chain; one layer's backward).
    """
    T, H = train.tokens, m.hidden_size
    c = train.precision.compute.bytes
    n_tl = p.weights.trainable_layers
    ckpt = train.grad_ckpt
    seq = Events()
    # Persistent: weights (frozen, trainable, fp32 master) and the cuBLAS workspaces.
    seq.alloc(p.frozen_bytes + p.trainable_bytes + p.master_bytes + p.workspace_bytes)
    top_saved, rest_saved = _saved_blocks(p)
    fwd_temp, bwd_temp = _layer_transients(m, train, p)
    grad_blocks, n_states, temp_blocks = _parameter_blocks(m, p)
    lg = logits_bytes(m, train, T)
    layers = 2 if n_tl > 1 else 1  # the cache of one layer's transients is made by the first layer
    for step in (1, 2):
        rest = seq.alloc(rest_saved)
        seq.transients(fwd_temp, layers)
        top = seq.alloc(top_saved)
        hidden = seq.alloc(p.final_hidden_bytes + p.head_cast_bytes)
        g3 = _loss_chain(seq, m, train, lg, hidden)
        gh = seq.alloc(c * H * T)  # lm_head's input gradient
        seq.free(g3)
        recompute = seq.alloc(p.layer_bytes + p.layer_scores_bytes) if ckpt and n_tl else None
        seq.transients(bwd_temp, layers)
        if recompute is not None:
            seq.free(recompute)
        seq.free(top)
        seq.free(gh)
        seq.free(rest)
        grads = [seq.alloc(g) for g in grad_blocks]
        if step == 1:
            for g in grad_blocks:
                for _ in range(n_states):
                    seq.alloc(g)
        seq.transients(temp_blocks, 1)
        for g in grads:  # zero_grad(set_to_none=True)
            seq.free(g)
    return tuple(seq.events)


def _saved_blocks(p: StepParts) -> tuple[int, int]:
    """Saved activations: the top trained layer's separately (backward frees it first), the rest as one block."""
    n_tl = p.weights.trainable_layers
    saved_all = p.saved_layers_bytes + p.scores_bytes
    top_saved = saved_all // n_tl if n_tl else 0
    rest_saved = saved_all - top_saved + p.extra_saved_bytes
    return top_saved, rest_saved


def _layer_transients(m: ModelSpec, train: TrainSpec, p: StepParts) -> tuple[list[int], list[int]]:
    """The blocks of one layer's forward and of one layer's backward that are freed as soon as it is done."""
    T, B, L = train.tokens, train.micro_batch, train.seq_len
    c = train.precision.compute.bytes
    s = residual_bytes(train, p.weights)
    H = m.hidden_size
    I = decoder_mlp_width(m)  # noqa: E741
    n_tl = p.weights.trainable_layers
    # One layer's forward transients: under checkpointing its whole forward runs without saving (the MLP
    # intermediates c·I·T and the residual s·H·T are freed as it goes); eager's scores (step.py forward_layer_temp).
    fwd_temp = [p.forward_layer_temp] if p.forward_layer_temp else []
    if train.grad_ckpt and n_tl:
        fwd_temp += [c * I * T, c * I * T, s * H * T]
    # One layer's backward: grads of its input and output hidden states (s·H·T each) and of the MLP intermediates
    # (c·I·T each), eager's (c+4)·nh·L² per sequence (step.py layer_backward_temp).
    bwd_temp = [s * H * T, s * H * T, c * I * T, c * I * T, c * I * T] if n_tl else []
    if computes_scores(m, train) and n_tl:
        bwd_temp.append((c + 4) * m.num_heads * L * L * B)
    return fwd_temp, bwd_temp


def _parameter_blocks(m: ModelSpec, p: StepParts) -> tuple[list[int], int, list[int]]:
    """The gradients' blocks, how many optimizer states each has, and the foreach temporaries' blocks."""
    wb = p.weights
    # Per-parameter tensors: gradients, optimizer states, the foreach temporaries. LoRA's are each ≤ 1 MiB and
    # live in the small pool (kSmallSize), which large requests never use: small_pool_excess handles them, and
    # they are left out here. Full fine-tuning's are one tensor per weight matrix; they are modelled as blocks
    # the size of the largest decoder-layer matrix (at most _CHUNKS per group, to keep the sequence short), and
    # lm_head's (or the tied embedding's) V·H tensors one block each. Where they land matters: AdamW creates its
    # states inside the first step (torch/optim/adamw.py _init_group), into blocks the activations and logits
    # left cached, which the next step's forward then has to find elsewhere.
    small = wb.largest_trainable_numel * wb.trainable_dtype.bytes <= K_SMALL_SIZE
    tb = wb.trainable_dtype.bytes
    head = wb.lm_head_weight_numel * tb if wb.head_trainable and not small else 0
    body = 0 if small else max(p.grad_bytes - head, 0)
    matrix = max((lin.numel // lin.per_layer for lin in layer_linears(m)), default=1) * tb
    chunk = max(matrix, -(-body // _CHUNKS), 1)
    grad_blocks = ([head] if head else []) + [chunk] * (body // chunk) + ([body % chunk] if body % chunk else [])
    n_states = round(p.state_bytes / max(p.grad_bytes, 1)) if not small else 0
    temp_blocks = grad_blocks if (p.step_temp_bytes and not small) else []
    return grad_blocks, n_states, temp_blocks


def _loss_chain(seq: Events, m: ModelSpec, train: TrainSpec, lg: LogitsBytes, hidden: int) -> int:
    """The loss's forward and backward, from the final hidden states (``hidden``, freed here); returns the block of
    the logits' gradient that lm_head's backward reads."""
    T, V = train.tokens, m.vocab_size
    c = train.precision.compute.bytes
    if train.loss is Loss.CHUNKED_NLL:
        return trl_chain(seq, trl_chunk(m, train, T), hidden)
    if train.loss is Loss.STANDARD:
        # transformers ForCausalLMLoss: logits (c·V·T) → .float() (4·V·T) → log_softmax (4·V·T, saved);
        # the upcast and the logits die before backward (the Trainer keeps only the loss).
        up = 4 * V * T if c != 4 else 0
        soft = lg.saved - 4 * V * T
        logits = seq.alloc(c * V * T)
        softcap = seq.alloc(soft)
        upcast = seq.alloc(up)
        lsm = seq.alloc(4 * V * T)
        seq.free(upcast)
        seq.free(logits)
        seq.free(hidden)
        # backward: nll_loss_backward's 4·V·T gradient, then _log_softmax_backward_data's 4·V·T while the
        # saved log-softmax is live; then the cast back to c·V·T for lm_head's backward.
        g1 = seq.alloc(4 * V * T)
        g2 = seq.alloc(4 * V * T)
        seq.free(g1)
        seq.free(lsm)
        seq.free(softcap)
        g3 = seq.alloc(c * V * T if c != 4 else 0)
        seq.free(g2)
    else:
        # Chunked or fused loss: what forward keeps, and the transients of one chunk in each direction.
        kept = seq.alloc(lg.saved)
        tf = seq.alloc(max(lg.forward_peak - lg.saved, 0))
        seq.free(tf)
        seq.free(hidden)
        tb = seq.alloc(max(lg.backward_peak - lg.saved, 0))
        seq.free(kept)
        g3 = seq.alloc(max(lg.head_grad_moment - (lg.backward_peak - lg.saved), 0))
        seq.free(tb)
    return g3


def reserve_excess(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """Reserved − allocated at the step's peak: the large pool's replayed peak reserved less its peak allocated,
    plus the small pool's cached bytes (``small_pool_excess``)."""
    reserved, allocated = replay_excess(step_sequence(m, train, p))
    return max(reserved - allocated, 0) + small_pool_excess(train, p)


def small_pool_excess(train: TrainSpec, p: StepParts) -> int:
    """Cached-but-free small-pool bytes at the step's peak, where every per-parameter tensor is ≤ 1 MiB (LoRA).

    The small pool (requests ≤ kSmallSize = 1 MiB) packs blocks into 2 MiB segments (kSmallBuffer) and splits
    at any remainder ≥ 512 B, so its reserved memory tracks the most its tensors ever hold at once, in 2 MiB
    steps: gradients + optimizer states + the foreach temporaries inside ``optimizer.step()`` (or the states and
    autocast copies during forward). At the step's peak (in the loss, or backward) only the states and, without
    checkpointing, the autocast copies are live; the rest of the pool is cached and unusable by large requests.
    """
    wb = p.weights
    if wb.largest_trainable_numel * wb.trainable_dtype.bytes > K_SMALL_SIZE:
        return 0
    states, grads = p.state_bytes, p.grad_bytes
    casts = p.autocast_copy_bytes
    most = max(grads + states + p.step_temp_bytes, states + casts)
    reserved = -(-most // K_SMALL_BUFFER) * K_SMALL_BUFFER
    at_peak = states + (0 if train.grad_ckpt else casts)
    return max(reserved - at_peak, 0)
