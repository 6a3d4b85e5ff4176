"""The caching allocator's reserve for the analytic path, from what the allocator's rules leave cached in a step.

PyTorch's caching allocator never returns a segment to the driver during training (only ``empty_cache`` or an
allocation that fails and retries does), and it serves a request only from a cached block at least as large
(``get_free_block``: best fit by size; blocks of different ``cudaMalloc`` segments never merge). So a step
reserves more than it allocates where blocks freed earlier are too small for a later request. The trace replay
(``trace/oom.py``, bench/reserve/) shows where that happens in a training step:

- the logits chain: forward frees the c·V·T logits block, then backward needs two fp32 4·V·T blocks at once
  (the gradients from ``nll_loss_backward`` and ``_log_softmax_backward_data``) while the log-softmax output is
  still live; the c·V·T hole cannot serve a 4·V·T request, so a new segment is made and the hole stays cached;
- one decoder layer's working set (its backward's gradients and, under checkpointing, its recomputed
  activations) is cached in segments the much larger logits requests cannot use;
- in the first step the optimizer states are created into whatever the cache holds: into the activation blocks
  where they fit, else into the logits chain's blocks, which step 2 then has to make again;
- per-parameter tensors (gradients, states, foreach temporaries) and activations reuse each other's blocks only
  where they fit.

The estimate uses a closed form of these mechanisms (``stranded_bytes``, ``peak_reserved``): it stays instant,
and never falls as batch or length grows, as the planner's searches need. The replay shows three more places
(the backward thread's cuBLAS workspace in a logits block, activation blocks too small for the optimizer, a tied
embedding's gradient) that switch off as the shape grows: a packed run's estimate leaves them out, and a run with
dynamic padding, which keeps the segments of every shorter shape it meets, is estimated at the largest
single-shape reserve over those shapes, these included (``held_reserved``; docs/reserve.md "Runs").
``step_sequence`` spells the same step out as an allocation sequence built from the analytic
quantities (``parts.StepParts``) and ``replay_excess`` replays it through ``allocator/model.py`` (a port of
``CUDACachingAllocator.cpp``); tests and bench/reserve/ check the closed form against both that replay and the
replay of real traces (bench/reserve/replay_grid.jsonl). The cache left by step 1 persists, so from step 2 on
the reserved memory at every training phase is the step's peak reserved: each phase's reserve line is that
figure less the phase's allocated bytes. None of this is a GPU measurement: the allocator model itself awaits
validation on a GPU (allocator/gpucheck.py).

Legend: V vocabulary, H hidden, I intermediate, T tokens per micro-batch, c compute-dtype bytes, s residual-stream
bytes, b trainable-parameter bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import lru_cache
from typing import NamedTuple

from vramledger.allocator.blocks import Block
from vramledger.allocator.conf import K_MIN_LARGE_ALLOC, K_SMALL_BUFFER, K_SMALL_SIZE, allocation_size, round_size
from vramledger.analytic.activations import residual_bytes
from vramledger.analytic.forward_cache import adapter_forward_cache
from vramledger.analytic.load_residue import load_tails
from vramledger.analytic.logits import LogitsBytes, TrlChunk, logits_bytes, trl_chunk
from vramledger.analytic.overhead import RESERVE_SOURCE as ASSUMED_SOURCE
from vramledger.analytic.overhead import allocator_reserve_bytes
from vramledger.analytic.params import in_layers, layer_linears
from vramledger.analytic.parts import StepParts, embedding_gradient_before_accumulation, tied_gradient_sum
from vramledger.analytic.softcap_reserve import latest_on, softcap_block, softcap_remade
from vramledger.ledger import Basis, Phase
from vramledger.specs import Attention, Loss, ModelSpec, Optimizer, TrainSpec
from vramledger.specs.train import TRL_CHUNK_TOKENS

# step_sequence: full fine-tuning's per-parameter tensors as at most this many blocks per group (sequence length).
_CHUNKS = 48

RESERVE_SOURCE = (
    "caching-allocator rules (CUDACachingAllocator.cpp best fit, no merging across segments) applied to the step: "
    "blocks cached and unusable at the loss's peak (forward's c·V·T logits block; one layer's transients under "
    "checkpointing); full fine-tuning: states created in step 1 into the logits blocks, which step 2 makes again, "
    "and foreach temporaries' blocks too small for the activations; LoRA's small pool; reserved stays at the "
    "step's peak from step 2 on; dynamic padding: the most any shape ≤ (B, L) reserves, the segments of shorter "
    "batches kept (analytic/reserve.py); not yet measured on a GPU"
)

Seq = tuple[tuple[int, int], ...]
"""(id, size): size > 0 allocates ``id``, size 0 frees it."""


@lru_cache(maxsize=4096)
def replay_excess(seq: Seq) -> tuple[int, int]:
    """(peak reserved, peak allocated) of ``seq`` replayed through the caching-allocator model (default settings,
    unlimited device). Cached: the planner asks for the same shapes again and again."""
    from vramledger.allocator.model import CachingAllocatorModel

    model = CachingAllocatorModel()
    live: dict[int, Block] = {}
    for i, size in seq:
        if size > 0:
            blk = model.malloc(size)
            assert blk is not None, "an unlimited device never runs out"
            live[i] = blk
        else:
            freed = live.pop(i, None)
            if freed is not None:
                model.free(freed)
    return model.peak_reserved, model.peak_allocated


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
    seq = _Events()
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


class _Events:
    """The sequence ``step_sequence`` builds: ``alloc`` numbers a block (a size of 0 is numbered, not recorded)."""

    def __init__(self) -> None:
        self.events: list[tuple[int, int]] = []
        self._ids = iter(range(1, 1 << 30))

    def alloc(self, size: int) -> int:
        i = next(self._ids)
        if size > 0:
            self.events.append((i, int(size)))
        return i

    def free(self, i: int) -> None:
        self.events.append((i, 0))

    def transients(self, sizes: list[int], times: int) -> None:
        """``times`` rounds of the blocks ``sizes``, all allocated, then all freed."""
        for _ in range(times):
            for t in [self.alloc(x) for x in sizes]:
                self.free(t)


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
    I = _decoder_mlp_width(m)  # noqa: E741
    n_tl = p.weights.trainable_layers
    # One layer's forward transients: under checkpointing its whole forward runs without saving (the MLP
    # intermediates c·I·T and the residual s·H·T are freed as it goes); eager's scores (step.py forward_layer_temp).
    fwd_temp = [p.forward_layer_temp] if p.forward_layer_temp else []
    if train.grad_ckpt and n_tl:
        fwd_temp += [c * I * T, c * I * T, s * H * T]
    # One layer's backward: grads of its input and output hidden states (s·H·T each) and of the MLP intermediates
    # (c·I·T each), eager's (c+4)·nh·L² per sequence (step.py layer_backward_temp).
    bwd_temp = [s * H * T, s * H * T, c * I * T, c * I * T, c * I * T] if n_tl else []
    if train.attn is Attention.EAGER and n_tl:
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


def _loss_chain(seq: _Events, m: ModelSpec, train: TrainSpec, lg: LogitsBytes, hidden: int) -> int:
    """The loss's forward and backward, from the final hidden states (``hidden``, freed here); returns the block of
    the logits' gradient that lm_head's backward reads."""
    T, V = train.tokens, m.vocab_size
    c = train.precision.compute.bytes
    if train.loss is Loss.CHUNKED_NLL:
        return _trl_chain(seq, trl_chunk(m, train, T), hidden)
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


def _trl_chain(seq: _Events, t: TrlChunk, hidden: int, workspace: int = 0, last: TrlChunk | None = None) -> int:
    """TRL's ``chunked_nll`` (analytic/logits.py), block by block: two chunks' forwards, then two chunks'
    recomputes and backwards (the allocator's cache is made by then); returns the hidden states' gradient.
    ``workspace``: the backward thread's cuBLAS workspace, made at the first recompute's matmul (0: counted
    elsewhere, as ``step_sequence`` does). ``last``: the last chunk's sizes where it is shorter (None: as ``t``);
    forward runs it last, backward first."""
    rounds = min(t.chunks, 2)
    order = [t] * rounds if last is None or rounds < 2 else [t, last]
    kept = seq.alloc(t.hidden)  # hidden[order]
    for ti in order:
        w, logits, lsm = _trl_chunk_forward(seq, ti, keep_head=False)
        seq.free(lsm)
        seq.free(logits)
    seq.free(hidden)
    grad_hidden = buffer = None
    for i, t in enumerate(reversed(order)):
        w, logits, lsm = _trl_chunk_forward(seq, t, keep_head=True, workspace=workspace if i == 0 else 0)
        seq.free(logits)
        g1, g2 = seq.alloc(t.fp32), seq.alloc(t.fp32)  # nll_loss_backward, _log_softmax_backward_data
        seq.free(lsm)
        seq.free(g1)
        g16 = seq.alloc(t.grad_cast)
        seq.free(g2)
        gw, gh = seq.alloc(t.weight_grad), seq.alloc(t.grad_h)
        seq.free(w)
        seq.free(g16)
        if t.weight_grad:
            wc = seq.alloc(t.weight_cast) if t.weight_cast else gw
            if wc != gw:
                seq.free(gw)
            if buffer is None:
                buffer = wc
            elif t.first_sum_out_of_place and rounds == 2:
                total = seq.alloc(t.buffer)
                seq.free(buffer)
                seq.free(wc)
                buffer = total
            else:
                seq.free(wc)
        part = seq.alloc(t.hidden)  # slice_backward's zero-padded gradient, summed in place after the first
        seq.free(gh)
        if grad_hidden is None:
            grad_hidden = part
        else:
            seq.free(part)
    seq.free(kept)
    if buffer is not None:
        seq.free(buffer)  # AccumulateGrad: the head's gradient (counted with the gradients) takes it
    assert grad_hidden is not None
    return grad_hidden


def _trl_chunk_forward(seq: _Events, t: TrlChunk, *, keep_head: bool, workspace: int = 0) -> tuple[int, int, int]:
    """One chunk's ``_chunk``: the matmul's copies, the logits, log_softmax, the entropy's two temporaries. In the
    recompute (``keep_head``) mm's saved head stays; ``workspace`` (never freed) is made by the matmul before its
    output; returns (saved head, logits, log-softmax)."""
    up = seq.alloc(t.h_up)
    w32 = seq.alloc(t.head32)
    cast = seq.alloc(t.cast)
    seq.alloc(workspace)
    logits = seq.alloc(t.logits)
    seq.free(up)
    saved = cast if t.cast else w32
    for block in (w32, cast):
        if not (keep_head and block == saved):
            seq.free(block)
    upcast = seq.alloc(t.upcast)
    lsm = seq.alloc(t.fp32)
    seq.free(upcast)
    e, prod = seq.alloc(t.fp32), seq.alloc(t.fp32)
    seq.free(e)
    seq.free(prod)
    return (saved if keep_head else 0), logits, lsm


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


_TRAIN_PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)


def training_peaks(allocated: dict[Phase, int]) -> tuple[int, int, int]:
    """Allocated bytes at the loss's peak (forward or backward), the step's peak and the optimizer's peak."""
    peak = max((allocated[ph] for ph in _TRAIN_PHASES if ph in allocated), default=0)
    loss_peak = max(allocated.get(Phase.FORWARD, 0), allocated.get(Phase.BACKWARD, 0))
    return loss_peak, peak, allocated.get(Phase.OPTIMIZER, peak)


def phase_reserves(
    m: ModelSpec, train: TrainSpec, p: StepParts, allocated: dict[Phase, int], at: ShapePeaks | None = None
) -> dict[Phase, tuple[int, str, Basis]]:
    """The ALLOCATOR_RESERVE line of each phase in ``allocated`` (LOAD excluded): (bytes, source, basis).

    The step's peak reserved is the largest training phase's allocated bytes plus the modelled excess
    (``reserve_excess``). Every training phase reports that same reserved figure: the cache built by step 1 is
    still held in every later step (the trace replay shows reserved flat across phases in step 2). Evaluation
    and generation run after training steps, so they hold at least that cache; where they allocate more, the
    stated assumption of ``overhead.allocator_reserve_bytes`` covers their own fragmentation.
    """
    loss_peak, peak, opt_peak = training_peaks(allocated)
    reserved = peak_reserved(m, train, p, loss_peak, peak, opt_peak, at) if peak else 0
    out: dict[Phase, tuple[int, str, Basis]] = {}
    for ph, total in allocated.items():
        if ph is Phase.LOAD:
            continue
        if ph in _TRAIN_PHASES or reserved - total >= allocator_reserve_bytes(total):
            out[ph] = (max(reserved - total, 0), RESERVE_SOURCE, Basis.FORMULA)
        else:
            out[ph] = (allocator_reserve_bytes(total), ASSUMED_SOURCE, Basis.ASSUMPTION)
    return out


def stranded_bytes(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """Cached blocks no request can use at the loss's backward peak, in closed form (monotone in B and L).

    What the replay of ``step_sequence`` (and of real traces) shows is left cached and free there:
    - the c·V·T logits block: forward frees it, and ``get_free_block`` cannot serve backward's 4·V·T requests
      from it (best fit needs a block at least as large; segments never merge), so one of them gets a new
      segment (only with a c < 4 compute dtype and the standard loss);
    - the segments made for one layer's transients before the loss: under checkpointing the whole forward of a
      layer runs unsaved (c·I·T twice, s·H·T, eager's scores) and, from step 1's backward, a recomputed layer
      with its backward's gradients (2·s·H·T + 3·c·I·T, eager's (c+4)·nh·L² per sequence); the cache holds the
      larger of the two. Without checkpointing only eager's pre-softmax scores (forward_layer_temp) are
      transients made before the loss; backward's reuse the freed logits blocks (split, should_split);
    - TRL's ``chunked_nll``: the chunks' blocks its chain leaves cached (``trl_stranded_bytes``).
    """
    wb = p.weights
    T, B, L = train.tokens, train.micro_batch, train.seq_len
    c = train.precision.compute.bytes
    s = residual_bytes(train, wb)
    H, V = m.hidden_size, m.vocab_size
    I = _decoder_mlp_width(m)  # noqa: E741
    logits_hole = c * V * T if (train.loss is Loss.STANDARD and c != 4) else 0
    if train.loss is Loss.CHUNKED_NLL:
        return trl_stranded_bytes(m, train, cublas_workspace_block(p))
    if not wb.trainable_layers or train.loss is not Loss.STANDARD:
        # A fused or chunked loss makes no V·T-sized request at its peak: its chunk-sized requests are cut from
        # whatever the layers' transients left cached (get_free_block's best fit splits larger blocks), so
        # nothing is stranded there.
        return logits_hole
    fwd = p.forward_layer_temp
    if not train.grad_ckpt:
        return logits_hole + fwd
    fwd += (2 * c * I + s * H) * T
    bwd = p.layer_bytes + p.layer_scores_bytes + (2 * s * H + 3 * c * I) * T
    if train.attn is Attention.EAGER:
        bwd += (c + 4) * m.num_heads * L * L * B
    return logits_hole + max(fwd, bwd)


def trl_stranded_bytes(m: ModelSpec, train: TrainSpec, workspace: int) -> int:
    """TRL's ``chunked_nll``: the chain's blocks cached and free at its backward peak, from replaying the chain
    alone (``_trl_chain``) through the allocator model, the backward thread's cuBLAS workspace included.

    The trace replay (Qwen2.5-0.5B, TRL's LoRA config, 2 × 256: 3.15 GiB reserved) shows the mechanism. Forward
    runs the chunks under ``torch.utils.checkpoint`` without saving: the head's copy (``w.float()``, autocast's
    cast) is freed before the chunk's fp32 log-softmax, ``exp`` and product, which best fit cuts from its
    segment (``get_free_block``, ``should_split``). The recompute keeps the copy for mm's backward, so those
    fp32 blocks need segments of their own. The autograd thread's first matmul is the first recompute's
    (CublasHandlePool.cpp ``getCurrentCUDABlasHandle``: a handle and workspace per thread, allocated through the
    caching allocator and never freed); best fit puts the workspace in the smallest freed block that holds it,
    forward's l·k·V logits block, and from then on each chunk's logits are cut from an fp32 4·k·V block and one
    more fp32 block is made per recompute (bench/reserve/ causes: the segments step 1's backward makes are
    ``_log_softmax``, ``mul``, ``mul``, each 4·k·V). TRL's targets are B·(L−1) tokens (``labels[..., 1:]``), so
    the last chunk is shorter; backward recomputes it first (the engine runs the latest chunk's node first), and
    the segments it makes (rounded to 2 MiB, ``round_size``) can be too small for a full chunk's 4·k·V requests.
    The figure swings with the last chunk's size, B·(L−1) mod 256: by three to six fp32 4·256·V blocks with bf16
    weights or a trained head, by half of one under bf16-mixed LoRA (Qwen2.5-0.5B, Llama-3.2-1B/3B at 1 to 4
    × 1025-1280; not yet checked on traces at many lengths), so a single shape's is not monotone in L. A packed
    run meets one shape and gets it; a run with dynamic padding meets the shorter lengths too and keeps the
    segments they made (docs/reserve.md "Runs"), so it gets the most the chain strands at any target count in the
    swing's last period (``_trl_run_stranded``). Counted whatever else forward freed (a layer's transient larger
    than the workspace would take it instead: an over-estimate of at most one fp32 chunk block there).
    """
    if train.packing:
        return _trl_shape_stranded(m, train, workspace)
    return _trl_run_stranded(m, train, workspace)


def _trl_run_stranded(m: ModelSpec, train: TrainSpec, workspace: int) -> int:
    """The most the chain strands at any target count of the swing's last period, n' in (n − 256, n] with n =
    B·(L − 1): the shapes (b, ℓ) ≤ (B, L) a padded run meets (shorter batches, an epoch's last, partial batch)
    give target counts b·(ℓ − 1) there, and counting every n' there bounds them from above (by at most the
    swing) and never falls as n grows. Each at b = B's tokens n' + B, the most any b ≤ B gives. Lower target
    counts repeat the same last-chunk sizes, stranding less by the slice gradients (r·H·T, cut from the
    stranded blocks) that grow with the count, at a lower loss peak; they are left out."""
    n, B = train.micro_batch * (train.seq_len - 1), train.micro_batch
    dtypes = replace(train, micro_batch=1, seq_len=1)  # the chain's sizes depend on the shape only through n, T
    low = max(n - TRL_CHUNK_TOKENS + 1, 1)
    return max((_trl_chain_stranded(m, dtypes, k, k + B, workspace) for k in range(low, n + 1)), default=0)


def _trl_shape_stranded(m: ModelSpec, train: TrainSpec, workspace: int) -> int:
    """What the chain strands at one shape (TRL's targets are ``labels[..., 1:]``)."""
    n = train.micro_batch * (train.seq_len - 1)
    return _trl_chain_stranded(m, replace(train, micro_batch=1, seq_len=1), n, train.tokens, workspace)


@lru_cache(maxsize=8192)
def _trl_chain_stranded(m: ModelSpec, dtypes: TrainSpec, n: int, tokens: int, workspace: int) -> int:
    """``_trl_chain`` for ``n`` target tokens of a ``tokens``-token batch, replayed alone through the allocator
    model: its reserved less its allocated peak."""
    if n < 1:
        return 0
    t = trl_chunk(m, dtypes, tokens)
    k = min(tokens, TRL_CHUNK_TOKENS)
    short = n - k * (-(-n // k) - 1)
    last = trl_chunk(m, dtypes, short) if 0 < short < k else None
    seq = _Events()
    _trl_chain(seq, t, seq.alloc(t.hidden), workspace, last)
    reserved, allocated = replay_excess(tuple(seq.events))
    return max(reserved - allocated, 0)


def logits_blocks(m: ModelSpec, train: TrainSpec) -> tuple[int, ...]:
    """The blocks of the standard loss's logits chain, smallest first: the c·V·T logits (with c < 4), the fp32 copy
    (c < 4), the fp32 log-softmax and the fp32 ``_log_softmax_backward_data`` gradient, each 4·V·T (transformers
    ``ForCausalLMLoss``; the trace shows each in a segment of its own). None for a chunked or fused loss."""
    if train.loss is not Loss.STANDARD:
        return ()
    T, V, c = train.tokens, m.vocab_size, train.precision.compute.bytes
    fp32 = (4 * V * T,) * (3 if c != 4 else 2)
    return ((c * V * T,) if c != 4 else ()) + fp32


def peak_reserved(
    m: ModelSpec,
    train: TrainSpec,
    p: StepParts,
    loss_peak: int,
    step_peak: int,
    opt_peak: int | None = None,
    at: ShapePeaks | None = None,
) -> int:
    """Peak reserved of a run at (B, L), in closed form, from the caching allocator's rules; never falls as batch
    or length grows (the planner's searches need that).

    ``loss_peak``: allocated bytes at the forward or backward peak (inside the loss); ``step_peak``: the largest
    phase's allocated bytes; ``opt_peak``: allocated at ``optimizer.step()`` (default ``step_peak``); ``at``: the
    same peaks of the step at another shape (``StepParts`` and allocated bytes), for a run with dynamic padding.
    A packed run (``train.packing``), or a call without ``at``, gets the single shape's reserve without the
    mechanisms that switch off as the shape grows (``_single_shape``); a run with dynamic padding meets every
    shape up to (B, L) and keeps the segments each made, so it gets the largest single-shape reserve, those
    mechanisms included, over the shapes it meets (``held_reserved``).
    """
    opt_peak = step_peak if opt_peak is None else opt_peak
    if train.packing or at is None:
        return _single_shape(m, train, p, loss_peak, step_peak, opt_peak, _NONE)
    single = _single_shape(m, train, p, loss_peak, step_peak, opt_peak, Switching(relaid=True))
    return max(single, held_reserved(m, train, at, p))


def _single_shape(
    m: ModelSpec,
    train: TrainSpec,
    p: StepParts,
    loss_peak: int,
    step_peak: int,
    opt_peak: int,
    on: Switching,
) -> int:
    """Peak reserved of a steady-state step at one shape: the largest of these lower bounds.

    CUDACachingAllocator.cpp never releases a segment during training and serves a request only from a cached
    block at least as large (``get_free_block``, best fit; segments never merge), so reserved is the sum of the
    segments made so far:

    1. at step 2's loss peak, the stranded blocks (``stranded_bytes``) are cached on top of ``loss_peak``, less
       the states that sit in the c·V·T logits hole (allocated there, not stranded); plus, where a layer's c·I·T
       activations are larger than a decoder matrix's per-parameter tensors (b·H·I), the foreach temporaries'
       own segments, which no activation fits (``_temporaries_unused_by_activations``); with adapters, plus an
       fp32 logits block lost to the backward thread's cuBLAS workspace (``on.workspace``, ``_workspace_lost``);
    2. full fine-tuning: the optimizer creates its states S inside step 1 (torch/optim/adamw.py ``_init_group``,
       after backward), so step 1's loss peak reserves R1 = ``loss_peak`` − S + stranded, and step 1's optimizer
       at least ``opt_peak``. The states take the smallest cached blocks that hold them, the logits chain's
       (the largest) last; a logits block with a state inside cannot serve step 2's request of its own size, so
       step 2 makes it again: reserved = max(R1 + eager's backward segments (``_eager_backward_segments``),
       ``opt_peak``) + the blocks the states reach, counted at this shape (``on.relaid``, ``_relaid_counted``) or
       bounded by min(S, 3·4·V·T) (``_relaid_bytes``);
    3. full fine-tuning without checkpointing: ``opt_peak`` + the saved activations no per-parameter tensor of
       the optimizer fits (``on.activations``, ``_activations_unused``);
    4. a tied embedding's V·H gradient block made again in step 2, on top (``on.tied``, ``_tied_gradient_block``);
    5. an optimizer without step temporaries (SGD, fused AdamW): the end of backward (``_end_of_backward_bound``);
    6. Adafactor: its temporaries' own segments where they cannot pair up in the logits blocks (``on.temporaries``,
       ``_temporaries_bound``).
    Terms 1's temporaries and 2 to 6 are for trained base weights (full, freeze), whose per-parameter tensors are
    large-pool blocks the size of decoder matrices; adapters' are small, and the small pool's cached bytes
    (``small_pool_excess``) are added on top. The ``on`` terms switch off as the shape grows (``_NONE``: left out).
    """
    stranded = stranded_bytes(m, train, p)
    wb = p.weights
    if train.adapters or wb.largest_trainable_numel * wb.trainable_dtype.bytes <= K_SMALL_SIZE:
        lost = _workspace_lost(m, train, p) if on.workspace else 0
        cached = adapter_forward_cache(m, train, p)
        remade = softcap_block(m, train) if on.softcap else 0
        tails = load_tails(m, train, p)
        return max(step_peak, loss_peak + stranded + lost + cached + remade + tails) + small_pool_excess(train, p)
    r1 = max(loss_peak - p.state_bytes + stranded, 0)
    chain = logits_blocks(m, train)
    hole = chain[0] if len(chain) == 4 else 0  # the c·V·T logits block (c < 4): the first the states fill
    in_hole = min(_states_in_logits(m, train, p, r1, stranded), hole)
    return (
        max(
            step_peak,
            loss_peak + stranded - in_hole + _temporaries_unused_by_activations(m, train, p),
            max(r1 + _eager_backward_segments(m, train), opt_peak)
            + (_relaid_counted(m, train, p) if on.relaid else _relaid_bytes(m, train, p)),
            opt_peak + (_activations_unused(p) if on.activations else 0),
            _end_of_backward_bound(m, train, p, opt_peak, on),
            _temporaries_bound(m, train, p, loss_peak + stranded, on),
        )
        + small_pool_excess(train, p)
        + (_tied_gradient_block(p) if on.tied else 0)
    )


# Three mechanisms the replay shows switch OFF as the shape grows: a longer batch brings a block large enough
# for what was stranded (the backward thread's cuBLAS workspace in an fp32 logits block, adapters; activation
# blocks too small for the optimizer, full without checkpointing; a tied embedding's gradient block, full). A
# single shape's reserve therefore falls from one length to the next. A run with dynamic padding meets shorter
# batches too, and the allocator never gives their segments back: replayed through one allocator, a run whose
# first steps are at a shorter length reserves at least what that length reserves on its own, and every longer
# step adds its own segments on top (bench/reserve/runs.jsonl, docs/reserve.md "Runs"; Llama-3.2-3B full,
# bf16-true, 4 × 768: 39.9 GiB when two steps at 648 tokens come first, 34.7 GiB for 768 alone). So the estimate
# of such a run is the largest single-shape reserve, these mechanisms included, over the shapes ≤ (B, L): the
# shorter batches of B sequences and the last, partial batch of an epoch (fewer sequences). Each mechanism is on
# over a set of shapes closed downwards, and what it adds grows inside that set, so the largest is at a shape on
# the set's upper edge (``_largest_on``); the set grows with (B, L), so the estimate never falls.


class Switching(NamedTuple):
    """Which of the mechanisms that switch off as the shape grows are counted."""

    workspace: bool = False
    activations: bool = False
    tied: bool = False
    temporaries: bool = False
    relaid: bool = False
    """The blocks step 2 makes again counted at this shape (``_relaid_counted``; a run with dynamic padding);
    False: the bound min(S, 3·4·V·T) (``_relaid_bytes``), which never falls as the shape grows."""
    softcap: bool = False


_NONE = Switching()

ShapePeaks = Callable[[TrainSpec], tuple[StepParts, int, int, int]]
"""The step at another shape: its ``StepParts``, and allocated bytes at the loss's peak, the step's peak and the
optimizer's peak (analytic/step.py)."""


def held_reserved(m: ModelSpec, train: TrainSpec, at: ShapePeaks, p: StepParts | None = None) -> int:
    """The largest single-shape reserve, the switching mechanisms included, over the shapes ≤ (B, L) where they
    are on (0 where none is on anywhere); each set's upper edge is enough (see above). Beyond the largest
    micro-batch and length where a mechanism is on nothing changes, so the figure is computed (and cached) for
    (B, L) capped there: the planner asks for many shapes past the edge. ``p``: the step at (B, L), when the
    caller has it (default ``at(train)``)."""
    regions = _regions(m, train, at(train)[0] if p is None else p)
    if not regions:
        return 0
    B = max((pts[-1][0] for _, pts in regions if pts), default=1)
    L = max((ell for _, pts in regions for _, ell in pts), default=1)
    return _held_capped(m, replace(train, micro_batch=min(B, train.micro_batch), seq_len=min(L, train.seq_len)), at)


@lru_cache(maxsize=4096)
def _held_capped(m: ModelSpec, train: TrainSpec, at: ShapePeaks) -> int:
    best = 0
    for which, points in _regions(m, train, at(train)[0]):
        # (b, ℓ_b) with ℓ_(b+1) = ℓ_b lies under (b + 1, ℓ_b): the reserve grows with b, so it is left out
        edge = [pt for pt, nxt in zip(points, [*points[1:], (0, 0)], strict=False) if nxt[1] < pt[1]]
        for b, ell in edge:
            t = replace(train, micro_batch=b, seq_len=ell)
            pt, loss, step, opt = at(t)
            best = max(best, _single_shape(m, t, pt, loss, step, opt, which._replace(relaid=True)))
    return best


def _regions(m: ModelSpec, train: TrainSpec, p: StepParts) -> list[tuple[Switching, list[tuple[int, int]]]]:
    """Each switching mechanism (and activations with tied together) that applies, with the upper edge of the
    shapes ≤ (B, L) where it is on (``_largest_on``)."""
    on = _switching(m, train, p)
    regions: list[tuple[Switching, Callable[[int, int], bool]]] = []
    if on.workspace is not None:
        regions.append((Switching(workspace=True), on.workspace))
    if on.activations is not None:
        regions.append((Switching(activations=True), on.activations))
    if on.tied is not None:
        regions.append((Switching(tied=True), on.tied))
        if on.activations is not None:
            both, act, tied = Switching(activations=True, tied=True), on.activations, on.tied
            regions.append((both, lambda b, ell: act(b, ell) and tied(b, ell)))
    temporaries = _temporaries_switch(m, train, p)
    if temporaries is not None:
        regions.append((Switching(temporaries=True), temporaries))
    regions += [(Switching(relaid=True), on_k) for on_k in _relaid_regions(m, train, p)]
    out = [(which, _largest_on(train.micro_batch, train.seq_len, region)) for which, region in regions]
    band = _workspace_band(m, train, p)
    if band:
        out.append((Switching(workspace=True), band))
    softcap = softcap_remade(m, train) if train.adapters else None
    if softcap is not None:  # on and off every few tokens: the latest shape ≤ (b, L) where it is on
        out.append((Switching(softcap=True), latest_on(train.micro_batch, train.seq_len, softcap)))
    return out


class _Predicates(NamedTuple):
    workspace: Callable[[int, int], bool] | None
    activations: Callable[[int, int], bool] | None
    tied: Callable[[int, int], bool] | None


def _switching(m: ModelSpec, train: TrainSpec, p: StepParts) -> _Predicates:
    """For each switching mechanism that applies to the setup, whether it is on at (b, ℓ) (None: it never is)."""
    wb = p.weights
    c, bw = train.precision.compute.bytes, wb.trainable_dtype.bytes
    standard = train.loss is Loss.STANDARD and c != 4 and wb.trainable_layers
    adapters = train.adapters or wb.largest_trainable_numel * bw <= K_SMALL_SIZE
    workspace = activations = tied = None
    if adapters and train.adapters and standard:
        ws = cublas_workspace_block(p)
        per_token = max(_workspace_rivals_per_token(m, train, p))
        # eager's scores ∝ b·ℓ², DoRA's weight norm constant (StepParts.forward_layer_temp)
        scores, B, L = p.forward_layer_temp - p.dora_temp, train.micro_batch, train.seq_len

        def workspace(b: int, ell: int) -> bool:
            layer_temp = p.dora_temp + scores * b * ell * ell // (B * L * L)
            return max(per_token * b * ell, layer_temp) < ws and softmax32(b, ell) <= ws

        def softmax32(b: int, ell: int) -> int:
            """Eager's fp32 softmax, freed once cast back (transformers ``eager_attention_forward``:
            ``softmax(attn_weights, dtype=torch.float32).to(query.dtype)``): 4·nh·ℓ² per sequence. One exactly the
            workspace's size does not take it in the replay (Llama-3.2-1B LoRA eager 1 × 512: 32 MiB)."""
            return 4 * m.num_heads * b * ell * ell if train.attn is Attention.EAGER else 0

    if not adapters and wb.trainable_layers and not train.grad_ckpt:
        # c·I·T < b·H·I ⟺ c·T < b·H (_activations_unused)
        def activations(b: int, ell: int) -> bool:
            return c * b * ell < bw * m.hidden_size

    tied_states = (
        m.tie_word_embeddings and wb.embedding_trainable and (p.state_bytes >= p.grad_bytes or not p.state_bytes)
    )
    if not adapters and standard and tied_states:
        # 4·V·T < V·H·b ⟺ 4·T < H·b (_tied_gradient_block)
        def tied(b: int, ell: int) -> bool:
            return 4 * b * ell < bw * m.hidden_size

    return _Predicates(workspace, activations, tied)


def _largest_on(B: int, L: int, on: Callable[[int, int], bool]) -> list[tuple[int, int]]:
    """For each micro-batch b ≤ B, the longest length ℓ ≤ L with ``on(b, ℓ)`` (``on`` holds on every smaller
    shape where it holds; micro-batches where it holds at no length are left out)."""
    out = []
    hi_b = L
    for b in range(1, B + 1):
        if not on(b, 1):
            break
        lo, hi = 1, hi_b  # closed downwards: ℓ_(b+1) ≤ ℓ_b
        while lo < hi:  # the largest ℓ with on(b, ℓ)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if on(b, mid) else (lo, mid - 1)
        out.append((b, lo))
        hi_b = lo
    return out


def _workspace_band(m: ModelSpec, train: TrainSpec, p: StepParts) -> list[tuple[int, int]]:
    """Adapters, eager attention, no checkpointing: for each micro-batch b ≤ B, the longest ℓ ≤ L at which the
    logits leave the workspace no eager block (the upper edge of a band of lengths, not a set closed downwards).

    Without checkpointing every layer's freed score blocks are cut by the next layer's saved activations, and the
    last layer's by its MLP's; its fp32 softmax input (transformers ``eager_attention_forward``:
    ``softmax(attn_weights, dtype=torch.float32)``, 4·nh·ℓ² per sequence, freed once cast back) is the one left
    whole, and the c·V·T logits, made next, are cut from it where they fit (best fit, ``get_free_block``). Where
    the rest is smaller than the backward thread's workspace, and every other block forward freed is too
    (``_workspace_rivals_per_token``), the workspace takes an fp32 logits block as ``_workspace_lost`` describes.
    The trace replay (custom 8-layer Llama, LoRA, 2 × ℓ) shows it: 476 MiB over allocated at ℓ = 1024 (the logits,
    125 MiB, in the 128 MiB softmax block), 233 MiB at 864 (they do not fit) and 351 MiB at 1216 (the rest, 32.06
    MiB, holds the workspace) (bench/reserve/runs.jsonl). The band starts where the logits fit (ℓ ≥ c·V/(4·nh))
    and ends where the rest holds the workspace, or where a forward block does.
    """
    wb = p.weights
    c = train.precision.compute.bytes
    eager = train.attn is Attention.EAGER and not train.grad_ckpt
    if not (train.adapters and eager and train.loss is Loss.STANDARD and c != 4 and wb.trainable_layers):
        return []
    ws = cublas_workspace_block(p)
    per_token = max(_workspace_rivals_per_token(m, train, p))
    V, nh = m.vocab_size, m.num_heads
    if p.dora_temp >= ws:
        return []

    lo = -(-c * V // (4 * nh))  # the logits fit from here on: c·V·b·ℓ ≤ 4·nh·b·ℓ²
    out = []
    for b in range(1, train.micro_batch + 1):
        top = min(train.seq_len, (ws - 1) // (per_token * b))  # longer, a block forward freed holds the workspace

        def holds(ell: int, b: int = b) -> bool:
            """The rest holds the workspace (it grows with ℓ ≥ lo; the 2 MiB rounding of the softmax block's
            segment is left out, so that the band's edge never moves back as L grows)."""
            return 4 * nh * b * ell * ell - c * V * b * ell >= ws

        hi = _first(lo, max(lo, top) + 1, holds)
        ell = min(top, top + 1 if hi is None else hi - 1)
        if ell >= lo and 4 * nh * b * ell * ell >= K_MIN_LARGE_ALLOC:  # the softmax block is a segment of its own
            out.append((b, ell))
    return out


def _first(lo: int, hi: int, cond: Callable[[int], bool]) -> int | None:
    """The smallest ℓ in [lo, hi] with ``cond`` (which holds from some ℓ on), or None."""
    if not cond(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if cond(mid) else (mid + 1, hi)
    return lo


def cublas_workspace_block(p: StepParts) -> int:
    """One handle's cuBLAS workspace: the one large-pool block each thread's first matmul allocates. ``p`` holds
    both threads' cuBLAS + cuBLASLt workspaces (analytic/overhead.py ``cublas_workspace_bytes``); the architecture
    whose figures add up to it gives the cuBLAS one (catalog/device_overhead.json)."""
    from vramledger.catalog.device_overhead import device_overhead, known_archs

    for arch in ("hopper", *known_archs()):
        ov = device_overhead(arch)
        if sum(ov.workspace_sizes()) == p.workspace_bytes:
            return ov.cublas_workspace.bytes
    return device_overhead("hopper").cublas_workspace.bytes


def _workspace_rivals_per_token(m: ModelSpec, train: TrainSpec, p: StepParts) -> list[int]:
    """Bytes per token of the blocks forward frees that could take the backward thread's workspace instead of a
    logits block: the fp32 norm intermediates (4·H), PEFT's fp32 casts of an adapted layer's input (4·in, with
    fp32 adapters), under checkpointing a layer's c·I MLP intermediates."""
    wb = p.weights
    out = [4 * m.hidden_size]
    if wb.trainable_dtype.bytes == 4:
        out.append(4 * max((a.linear.in_features for a in wb.adapted), default=0))
    if train.grad_ckpt:
        out.append(train.precision.compute.bytes * _decoder_mlp_width(m))
    return out


def _workspace_lost(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """Adapters: an fp32 logits block lost to the backward thread's cuBLAS workspace, cached at the loss's peak.

    torch CublasHandlePool.cpp ``getCurrentCUDABlasHandle`` gives the autograd engine's thread its own handle,
    whose workspace (``getChosenWorkspaceSize``: 32 MiB on Hopper) is allocated through the caching allocator at
    that thread's first matmul (step 1's backward) and never freed. Best fit puts it in the smallest free block
    that holds it. With adapters the blocks freed in forward are PEFT's fp32 casts of an adapted layer's input
    (``lora.Linear.forward`` ``_cast_input_dtype``: 4·in·T), the fp32 norm intermediates (4·H·T), eager's
    scores, DoRA's weight norm and, under checkpointing, a layer's c·I·T MLP intermediates; when all are smaller
    than the workspace (``_switching``) it lands in a freed fp32 copy of the logits (4·V·T), and from step 2 on
    backward makes one more 4·V·T block: 4·V·T − workspace more is cached at the loss's peak (the replay shows it
    in every LoRA config where the rule applies: bench/reserve/replay_causes.jsonl).
    """
    return max(4 * m.vocab_size * train.tokens - cublas_workspace_block(p), 0)


def _activations_unused(p: StepParts) -> int:
    """Full fine-tuning without checkpointing where c·I·T < b·H·I (``_switching``): every activation block is
    smaller than a decoder matrix's gradient, state or foreach temporary (b·H·I), so ``optimizer.step()`` makes
    its own segments and the saved activations' stay cached at its peak (bench/reserve/replay_causes.jsonl)."""
    return p.saved_layers_bytes + p.scores_bytes + p.extra_saved_bytes


def _tied_gradient_block(p: StepParts) -> int:
    """A V·H gradient block step 2 makes again for a tied embedding (full fine-tuning), where 4·V·T < V·H·b.

    With tied weights backward holds three V·H tensors at once: lm_head's gradient (already in ``.grad``), the
    embedding's (``embedding_dense_backward``) and their sum (AccumulateGrad's out-of-place ``add``). After step 1
    the two freed ones are exactly the size of the embedding's states, which ``_init_group`` creates first (the
    embedding is the first parameter), so best fit puts the states there. Step 2's backward then finds two V·H
    blocks (the sum's, freed by ``zero_grad``, and the foreach temporary's of step 1's optimizer) and, where the
    freed fp32 logits blocks are smaller than V·H, nothing else: it makes one more (the replay shows the ``add``
    block made in step 2). Not seen with an fp32 compute dtype (Llama-3.2-1B fp32 in the grid: the replay makes
    no such block; why is not known), so not applied there (``_switching``).
    """
    return p.weights.lm_head_weight_numel * p.weights.trainable_dtype.bytes


def _decoder_mlp_width(m: ModelSpec) -> int:
    """I: the MLP width one token goes through (top-k experts' for a MoE)."""
    return m.moe_intermediate_size * m.experts_per_token if m.is_moe else m.intermediate_size


def _activations_too_small_for_parameters(m: ModelSpec, train: TrainSpec, p: StepParts) -> bool:
    """No checkpointing and c·I·T < b·H·I: no gradient, state or foreach temporary of a decoder matrix fits in an
    activation block."""
    c, b = train.precision.compute.bytes, p.weights.trainable_dtype.bytes
    I = _decoder_mlp_width(m)  # noqa: E741
    return not train.grad_ckpt and c * I * train.tokens < b * m.hidden_size * I


def _temporaries_unused_by_activations(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """The foreach temporaries' segments, cached at step 2's loss peak where every c·I·T activation is larger than
    a decoder matrix's per-parameter tensor (b·H·I) and so cannot use them (term 1)."""
    c, b = train.precision.compute.bytes, p.weights.trainable_dtype.bytes
    I = _decoder_mlp_width(m)  # noqa: E741
    if train.grad_ckpt or not p.weights.trainable_layers or c * I * train.tokens <= b * m.hidden_size * I:
        return 0
    return p.step_temp_bytes


def _states_in_logits(m: ModelSpec, train: TrainSpec, p: StepParts, r1: int, stranded: int) -> int:
    """Bytes of optimizer states step 1 puts into the logits chain's blocks.

    The cache outside the logits blocks after step 1's backward is R1 less the weights, the chain and the
    stranded blocks (none of it usable when the activation blocks are too small); the gradients G are already
    in it. States beyond what is left go into the logits blocks; and one state of the V·H embedding (or lm_head)
    goes there anyway when it is larger than every activation block (c·I·T, a layer's forward transients).
    """
    S = p.state_bytes
    chain = logits_blocks(m, train)
    if not S or not chain:
        return 0
    wb = p.weights
    W = p.frozen_bytes + p.trainable_bytes + p.master_bytes + p.workspace_bytes
    outside = 0
    if not _activations_too_small_for_parameters(m, train, p):
        outside = max(r1 - W - sum(chain) - stranded, 0)
    into = min(S, max(S + p.grad_bytes - outside, 0))
    n_states = max(round(S / max(p.grad_bytes, 1)), 1)
    one_state = wb.lm_head_weight_numel * S // max(n_states * wb.trainable_params, 1)
    if one_state > max(train.precision.compute.bytes * _decoder_mlp_width(m) * train.tokens, p.forward_layer_temp):
        into = max(into, one_state)
    return into


def _relaid_bytes(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """fp32 logits bytes step 2 makes again because step 1's states sit in those blocks (term 2).

    Step 2's backward needs three fp32 4·V·T blocks at once (the saved log-softmax and two gradients); the space
    the states took in them is made again, up to the states' size. A request no larger than the V·H gradient
    (lm_head's or the embedding's) finds a freed gradient or foreach-temporary block instead. Counted as if the
    states went into the logits blocks whatever else is cached (an over-estimate where they fit in activation
    blocks): the bytes they really take there shrink as a longer sequence brings larger activation blocks, and
    the estimate must not fall with the shape.
    """
    chain = logits_blocks(m, train)
    fp32 = [x for x in chain if x == 4 * m.vocab_size * train.tokens]
    head = p.weights.lm_head_weight_numel * p.weights.trainable_dtype.bytes
    if not p.state_bytes or not fp32 or fp32[0] <= head:
        return 0
    return min(p.state_bytes, sum(fp32))


# Optimizers whose step makes no temporaries (SGD, fused AdamW, the 8-bit ones): the step's last allocations are not
# in ``optimizer.step()`` but at the end of backward, where a tied embedding's gradient and its sum with lm_head's
# are live beside every gradient and state (analytic/parts.py ``tied_gradient_sum``). What the blocks freed before
# then cannot hold stays cached there: the bench's replays of SGD and fused AdamW put the step's peak reserved at
# that moment (bench/reserve/replay_causes.jsonl; docs/reserve.md "Optimizers other than foreach AdamW").


def _end_of_backward_bound(m: ModelSpec, train: TrainSpec, p: StepParts, opt_peak: int, on: Switching) -> int:
    """Reserved at the end of backward for full fine-tuning with an optimizer that makes no step temporaries (0
    otherwise: a foreach step's temporaries make its own moment the larger, term 3 of ``_single_shape``).

    Allocated there: the optimizer's moment (weights, gradients, states) plus the embedding's new V×H gradient and
    the tied sum (analytic/step.py ``_end_of_backward``). Cached and free:
    the saved activations where they are too small for a decoder matrix's gradient (``on.activations``, as in term
    3: backward has freed them all by then), the autocast copies no per-parameter tensor fits (``_casts_unused``),
    and with states the fp32 logits block step 2 makes again (``_relaid_without_temporaries``).
    """
    wb = p.weights
    if p.step_temp_bytes or train.adapters or wb.largest_trainable_numel * wb.trainable_dtype.bytes <= K_SMALL_SIZE:
        return 0
    allocated = opt_peak + embedding_gradient_before_accumulation(m, train, p) + tied_gradient_sum(m, train, p)
    cached = (_activations_unused(p) if on.activations else 0) + _casts_unused(m, train, p)
    return allocated + cached + _relaid_without_temporaries(m, train, p)


def _relaid_without_temporaries(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """One fp32 logits block (4·V·T) step 2 makes again when step 1's optimizer created states and freed no
    temporaries (fused AdamW), where 4·V·T is no larger than the V·H gradient (above it ``_relaid_bytes`` counts
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


def _casts_unused(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
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
# estimate leaves it out, a run with dynamic padding holds it at the edge of the shapes where it is on.


def _temporaries_switch(m: ModelSpec, train: TrainSpec, p: StepParts) -> Callable[[int, int], bool] | None:
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


def _temporaries_bound(m: ModelSpec, train: TrainSpec, p: StepParts, loss_reserved: int, on: Switching) -> int:
    """Where Adafactor's temporaries cannot pair up (``on.temporaries``): the loss's reserve (``loss_reserved``, term
    1's loss peak + stranded) plus k segments of t made for them (see above); 0 otherwise."""
    t = _step_temporary(m, train, p)
    if not on.temporaries or not t:
        return 0
    return loss_reserved + p.step_temp_bytes // t * t


def remade_blocks(m: ModelSpec, train: TrainSpec) -> tuple[int, tuple[int, ...]]:
    """The c·V·T logits block (0 with c = 4), and the blocks step 2's backward needs whole, in the order step 1's
    optimizer states reach them: the standard loss's fp32 4·V·T logits blocks (three with c < 4: the fp32 copy,
    the log-softmax, ``_log_softmax_backward_data``'s gradient; two with c = 4), then, with eager attention, the
    two fp32 4·nh·L² blocks per sequence of a layer's attention backward (the upcast gradient of the probabilities
    and ``_softmax_backward_data``'s output: transformers ``eager_attention_forward`` computes the softmax in fp32).
    Empty for a chunked or fused loss."""
    chain = logits_blocks(m, train)
    if not chain:
        return 0, ()
    hole = chain[0] if len(chain) == 4 else 0
    fp32 = chain[1:] if hole else chain
    eager = 4 * m.num_heads * train.seq_len * train.seq_len * train.micro_batch
    return hole, fp32 + ((eager, eager) if train.attn is Attention.EAGER else ())


def blocks_with_states(S: int, hole: int, blocks: tuple[int, ...]) -> int:
    """How many of ``blocks`` step 1's optimizer states S reach, counted as if they all go into the logits chain
    and these blocks: what the c·V·T block (``hole``) cannot hold spills into them in order, each whole one after
    the previous one is full.

    torch/optim/adam.py ``Adam._init_group`` (AdamW subclasses it) creates ``exp_avg`` then ``exp_avg_sq`` with
    ``torch.zeros_like``, parameter by parameter, after step 1's backward, into whatever the cache holds. Each takes
    the smallest cached block at least as large (CUDACachingAllocator.cpp ``get_free_block``, best fit), and a
    larger one is split, its rest staying cached (``alloc_found_block``, ``should_split``): the c·V·T block fills
    first, and a split block's rest, smaller than a whole one, before the next whole one.
    bench/reserve/replay_states.jsonl measures it: step 2 makes again the counted number of fp32 logits blocks on
    17 of the 24 full fine-tuning configs with AdamW where 4·V·T exceeds the V·H gradient (the gradients, placed
    in step 1's backward, fill the activation blocks the states could otherwise use); one block off on the others.

    >>> blocks_with_states(S=300, hole=50, blocks=(100, 100, 100))  # 250 past the hole: three blocks reached
    3
    >>> blocks_with_states(S=120, hole=50, blocks=(100, 100, 100))
    1
    """
    spill, reached = S - hole, 0
    for size in blocks:
        if spill <= 0:
            break
        reached, spill = reached + 1, spill - size
    return reached


def _relaid_regions(m: ModelSpec, train: TrainSpec, p: StepParts) -> list[Callable[[int, int], bool]]:
    """For each k ≥ 1, where the states reach at least k of the blocks step 2 needs whole (``blocks_with_states``),
    for full fine-tuning with AdamW and the standard loss: a set of shapes (b, ℓ) closed downwards (the blocks grow
    with the shape, the states do not). None with adapters, another optimizer or a chunked or fused loss."""
    wb = p.weights
    small = wb.largest_trainable_numel * wb.trainable_dtype.bytes <= K_SMALL_SIZE
    _, blocks = remade_blocks(m, train)
    if train.adapters or small or not blocks or not wb.trainable_layers or train.optimizer not in _ADAM_INIT_GROUP:
        return []

    def reached(b: int, ell: int) -> int:
        hole, at = remade_blocks(m, replace(train, micro_batch=b, seq_len=ell))
        return blocks_with_states(p.state_bytes, hole, at)

    out: list[Callable[[int, int], bool]] = []
    for k in range(1, len(blocks) + 1):

        def on(b: int, ell: int, k: int = k) -> bool:
            return reached(b, ell) >= k

        out.append(on)
    return out


# torch.optim.AdamW in its three implementations: states created by Adam._init_group (torch/optim/adam.py).
_ADAM_INIT_GROUP = (Optimizer.ADAMW, Optimizer.ADAMW_FUSED, Optimizer.ADAMW_FORLOOP)


def _relaid_counted(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """The blocks step 2 makes again because step 1's states sit in them, counted at this shape (term 2,
    ``on.relaid``): none where the states fit in the c·V·T logits block, the blocks they reach made again whole
    where they reach two or more (``blocks_with_states``), the bound min(S, 3·4·V·T) in between.

    A block with a state inside cannot serve step 2's request of its own size (``get_free_block`` needs one free
    block at least that large; blocks of different segments never merge, ``try_merge_blocks``), so each block a
    state reached is made again whole: the blocks' bytes, not the states' (Qwen2.5-0.5B full, 8 × 512: states of
    1.59 fp32 logits blocks, two made again, 4.98 GB, where min(S, 3·4·V·T) counts 3.95 GB; Llama-3.2-3B eager,
    2 × 2048: the three fp32 logits blocks and an eager backward block; Qwen3-0.6B 4 × 4096: states 0.48 of a
    4·V·T block, the c·V·T block 0.5, none made again). Where the count is one (S − c·V·T < 4·V·T), whether a
    state reaches an fp32 block at all depends on the room the gradients leave in the c·V·T block and the
    activation blocks, which the estimate does not model (replay_states.jsonl: Qwen2.5-0.5B 16 × 256 one block,
    Qwen2.5-1.5B 8 × 512 three): there the bound stays. The count falls as the shape grows, so a run with dynamic
    padding counts it at the longest shapes ≤ (B, L) where it is at least 1, 2, … (``_relaid_regions``,
    ``held_reserved``); a packed run keeps the bound. As in ``_relaid_bytes``, where a 4·V·T request is no larger
    than the V·H gradient it finds a freed gradient block instead (0 then).
    """
    hole, blocks = remade_blocks(m, train)
    if train.optimizer not in _ADAM_INIT_GROUP or not blocks:
        return _relaid_bytes(m, train, p)
    head = p.weights.lm_head_weight_numel * p.weights.trainable_dtype.bytes
    reached = blocks_with_states(p.state_bytes, hole, blocks)
    if blocks[0] <= head or reached == 0:
        return 0
    return _relaid_bytes(m, train, p) if reached == 1 else sum(blocks[:reached])


def _eager_backward_segments(m: ModelSpec, train: TrainSpec) -> int:
    """Eager attention's two fp32 backward blocks, made as new segments after step 1's loss peak where they are
    larger than every block backward has freed by then (full fine-tuning, the standard loss).

    A layer's attention backward holds two fp32 4·nh·L² blocks per sequence at once (``remade_blocks``). The
    largest blocks freed by then are the fp32 4·V·T logits blocks; where 4·nh·L²·B > 4·V·T (nh·L > V) best fit
    finds none that holds them (``get_free_block``) and two segments are made on top of step 1's loss-peak reserve
    (mid toy model of bench/reserve/, eager, 1 × 2048, nh·L = 32,768 > V = 32,000: the replay reserves 6.12 GB
    at step 1's loss peak and 6.67 GB before its optimizer, the two 268 MB blocks of ``_to_copy`` and
    ``_softmax_backward_data`` made in between)."""
    if train.attn is not Attention.EAGER or train.loss is not Loss.STANDARD:
        return 0
    eager = 4 * m.num_heads * train.seq_len * train.seq_len * train.micro_batch
    return 2 * eager if eager > 4 * m.vocab_size * train.tokens else 0
