"""DDP full fine-tuning, and one GPU's: step 1's optimizer peak replayed with the blocks the allocator rounds, in
place of the single-GPU model's stand-in for it where the MLP's activation blocks are under 10 MiB, and under
checkpointing.

Legend: T tokens, H hidden, I MLP width, c compute-dtype bytes, b bytes of a trainable parameter (and of its
gradient, states and foreach temporary), P the trainable parameters.

What the trace shows (bench/distributed/grid.jsonl; the mid model of bench/distributed, full, bf16-mixed, 1 × 1024,
DDP on 2 or 8 ranks): reserved is reached at step 1's optimizer peak (3,774 MiB), where the ledger reads it, and
does not grow again before step 2's optimizer step; 144 MiB over the 3,630 MiB asked for, of which 109 MiB are not
free at all: they are the rests of blocks the per-parameter tensors hold. CUDACachingAllocator.cpp
``get_allocation_size`` rounds a request of at least 10 MiB (kMinLargeAlloc) up to 2 MiB (kRoundLarge) for its
segment, and ``alloc_found_block`` splits a block only where ``should_split`` holds: for the large pool, a rest above
kSmallSize (1 MiB). So an fp32 MLP matrix's tensor (1024 × 2816 × 4 B = 11 MiB) in its own 12 MiB segment keeps
the 1 MiB rest inside its block, and so do a 125 MiB V·H tensor in 126 MiB and a 4 MiB q or o tensor cut from a
5 MiB rest: the load's weights, 23 states, all 24 foreach temporaries (``_foreach_sqrt``, torch/optim/adam.py
``_multi_tensor_adam``), 109 MiB in all. The other 35 MiB are free, mostly in the 20 MiB kLargeBuffer segments the
layers' 5.5 MiB c·I·T blocks shared. The single-GPU step at the same shape holds the same 142 MiB over its requests
(3,178 against 3,036 MiB), so the miss is not DDP's: with bf16 weights every such tensor is half as large (5.5 MiB
MLP tensors are cut from 20 MiB segments and split), which is why only bf16-mixed missed.

The single-GPU model (analytic/reserve/held_activations.py ``optimizer_peak_bound``) counts, where c·I·T < 10 MiB,
every saved activation as cached at the optimizer's peak (433 MiB here), a stand-in its docstring says the replays
do not bear out. Under DDP this module replaces that term by the two steps written out (analytic/reserve/spill.py's
sequence: amp_layer.py's ``AmpLayer`` under autocast with fp32 weights) and replayed through the allocator model
(allocator/model.py, a port of CUDACachingAllocator.cpp), with what a DDP rank allocates around it:

- the trained weights first, one tensor each in ``named_parameters`` order (the embedding, each layer's projections,
  lm_head), from an empty cache: their segments and rests;
- DDP's gradient bucket: torch/nn/parallel/distributed.py ``_ddp_init_helper`` takes its size limits from
  ``_BucketCapacityConfig.compute_bucket_size_limits``, which without ``find_unused_parameters`` (or with
  ``static_graph``) is ``[sys.maxsize]`` ("disable initial bucketing ... put all params in one bucket initially"),
  and c10d reducer.cpp ``Reducer::initialize_buckets`` allocates that bucket's flat ``gradients`` (P·b) at
  construction (the trace: one ``empty`` of 594 MiB for the mid model);
- step 1's forward, loss and backward with each weight's gradient (``gradient_as_bucket_view=False``: autograd's
  own, copied into the bucket, reducer.cpp ``mark_variable_ready_dense``), both threads' cuBLAS workspaces,
  ``Adam._init_group``'s ``exp_avg`` and ``exp_avg_sq`` parameter by parameter, the foreach temporaries: step 1's
  optimizer peak, read as reserved less requested; then ``zero_grad`` and step 2's forward, loss and backward
  (where a tied embedding's gradient sum is made again), whose new segments go on top.

The rank's reserved is then its optimizer peak (``opt_peak``, which holds every byte the replay asks for and the
small ones it leaves out: the norms' weights, the small pool) plus the replay's excess there and what step 2 makes
again, or the rest of the single-GPU closed form, whichever is larger. On the mid model the replay holds 110 MiB of
rests at step 1's optimizer peak and 78 MiB free (its sequence leaves out backward's transients, which the trace cuts
from those segments): 3,816 MiB, +1.1%.

Under checkpointing (torch/utils/checkpoint.py, non-reentrant) the trace holds the same rests (3,774 MiB at 1 × 1024,
where the closed forms count none: 3,630 MiB, −3.8%); the replay runs each layer's forward and keeps its output and
autocast's weight copies only (``_checkpointed``), recomputes it before its backward: 3,760 MiB, −0.4%.

A packed run (one shape) takes that figure, at most what a run with dynamic padding gets at the same shape: that run
keeps the closed forms, which never fall as the shape grows (the replay's excess does: 196 MiB at 1 × 256, 172 at
1 × 384 on the mid model), and it holds the replay at one token, 1 × 1, the shortest shape it can meet, a figure that
(B, L) does not change (``_one_token``). There every activation is a small-pool block, so what the large pool caches
is the per-parameter tensors' rests and autocast's weight copies, freed in backward and too small for the fp32 MLP
tensors: 144 MiB on the mid model (the trace's excess at 1 × 1024 under checkpointing), 3.2 GiB on Llama-3.1-8B,
whose 112 MiB bf16 MLP copies cannot hold its 224 MiB fp32 states (traced at 1 × 128, 188,146 MiB: −0.5%, −1.8%
without it; 1 × 256 under checkpointing −0.2%, −1.9% without). Checked against the traces of
bench/distributed/grid.jsonl (tests/analytic/test_ddp_reserve.py).

One GPU: the same domain and the same replay without DDP's bucket (``_optimizer_peak_excess``: a single process
builds no Reducer), with its own source (``SINGLE_SOURCE``). Against the single-GPU grid's traced replays
(bench/reserve/replay_grid.jsonl, docs/reserve.md): Qwen3-0.6B full 1 × 1024 packed +8.2% → +0.3%, the 2-layer toy
1 × 256 −7.5% → −4.9% (packed and padded: its 1 × 1 figure binds), Qwen3-1.7B 1 × 256 packed +0.1% → −0.0%; no other
row moved.

Not modelled: DDP's bucket rebuild. After the first iteration ``Reducer::rebuild_buckets`` frees the one bucket and
allocates buckets of ``bucket_cap_mb`` (25 MiB) in the order gradients became ready, inside step 2's forward; the
trace skips it (trace/distributed.py ``_NoRebuild``: it syncs through real tensors), so neither side counts what
the new buckets take from step 1's cache.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache, partial

from vramledger.allocator.conf import K_MIN_LARGE_ALLOC
from vramledger.analytic.activations import computes_scores
from vramledger.analytic.params import layer_linears
from vramledger.analytic.parts import StepParts
from vramledger.analytic.reserve import ShapePeaks, training_peaks
from vramledger.analytic.reserve.amp_layer import AmpLayer
from vramledger.analytic.reserve.forward_cache import _NAMES, _Layer, _leaf, _Replay, mask_bytes
from vramledger.analytic.reserve.full import decoder_mlp_width
from vramledger.analytic.reserve.held_activations import mlp_tensors_unfit
from vramledger.analytic.reserve.runs import (
    closed_at,
    closed_below,
    lattice_envelope,
    on_at,
    parts_of,
    peak_reserved,
    replay_figure,
)
from vramledger.analytic.reserve.shape import single_shape
from vramledger.analytic.reserve.spill import (
    _backward,
    _loss,
    embedding_gradients,
    forward_backward,
    sequence_modelled,
)
from vramledger.analytic.reserve.workspace import cublas_workspace_block
from vramledger.ledger import Phase
from vramledger.specs import ModelSpec, Optimizer, TrainSpec

SOURCE = (
    "DDP, full fine-tuning: step 1's optimizer peak replayed through the allocator model (the trained weights, "
    "DDP's one first-iteration gradient bucket, torch/nn/parallel/distributed.py compute_bucket_size_limits "
    "[sys.maxsize]; the two steps of analytic/reserve/spill.py, checkpointed layers recomputed): blocks of 10 MiB "
    "and more rounded up to 2 MiB keep rests of at most 1 MiB unsplit (CUDACachingAllocator.cpp "
    "get_allocation_size, should_split); a packed run at its shape where c·I·T < 10 MiB, a run with dynamic "
    "padding at one token (analytic/distributed/ddp_reserve.py)"
)
SINGLE_SOURCE = (
    "Full fine-tuning on one GPU: step 1's optimizer peak replayed through the allocator model (the trained weights; "
    "the two steps of analytic/reserve/spill.py, checkpointed layers recomputed; no gradient bucket): blocks of "
    "10 MiB and more rounded up to 2 MiB keep rests of at most 1 MiB unsplit (CUDACachingAllocator.cpp "
    "get_allocation_size, should_split); a packed run at its shape where c·I·T < 10 MiB, a run with dynamic "
    "padding at one token (analytic/distributed/ddp_reserve.py, the DDP rank's replay without DDP's bucket)"
)


class _Counted(_Replay):
    """The replay with the bytes each block was asked for (reserved less requested is the excess)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: dict[int, int] = {}

    def alloc(self, size: int) -> int:
        i = super().alloc(size)
        self.asked[i] = size
        return i

    def free(self, i: int) -> None:
        super().free(i)
        del self.asked[i]

    @property
    def excess(self) -> int:
        return self.model.reserved - sum(self.asked.values())


def replayed(m: ModelSpec, train: TrainSpec, p: StepParts) -> bool:
    """Whether ``ddp_peak_reserved`` replays the step at its own shape: ``_in_domain``, a packed run, and c·I·T under
    10 MiB: where, without checkpointing, the single-GPU model has only its stand-in (held_activations.py
    ``optimizer_peak_bound``: c·I·T in a segment smaller than an MLP matrix's per-parameter tensor,
    ``mlp_tensors_unfit``; with bf16 weights that tensor is c·I·H bytes and fits the shared 20 MiB segments, and the
    single-GPU figure stands) and, under checkpointing, none (the traced range: 1 × 512 to 1 × 1536 on the mid
    model)."""
    c, width = train.precision.compute.bytes, decoder_mlp_width(m)
    unfit = mlp_tensors_unfit(c, p.weights.trainable_dtype.bytes, m.hidden_size, width, train.tokens)
    return (
        train.packing
        and _in_domain(m, train, p)
        and c * width * train.tokens < K_MIN_LARGE_ALLOC
        and (train.grad_ckpt or unfit)
    )


def _in_domain(m: ModelSpec, train: TrainSpec, p: StepParts) -> bool:
    """One GPU or DDP (no FSDP, no ZeRO) full fine-tuning of a Llama-shaped model (every layer, the embedding and
    the head trained) with foreach AdamW, the standard loss, SDPA without its length² blocks, whole weights (spill.py
    ``sequence_modelled``); under checkpointing, autocast with fp32 weights (the checkpointed layer is written out for
    amp_layer.py's ``AmpLayer`` only)."""
    cast = train.precision.mixed and train.precision.compute.bytes < p.weights.trainable_dtype.bytes
    return (
        sequence_modelled(m, replace(train, grad_ckpt=False), p)
        and not computes_scores(m, train)
        and (cast or not train.grad_ckpt)
        and train.optimizer is Optimizer.ADAMW
        and bool(p.step_temp_bytes)
        and {_leaf(lin.name) for lin in layer_linears(m)} == set(_NAMES)
    )


def ddp_peak_reserved(
    m: ModelSpec, train: TrainSpec, p: StepParts, allocated: dict[Phase, int], at: ShapePeaks | None
) -> tuple[int, str] | None:
    """A DDP rank's peak reserved, or one GPU's (the same replay without DDP's bucket, ``_optimizer_peak_excess``),
    with its source; None where the single-GPU closed forms' figure stands. ``allocated``:
    each phase's allocated bytes; ``at``: the step at another shape (analytic/reserve ``ShapePeaks``).

    A run with dynamic padding meets every shape up to (B, L) and keeps what each reserved (runs.py): the largest
    replayed figure over those shapes (``_envelope``, runs.py ``lattice_envelope``), at most the closed forms held at
    least at the replay at one token, 1 × 1 (``_one_token``), so the estimate never falls as they grow. A packed run
    (``replayed``) gets the larger of step 1's optimizer peak with the replay's excess and step 2's new segments on
    top, and the single-GPU closed form without its term for the activations held at the optimizer's peak
    (analytic/reserve/shape.py ``single_shape``, term 3, which the replay stands for), at most what the run with
    dynamic padding gets at the same shape (the replay's excess falls and rises with the length, e.g. 196 MiB at
    1 × 256 and 172 at 1 × 384 for the mid model; as spill.py's ``displaced_remade``, runs.py)."""
    if at is None:
        return None
    loss_peak, step_peak, opt_peak = training_peaks(allocated)
    padded = replace(train, packing=False)
    held = _one_token(m, padded, at)
    if replayed(m, train, p):
        ours = min(_packed_own(m, train, at), _padded(m, padded, at))
    elif held is None:
        return None
    elif train.packing:  # at a shape the replay does not cover, at most the run with dynamic padding's figure
        ours = min(peak_reserved(m, train, p, loss_peak, step_peak, opt_peak, at), _padded(m, padded, at))
    else:
        ours = _padded(m, train, at)
    # where the single-GPU figure comes out the same, it stands with its own source
    if ours == peak_reserved(m, train, p, loss_peak, step_peak, opt_peak, at):
        return None
    return ours, SOURCE if train.world_size > 1 else SINGLE_SOURCE


def _packed_own(m: ModelSpec, train: TrainSpec, at: ShapePeaks) -> int:
    """A packed run's own figure at its shape (``replayed``): the larger of step 1's optimizer peak with the
    replay's excess and the single-GPU closed form without its term for the activations held at the optimizer's
    peak."""
    p, loss_peak, step_peak, opt_peak = at(train)
    on = on_at(m, train, p)._replace(activations=False)
    closed = single_shape(m, train, p, loss_peak, step_peak, opt_peak, on, parts_of(at))
    return max(closed, opt_peak + _optimizer_peak_excess(m, train, p))


@lru_cache(maxsize=8192)
def _held_closed(m: ModelSpec, train: TrainSpec, *, at: ShapePeaks) -> int:
    """The closed forms' figure of a run with dynamic padding at ``train``'s shape (runs.py ``closed_at``), held at
    least at one token: it never falls as the shape grows."""
    return max(closed_at(m, train, at=at), _one_token(m, train, at) or 0)


def _held_below(m: ModelSpec, train: TrainSpec, *, at: ShapePeaks) -> int:
    """At most ``_held_closed``, a fraction of its cost (runs.py ``closed_below``), for runs.py's
    ``lattice_envelope``."""
    return max(closed_below(m, train, at=at), _one_token(m, train, at) or 0)


def _padded(m: ModelSpec, train: TrainSpec, at: ShapePeaks) -> int:
    """The figure of a run with dynamic padding (``ddp_peak_reserved``'s), which a packed run's never exceeds: the
    largest replayed figure over the shapes it meets (``_envelope``), at most the closed forms'."""
    envelope = _envelope(m, train, at)
    if envelope <= _held_below(m, train, at=at):  # then at most the closed forms' too
        return max(at(train)[2], envelope)
    return max(at(train)[2], min(_held_closed(m, train, at=at), envelope))


@lru_cache(maxsize=1024)
def _envelope(m: ModelSpec, train: TrainSpec, at: ShapePeaks) -> int:
    """The largest figure over the shapes a run with dynamic padding meets (runs.py ``lattice_envelope``): the
    packed run's where this replay covers the shape (plus what the padded batch's mask adds), spill.py's two steps
    where they cover it (runs.py ``replay_figure``), the closed forms' elsewhere. The shapes this replay covers are
    closed downwards in b·ℓ (c·I·T under 10 MiB); where it covers none, the closed forms' figure."""
    shortest = replace(train.at_shape(1, 8), packing=True)
    if not replayed(m, shortest, at(shortest)[0]):
        return _held_closed(m, train, at=at)
    return lattice_envelope(
        train,
        partial(_held_below, m, at=at),
        partial(_held_closed, m, at=at),
        partial(_replay_figure, m, at=at),
    )


def _replay_figure(m: ModelSpec, train: TrainSpec, *, at: ShapePeaks) -> int | None:
    """This replay's packed figure at ``train``'s shape plus the padded batch's mask, before the closed forms' bound;
    spill.py's two steps where this replay does not cover the shape (runs.py ``replay_figure``)."""
    packed = replace(train, packing=True)
    if not replayed(m, packed, at(packed)[0]):
        return replay_figure(m, train, at=at)
    return _packed_own(m, packed, at) + mask_bytes(m, train, at(train)[0])


def _one_token(m: ModelSpec, train: TrainSpec, at: ShapePeaks) -> int | None:
    """The replayed reserve at 1 × 1, the shortest shape a run with dynamic padding can meet (None outside
    ``_in_domain``): its optimizer peak plus the replay's excess. There every activation is a small-pool block, so
    the large pool holds the per-parameter tensors alone, each of 10 MiB or more in a segment of its own with its
    rest (the mid model: 144 MiB, the trace's excess at 1 × 1024 under checkpointing)."""
    one = train.at_shape(1, 1)
    p1, _, _, opt1 = at(one)
    if not _in_domain(m, one, p1):
        return None
    return opt1 + _optimizer_peak_excess(m, one, p1)


def _optimizer_peak_excess(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    wb = p.weights
    n = max(wb.trainable_params, 1)
    # bytes an element of the gradient, of one state and of the temporary (as spill.py ``_displacement_key``)
    per = (p.grad_bytes // n, p.state_bytes // (2 * n), p.step_temp_bytes // n)
    shapes = tuple((_leaf(lin.name), lin.in_features, lin.out_features) for lin in layer_linears(m))
    c = train.precision.compute.bytes
    cast = train.precision.mixed and c < wb.trainable_dtype.bytes
    # DDP's first-iteration bucket (none on one GPU, whose step is the same sequence without it)
    bucket = train.world_size > 1 and train.fsdp is None and not train.zero_stage
    workspace = cublas_workspace_block(p)
    key = (m, shapes, c, wb.trainable_dtype.bytes, per, cast, train.tokens, workspace, bucket, train.grad_ckpt)
    return _two_steps(*key)


@lru_cache(maxsize=256)
def _two_steps(
    m: ModelSpec,
    shapes: tuple[tuple[str, int, int], ...],
    c: int,
    weight_b: int,
    per: tuple[int, int, int],
    cast: bool,
    T: int,
    workspace: int,
    bucket: bool,
    checkpointed: bool,
) -> int:
    """Reserved less requested at step 1's optimizer peak, plus the segments step 2 makes up to the end of its
    backward (the module docstring's sequence); ``bucket``: with DDP's one gradient bucket; ``checkpointed``: each
    decoder layer under checkpointing (``_checkpointed``)."""
    r = _Counted()
    by_name = {name: (i, o) for name, i, o in shapes}
    VH = m.vocab_size * m.hidden_size
    params = [VH] + [i * o for _, i, o in shapes] * m.num_layers + ([] if m.tie_word_embeddings else [VH])
    grad_b, state_b, temp_b = per
    for n in params:  # the load: each trained weight, from an empty cache
        r.alloc(n * weight_b)
    if bucket:  # DDP's first-iteration bucket: every gradient in one
        r.alloc(sum(params) * grad_b)
    if checkpointed:
        step = partial(_checkpointed, _CastsKept(r, m, by_name, c, tokens=T), grad_b)
    else:
        layer = (
            AmpLayer(r, m, by_name, c, tokens=T)
            if cast
            else _Layer(r, m, set(), by_name, c, False, tokens=T, trained=True)
        )
        step = partial(forward_backward, layer, grad_b)
    r.alloc(workspace)  # the forward thread's cuBLAS workspace
    grads = step(workspace)
    for n in params:  # Adam._init_group
        r.alloc(n * state_b)
        r.alloc(n * state_b)
    temporaries = [r.alloc(n * temp_b) for n in params]
    excess, before = r.excess, r.model.reserved  # step 1's optimizer peak
    for i in temporaries + grads:  # the step's end, zero_grad(set_to_none=True)
        r.free(i)
    step(None)
    return excess + r.model.reserved - before


class _CastsKept(AmpLayer):
    """``AmpLayer`` that records the blocks of autocast's weight copies (``casts``, while not None): each projection's
    first block (forward_cache.py ``_Layer._linear``)."""

    casts: set[int] | None = None

    def _linear(self, name: str) -> int:
        first = self.r.count + 1
        out = super()._linear(name)
        if self.casts is not None:
            self.casts.add(first)
        return out


def _checkpointed(layer: _CastsKept, grad_b: int, workspace: int | None) -> list[int]:
    """One step with every decoder layer under ``torch.utils.checkpoint`` (non-reentrant); returns the gradients'
    blocks. ``workspace``: as spill.py ``forward_backward``'s.

    Forward: each layer runs whole (AmpLayer's sequence) and then keeps nothing but its output, the next layer's input,
    which the next checkpoint saves (torch/utils/checkpoint.py: the saved-tensor hooks keep no activation), and
    autocast's weight copies, cached until the outermost autocast exits after the loss (autocast_mode.cpp
    ``cached_cast``; ckpt_forward.py). A simplification: a layer's transients are freed at its end rather than as
    Python drops them. Backward: the final norm and the loss's chain as without checkpointing, then for each layer from
    the last its forward again (the recompute, which saves, its weight copies made again) and its backward (spill.py
    ``_backward``), its input freed after it."""
    r, m, c, T = layer.r, layer.m, layer.c, layer.T
    VH = m.vocab_size * m.hidden_size
    x = r.alloc(layer.residual_bytes * m.hidden_size * T)  # the embedding's output
    inputs: list[int] = []
    kept: set[int] = set()
    layer.casts = kept
    for _ in range(m.num_layers):
        start = r.count
        out = layer.forward(x, False)
        for i in [i for i in r.live if i > start and i != out and i not in kept]:
            r.free(i)
        inputs.append(x)
        x = out
    layer.casts = None
    start = r.count
    layer.final_norm()
    final = [i for i in r.live if i > start]
    *weight_cast, log_softmax, nll_grad, grad = _loss(r, m, c, T, True)
    for i in kept:  # autocast exits after the loss
        r.free(i)
    r.free(log_softmax)
    r.free(nll_grad)
    r.free(grad)  # the logits' gradient cast to c bytes for lm_head's backward
    grad = r.alloc(c * m.vocab_size * T)
    if workspace is not None:
        r.alloc(workspace)
    grads = [r.alloc(VH * grad_b)]
    for i in (grad, *weight_cast, *final, x):
        r.free(i)
    for saved in reversed(inputs):
        start = r.count
        layer.forward(saved, False)
        grads += _backward(layer, sorted(i for i in r.live if i > start), grad_b)
        r.free(saved)
    embedding_gradients(r, m, grads, grad_b)
    return grads
