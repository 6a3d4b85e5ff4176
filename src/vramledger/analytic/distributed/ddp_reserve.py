"""DDP full fine-tuning in bf16-mixed: step 1's optimizer peak replayed with the blocks the allocator rounds, in place
of the single-GPU model's stand-in for it where the MLP's activation blocks are under 10 MiB.

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
from those segments): 3,816 MiB, +1.1%. A packed run only, and at most what a run with dynamic padding gets at the
same shape: that run keeps the closed forms, which never fall as the shape grows, and the replay's excess does (as
spill.py's ``displaced_remade``, runs.py). Checked against the traces of bench/distributed/grid.jsonl
(tests/analytic/test_ddp_reserve.py).

Not modelled: DDP's bucket rebuild. After the first iteration ``Reducer::rebuild_buckets`` frees the one bucket and
allocates buckets of ``bucket_cap_mb`` (25 MiB) in the order gradients became ready, inside step 2's forward; the
trace skips it (trace/distributed.py ``_NoRebuild``: it syncs through real tensors), so neither side counts what
the new buckets take from step 1's cache.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from vramledger.allocator.conf import K_MIN_LARGE_ALLOC
from vramledger.analytic.params import layer_linears
from vramledger.analytic.parts import StepParts
from vramledger.analytic.reserve import ShapePeaks, training_peaks
from vramledger.analytic.reserve.amp_layer import AmpLayer
from vramledger.analytic.reserve.forward_cache import _NAMES, _Layer, _leaf, _Replay
from vramledger.analytic.reserve.full import decoder_mlp_width
from vramledger.analytic.reserve.held_activations import mlp_tensors_unfit
from vramledger.analytic.reserve.runs import on_at, parts_of, peak_reserved
from vramledger.analytic.reserve.shape import single_shape
from vramledger.analytic.reserve.spill import forward_backward, sequence_modelled
from vramledger.analytic.reserve.workspace import cublas_workspace_block
from vramledger.ledger import Phase
from vramledger.specs import ModelSpec, Optimizer, TrainSpec

SOURCE = (
    "DDP, full fine-tuning: step 1's optimizer peak replayed through the allocator model (the trained weights, "
    "DDP's one first-iteration gradient bucket, torch/nn/parallel/distributed.py compute_bucket_size_limits "
    "[sys.maxsize]; the two steps of analytic/reserve/spill.py): blocks of 10 MiB and more rounded up to 2 MiB "
    "keep rests of at most 1 MiB unsplit (CUDACachingAllocator.cpp get_allocation_size, should_split), in place of "
    "the saved activations counted cached where c·I·T < 10 MiB (analytic/distributed/ddp_reserve.py)"
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
    """Whether ``ddp_peak_reserved`` replays the step: DDP (several ranks, no FSDP, no ZeRO) full fine-tuning of a
    Llama-shaped model (every layer, the embedding and the head trained) with foreach AdamW, without checkpointing,
    the standard loss, SDPA without its length² blocks, whole weights; a packed run; and where the single-GPU model
    has only its stand-in (held_activations.py ``optimizer_peak_bound``: c·I·T under 10 MiB, in a segment smaller
    than an MLP matrix's per-parameter tensor, ``mlp_tensors_unfit``; with bf16 weights that tensor is c·I·H bytes
    and fits the shared 20 MiB segments, and the single-GPU figure stands)."""
    c, width = train.precision.compute.bytes, decoder_mlp_width(m)
    return (
        train.world_size > 1
        and train.packing
        and sequence_modelled(m, train, p)
        and c * width * train.tokens < K_MIN_LARGE_ALLOC
        and mlp_tensors_unfit(c, p.weights.trainable_dtype.bytes, m.hidden_size, width, train.tokens)
        and train.optimizer is Optimizer.ADAMW
        and bool(p.step_temp_bytes)
        and {_leaf(lin.name) for lin in layer_linears(m)} == set(_NAMES)
    )


def ddp_peak_reserved(
    m: ModelSpec, train: TrainSpec, p: StepParts, allocated: dict[Phase, int], at: ShapePeaks | None
) -> tuple[int, str] | None:
    """A DDP rank's peak reserved where ``replayed``, with its source: the larger of step 1's optimizer peak with the
    replay's excess and step 2's new segments on top, and the single-GPU closed form without its term for the
    activations held at the optimizer's peak (analytic/reserve/shape.py ``single_shape``, term 3, which the replay
    stands for), at most what a run with dynamic padding gets at the same shape (the closed forms, held over the
    shorter shapes it meets, which never fall as the shape grows: the replay's excess does, e.g. 196 MiB at 1 × 256
    and 172 at 1 × 384 for the mid model, so it is not held; as spill.py's ``displaced_remade``, runs.py). None
    elsewhere (the single-GPU model's figure stands). ``allocated``: each phase's allocated bytes; ``at``: the step
    at another shape (analytic/reserve ``ShapePeaks``)."""
    if at is None or not replayed(m, train, p):
        return None
    loss_peak, step_peak, opt_peak = training_peaks(allocated)
    on = on_at(m, train, p)._replace(activations=False)
    closed = single_shape(m, train, p, loss_peak, step_peak, opt_peak, on, parts_of(at))
    own = max(closed, opt_peak + _optimizer_peak_excess(m, train, p))
    padded = replace(train, packing=False)
    return min(own, peak_reserved(m, padded, *at(padded), at)), SOURCE


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
    return _two_steps(
        m, shapes, c, wb.trainable_dtype.bytes, per, cast, train.tokens, cublas_workspace_block(p), bucket
    )


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
) -> int:
    """Reserved less requested at step 1's optimizer peak, plus the segments step 2 makes up to the end of its
    backward (the module docstring's sequence); ``bucket``: with DDP's one gradient bucket."""
    r = _Counted()
    by_name = {name: (i, o) for name, i, o in shapes}
    VH = m.vocab_size * m.hidden_size
    params = [VH] + [i * o for _, i, o in shapes] * m.num_layers + ([] if m.tie_word_embeddings else [VH])
    grad_b, state_b, temp_b = per
    for n in params:  # the load: each trained weight, from an empty cache
        r.alloc(n * weight_b)
    if bucket:  # DDP's first-iteration bucket: every gradient in one
        r.alloc(sum(params) * grad_b)
    layer = (
        AmpLayer(r, m, by_name, c, tokens=T) if cast else _Layer(r, m, set(), by_name, c, False, tokens=T, trained=True)
    )
    r.alloc(workspace)  # the forward thread's cuBLAS workspace
    grads = forward_backward(layer, grad_b, workspace)
    for n in params:  # Adam._init_group
        r.alloc(n * state_b)
        r.alloc(n * state_b)
    temporaries = [r.alloc(n * temp_b) for n in params]
    excess, before = r.excess, r.model.reserved  # step 1's optimizer peak
    for i in temporaries + grads:  # the step's end, zero_grad(set_to_none=True)
        r.free(i)
    forward_backward(layer, grad_b, None)
    return excess + r.model.reserved - before
