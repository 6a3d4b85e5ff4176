"""FSDP's side streams: the caching-allocator pools of the all-gather and reduce-scatter streams, per rank.

PyTorch's caching allocator keeps the blocks of each CUDA stream apart: ``get_free_block`` searches a ``BlockPool``
whose keys include the stream, and a block freed from any stream returns to the pool of the stream it was
allocated on (CUDACachingAllocator.cpp ``BlockComparatorSize``, ``free_block``). FSDP allocates its collective
buffers on streams of its own, so a rank's reserved memory is the default stream's reserve plus, for each side
stream, the segments that stream has made, which the default stream's requests can never use. They are cached all
step long (no segment is released without ``empty_cache``): at the loss, where the default stream peaks, the
all-gather pool is idle and, from step 2 on, so is the reduce-scatter pool (``zero_grad(set_to_none=True)`` freed
the sharded gradients into it), yet both stay reserved.

Legend: N ranks sharing a shard; u bytes per element as all-gathered (distributed/core.py ``u``); r bytes per
element of the reduce-scatter (the policy's ``reduce_dtype``: the compute dtype under a mixed-precision policy,
else the gradient's); b bytes per element of a trainable parameter's storage (its sharded gradient's dtype);
E elements of a unit (the root: embeddings, final norm and output layer; or one decoder layer), t its trainable
elements, C its elements stored in a dtype other than u.

What each pool holds, by wrapper (torch 2.13, installed here):

FSDP2 (``fully_shard``)
- all-gather pool (the copy-in stream, ``all_gather_copy_in_stream``: fsdp/_fully_shard/_fsdp_param_group.py
  ``FSDPCommContext.get_all_gather_streams`` for implicit prefetching in forward and pre-backward):
  _fsdp_collectives.py ``foreach_all_gather`` allocates, inside ``device_handle.stream(all_gather_copy_in_stream)``,
  the mixed-precision cast of the unit's shards (``_get_param_all_gather_inputs``: one flat ``torch.empty`` of
  u·C/N for the foreach copy, freed at the end of the call) and the flat ``all_gather_output`` of u·E, the
  all-gather input being a view into it. ``wait_for_unshard`` copies the output out into the parameters (on the
  default stream) and, in forward, keeps the output in ``comm_ctx.all_gather_state`` until the next unit's copy-out
  (the note "Overlapping all-gather copy-in and all-gather"), so forward holds two units' outputs at once (the
  root's and the first layer's, then two layers'); in backward each output is freed right after its copy-out.
  Under ``CPUOffloadPolicy`` the foreach copy is off and each shard's ``all_gather_inputs`` copies it to the device
  (``_fsdp_param.py``: ``sharded_local_tensor.to(self.device)``) inside the same stream.
- reduce-scatter pool (``reduce_scatter_stream``): ``foreach_reduce`` allocates the sharded gradient
  (``reduce_output``, r·t/N) and, where r ≠ b, its cast to b (``_to_dtype_if_needed``; the r copy is freed), which
  the parameter keeps as its ``.grad`` (``as_strided`` views) until ``zero_grad``. The ``reduce_scatter_input``
  (r·t, the unit's unsharded gradients copied in) is kept by ``comm_ctx.reduce_scatter_states`` until the next
  unit's ``post_backward`` (``reduce_scatter_max_input_buffers`` = 1), but torch 2.13 allocates and fills it before
  entering the reduce-scatter stream: it is the default stream's (and so in the trace, trace/distributed.py).
- all-reduce pool (HSDP: ``comm_ctx.all_reduce_stream``): with a replicate group ``foreach_reduce`` all-reduces
  ``reduce_output`` on the all-reduce stream and makes that its ``post_reduce_stream``, so the cast to b is
  allocated there (kept until ``zero_grad``); the r buffer stays referenced by the group's ``_all_reduce_state``
  ("keeps the buffer off the caching allocator's free list") until ``finalize_backward``: every unit's r·t/N
  is live in the reduce-scatter pool at the end of backward.
- unsharded parameters: ``foreach_all_gather_copy_out`` allocates them on the default stream (the estimate's
  unsharded units stay in the default pool).

FSDP1 (``FullyShardedDataParallel``)
- all-gather pool (``_unshard_stream``): _runtime_utils.py ``_unshard`` runs ``handle.unshard()``
  (``_alloc_padded_unsharded_flat_param``: the whole unit, u·E) inside that stream: here the **unsharded parameters
  themselves** live in a side pool. Forward frees each layer after its forward (``_post_forward_reshard``), keeps
  the root; backward prefetches one unit ahead (``BACKWARD_PRE``), so two layers are unsharded at once; a root
  without trainable parameters is never resharded (distributed/core.py).
- pre-unshard pool (``_pre_unshard_stream``, a stream of its own: _runtime_utils.py ``_init_streams``): ``_unshard``
  runs ``handle.pre_unshard()`` there first (_flat_param.py ``_use_low_precision_shard``: the u·E/N ``_mp_shard``,
  "allocated in the pre-unshard stream"; also the host-to-device copy under ``CPUOffload``), freed by
  ``post_unshard`` once the unit is gathered.
- reduce-scatter pool (``_post_backward_stream``): ``_post_backward_hook`` runs ``_reduce_grad`` there:
  ``_get_reduce_scatter_tensors`` allocates the new sharded gradient (r·E/N: FSDP1 reduces the whole flat
  gradient of a unit with any trainable parameter, ``use_orig_params=True``) and ``_cast_grad_to_param_dtype`` its
  cast to b, kept as the flat parameter's gradient.

DDP allocates its buckets and runs its all-reduce on the default stream's tensors (reducer.cpp): no side pool,
and its reserve is the single-GPU model's.

Each pool's reserved bytes are its two steps' allocations and frees, in the order above, replayed through the
caching-allocator model (analytic/reserve/events.py ``replay_excess``: block rounding, 2 MiB small-pool and 20 MiB
mid-size segments, best fit, splitting). The default pool is analytic/reserve's model applied to what is
allocated on the default stream at each phase's peak (the moment's bytes less the side pools' live ones).
Checked against the per-stream replay of the traces in bench/distributed/grid.jsonl
(tests/analytic/test_stream_pools.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from vramledger.allocator.conf import allocation_size
from vramledger.analytic.distributed.core import (
    ALL_GATHER_BUFFER_LABEL,
    LAYER_UNSHARDED_LABEL,
    LAYERS_UNSHARDED_LABEL,
    NO_SHARD_CAST_LABEL,
    NO_SHARD_LAYER_CAST_LABEL,
    OFFLOAD_COPY_LABEL,
    OFFLOAD_GRADS_LABEL,
    ROOT_UNSHARDED_LABEL,
    adapters_in_layer_units,
    engine_dtypes,
    fsdp_gathered_bytes,
    fsdp_layer_elements,
    shard_ranks,
)
from vramledger.analytic.distributed.fsdp1_layer_grad import PREFETCH_LABEL
from vramledger.analytic.distributed.fsdp_no_sync import skips_gradient_sync
from vramledger.analytic.distributed.fsdp_root_flatten import POOL_SOURCE as FLATTEN_POOL_SOURCE
from vramledger.analytic.distributed.fsdp_root_flatten import flatten_blocks, flatten_pool_floor
from vramledger.analytic.distributed.fsdp_workspace import SOURCE as WORKSPACE_SOURCE
from vramledger.analytic.distributed.fsdp_workspace import held_floor
from vramledger.analytic.params import embedding_params, head_params, layer_linears
from vramledger.analytic.parts import Moment, StepParts
from vramledger.analytic.reserve import ShapePeaks, logits_blocks, phase_reserves, replay_excess, training_peaks
from vramledger.analytic.reserve.runs import largest_on, parts_of
from vramledger.analytic.weights import WeightBudget
from vramledger.ledger import Basis, Category, Phase
from vramledger.specs import ModelSpec, Sharding, TrainSpec

SOURCE = (
    "caching allocator (CUDACachingAllocator.cpp): one block pool per CUDA stream; FSDP's all-gather "
    "(FSDP2 copy-in stream: the cast shards and all_gather_output; FSDP1 unshard stream: the unsharded flat "
    "parameters, and its pre-unshard stream: their low-precision shards) and reduce-scatter streams (the sharded "
    "gradients and their casts; under HSDP the casts on an all-reduce stream) keep segments the default stream "
    "cannot use, replayed through the allocator model on top of the default stream's reserve "
    "(analytic/distributed/stream_pools.py); not yet measured on a GPU"
)

RESERVE_LABEL = "cached, not allocated"
DEFAULT_POOL_LABEL = "default stream's pool: cached, not allocated"
SIDE_POOLS_LABEL = "FSDP's all-gather and reduce-scatter streams' pools: cached, not allocated"

# The estimate's buffers that a side stream allocates: FSDP1 unshards on its unshard stream; FSDP2 copies the
# parameters out on the default stream, and only the all-gather output kept at the loss under SHARD_GRAD_OP is its.
_NO_SHARD_CASTS = frozenset({NO_SHARD_CAST_LABEL, NO_SHARD_LAYER_CAST_LABEL})  # NO_SHARD's pre-unshard stream
_ALL_GATHER_LABELS = {
    1: frozenset({ROOT_UNSHARDED_LABEL, LAYER_UNSHARDED_LABEL, LAYERS_UNSHARDED_LABEL, OFFLOAD_COPY_LABEL})
    | {PREFETCH_LABEL}  # fsdp1_layer_grad.py: the next unit, gathered on the unshard stream
    | _NO_SHARD_CASTS
    | {OFFLOAD_GRADS_LABEL},  # the reduce-scatter (post-backward) stream's: live in a side pool too
    2: frozenset({ALL_GATHER_BUFFER_LABEL, OFFLOAD_COPY_LABEL}) | _NO_SHARD_CASTS,
}
_SHARDED_GRADIENTS = "gradients"
"""analytic/parts.py ``add_persistent``'s label of the rank's (sharded) gradients: the reduce-scatter pool's."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Unit:
    """One FSDP unit as its collectives see it (module legend)."""

    elements: int
    """E: elements as all-gathered (u bytes each; a 4-bit base's packed codes counted in u-byte elements)."""
    trainable: int
    """t: elements whose gradients are reduce-scattered (FSDP1: the whole unit when any of it trains)."""
    cast: int
    """C: elements stored in another dtype than u, cast (FSDP2) or copied to ``_mp_shard`` (FSDP1) per all-gather."""
    host_copy: int = 0
    """Bytes of the unit's shard copied from the host per all-gather (CPU offload)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SidePools:
    """Reserved bytes of FSDP's side-stream pools on rank 0."""

    all_gather: int
    reduce_scatter: int
    pre_unshard: int = 0
    """FSDP1's pre-unshard stream (FSDP2 casts inside its all-gather stream)."""
    all_reduce: int = 0
    """FSDP2's all-reduce stream under HSDP."""

    @property
    def total(self) -> int:
        return self.all_gather + self.pre_unshard + self.reduce_scatter + self.all_reduce


class Events:
    """Allocation/free sequence with fresh ids (analytic/reserve/events.py ``Seq``)."""

    def __init__(self) -> None:
        self.seq: list[tuple[int, int]] = []
        self._next = 0

    def alloc(self, size: int) -> int:
        self._next += 1
        self.seq.append((self._next, size))
        return self._next

    def free(self, i: int | None) -> None:
        if i is not None:
            self.seq.append((i, 0))

    def reserved(self) -> int:
        return replay_excess(tuple(self.seq))[0] if self.seq else 0


def units(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> tuple[Unit, list[Unit]]:
    """The root unit and the decoder layers' units (first to last) as FSDP wraps them (one per decoder layer and
    one at the root: accelerate's TRANSFORMER_BASED_WRAP, torchtune's ``shard_model``)."""
    u = fsdp_gathered_bytes(train, wb)
    b, f = wb.trainable_dtype.bytes, train.frozen_dtype.bytes
    layer = fsdp_layer_elements(m, train, wb, u)
    per_layer = sum(a.params for a in wb.adapted) if train.adapters else layer
    root = embedding_params(m) + head_params(m)
    root_t = max(wb.trainable_params - wb.trainable_layers * per_layer, 0)
    offload = train.offload_params or train.offload_optimizer
    ranks = shard_ranks(train)

    # FSDP1 flattens a unit into one tensor of one dtype: a whole unit trains when any of it does (full, freeze, or
    # adapters in the base dtype: distributed/core.py's whole units); fp32 adapters over another base dtype are
    # wrapped in units of their own (PEFT's fsdp_auto_wrap_policy), counted here with their layer.
    flat_units = train.fsdp_version == 1 and (not train.adapters or adapters_in_layer_units(train, wb))

    def unit(elements: int, trainable: int) -> Unit:
        frozen = elements - trainable
        # 4-bit codes are packed in the compute dtype (u); other frozen weights are cast when their dtype is not u
        frozen_cast = frozen if (train.quant is None and f != u) else 0
        if flat_units:
            flat = b if trainable else f
            cast = elements if flat != u else 0
            grads = elements if trainable else 0
            host = -(-elements * flat // ranks) if offload else 0
        else:
            cast = (trainable if b != u else 0) + frozen_cast
            grads = trainable
            host = -(-(trainable * b + frozen * (u if train.quant is not None else f)) // ranks) if offload else 0
        return Unit(elements=elements, trainable=grads, cast=cast, host_copy=host)

    layers = [unit(layer, per_layer if i >= m.num_layers - wb.trainable_layers else 0) for i in range(m.num_layers)]
    return unit(root, root_t), layers


def has_side_pools(train: TrainSpec) -> bool:
    """Whether FSDP allocates on side streams: a sharding FSDP over two ranks or more, or NO_SHARD under a
    mixed-precision policy. NO_SHARD all-reduces the gradients in place (FSDP1 _runtime_utils.py
    ``_reduce_grad_no_shard``; FSDP2 has no NO_SHARD), but with a policy it casts each unit to the compute dtype on
    the pre-unshard stream (``_no_shard_casts``) and ``_cast_grad_to_param_dtype`` copies the gradients back to the
    parameters' dtype on the post-backward stream (``_reduce_scatter``, ``in_place``). Pure precision casts nothing:
    no side pool."""
    if train.fsdp is None or train.world_size < 2:
        return False
    return train.fsdp is not Sharding.NO_SHARD or train.precision.mixed


def side_pools(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> SidePools:
    """Reserved bytes of the all-gather and reduce-scatter pools after two steps (no side pool: zeros)."""
    if not has_side_pools(train):
        return SidePools(all_gather=0, reduce_scatter=0)
    root, layers = units(m, train, wb)
    u = fsdp_gathered_bytes(train, wb)
    b = wb.trainable_dtype.bytes
    r = train.precision.compute.bytes if train.precision.mixed else b
    n = shard_ranks(train)
    offload = train.offload_params or train.offload_optimizer
    no_shard = train.fsdp is Sharding.NO_SHARD
    if no_shard:
        ag, pre = 0, _no_shard_casts(root, layers, u=u)
    elif train.fsdp_version == 1:
        ag, pre = _fsdp1_all_gather(train, root, layers, u=u, n=n)
    else:
        ag, pre = _fsdp2_all_gather(train, root, layers, u=u, n=n), 0
    hsdp = train.fsdp is Sharding.HYBRID_SHARD
    rs, ar = _reduce_scatter(
        [*reversed(layers), root],
        r=r,
        b=b,
        n=n,
        # FSDP1 keeps each offloaded shard on the GPU until the end of backward (core.py FSDP1_OFFLOAD_GRADS_SOURCE): in
        # this pool, as a kept gradient (nothing else is allocated here before zero_grad); FSDP2 drops it at once
        offload=offload and train.fsdp_version == 2,
        hsdp=hsdp,
        held=hsdp and train.fsdp_version == 2,
        in_place=no_shard,
    )
    return SidePools(all_gather=ag, pre_unshard=pre, reduce_scatter=rs, all_reduce=ar)


def _fsdp2_all_gather(train: TrainSpec, root: Unit, layers: list[Unit], *, u: int, n: int) -> int:
    """FSDP2's copy-in stream over two steps (module docstring)."""
    ev = Events()

    def gather(x: Unit) -> int:
        host = ev.alloc(x.host_copy) if x.host_copy else None
        cast = ev.alloc(-(-u * x.cast // n)) if x.cast else None
        out = ev.alloc(u * x.elements)
        ev.free(cast)
        ev.free(host)
        return out

    for _ in range(2):
        prev = gather(root)
        for x in layers:  # forward: the previous output is freed after this unit's copy-out
            out = gather(x)
            ev.free(prev)
            prev = out
        ev.free(prev)  # the last FSDP state flushes the reference after forward
        if train.fsdp is not Sharding.SHARD_GRAD_OP:  # backward: each output freed right after its copy-out
            for x in (root, *reversed(layers)):
                ev.free(gather(x))
    return ev.reserved()


def _no_shard_casts(root: Unit, layers: list[Unit], *, u: int) -> int:
    """FSDP1 NO_SHARD under a mixed-precision policy: the pre-unshard stream casts each unit whole (u·C,
    ``_use_low_precision_shard``), freed in ``post_reshard`` after its forward and after its backward; the root's
    spans the forward and is cast again by its pre-backward hook, which prefetches the last layer (``BACKWARD_PRE``:
    two layers' casts at once from then on)."""
    pre = Events()

    def cast(x: Unit) -> int | None:
        return pre.alloc(u * x.cast) if x.cast else None

    for _ in range(2):
        top = cast(root)
        for x in layers:
            pre.free(cast(x))
        pre.free(top)
        top, prev = cast(root), None
        for x in reversed(layers):
            this = cast(x)
            pre.free(prev)
            prev = this
        pre.free(prev)
        pre.free(top)
    return pre.reserved()


def _fsdp1_all_gather(train: TrainSpec, root: Unit, layers: list[Unit], *, u: int, n: int) -> tuple[int, int]:
    """FSDP1's unshard and pre-unshard streams over two steps: the unsharded flat parameters themselves, and the
    low-precision (or host-copied) shards they are gathered from."""
    ev, pre = Events(), Events()
    kept_root = not root.trainable  # a frozen root is never resharded in backward (distributed/core.py)
    sgo = train.fsdp is Sharding.SHARD_GRAD_OP

    def unshard(x: Unit) -> int:
        low = pre.alloc(x.host_copy or -(-u * x.cast // n)) if (x.cast or x.host_copy) else None
        flat = ev.alloc(u * x.elements)
        pre.free(low)
        return flat

    root_flat: int | None = None
    for _ in range(2):
        if root_flat is None:
            root_flat = unshard(root)
        kept: list[int] = []
        for x in layers:
            flat = unshard(x)
            if sgo:
                kept.append(flat)
            else:
                ev.free(flat)  # _post_forward_reshard
        if sgo:
            for flat in reversed(kept):
                ev.free(flat)
        else:
            prev = None
            for x in reversed(layers):  # BACKWARD_PRE: the next unit is gathered before this one is freed
                flat = unshard(x)
                ev.free(prev)
                prev = flat
            ev.free(prev)
        if not kept_root:
            ev.free(root_flat)
            root_flat = None
    return ev.reserved(), pre.reserved()


def _reduce_scatter(
    order: list[Unit], *, r: int, b: int, n: int, offload: bool, hsdp: bool, held: bool, in_place: bool
) -> tuple[int, int]:
    """The reduce-scatter (FSDP1: post-backward) and, under HSDP, all-reduce streams over two steps: each trainable
    unit's sharded gradient and its cast, kept until ``zero_grad``. ``hsdp``: the cast is made on the all-reduce
    stream (FSDP2 ``post_reduce_stream``; FSDP1 ``_reduce_grad`` calls ``_accumulate_sharded_grad`` inside
    ``_all_reduce_stream``); ``held``: the r buffer stays until the end of backward (FSDP2's ``_all_reduce_state``;
    FSDP1 drops it once cast); ``in_place``: NO_SHARD all-reduces autograd's gradient where it is (the default
    stream's) and only the cast is this stream's (_runtime_utils.py ``_reduce_grad_no_shard``)."""
    ev, ar = Events(), Events()
    for _ in range(2):
        kept: list[tuple[Events, int]] = []
        kept_r: list[int] = []
        for x in order:
            if not x.trainable:
                continue
            out, pool = (None if in_place else ev.alloc(-(-r * x.trainable // n))), ev
            if b != r:
                pool = ar if hsdp else ev
                cast = pool.alloc(-(-b * x.trainable // n))
                if held and out is not None:
                    kept_r.append(out)  # _all_reduce_state, until finalize_backward
                else:
                    ev.free(out)
                out = cast
            if out is None:
                continue
            if offload:  # copied to the host at once (FSDP1 _offload_grad, FSDP2 new_sharded_grad.to("cpu"))
                pool.free(out)
            else:
                kept.append((pool, out))
        for i in kept_r:
            ev.free(i)
        for pool, i in kept:  # zero_grad(set_to_none=True)
            pool.free(i)
    return ev.reserved(), ar.reserved()


def _held_flatten_floor(
    m: ModelSpec, train: TrainSpec, p: StepParts, default: dict[Phase, int], at: ShapePeaks | None
) -> int:
    """``_flatten_floor`` of a run: a packed run meets one shape and gets its own; a run with dynamic padding meets
    every shape up to (B, L) and keeps the segments each made (analytic/reserve/runs.py ``held_reserved``), so it
    gets the largest floor over them. Two things switch it off as the shape grows: ``packed`` (step 1's optimizer
    no longer fits the segments backward freed: its peak grows with the tokens) and each flattening block once the
    loss's fp32 logits block, cached by then, holds it. Each is on over a set of shapes closed downwards, and the
    floor grows with the shape inside it (the loss's blocks), so the largest is at each set's upper edge. Without
    this, Qwen2.5-0.5B full FSDP1 full_shard on 4 ranks, checkpointing, 1 × 447 → 448 fell by 778 MiB: the 4·V·T
    logits block grew past the embedding's flattening block. ``at``: the step at another shape (None: this one)."""
    own = _flatten_floor(m, train, p, default)
    moments_at: Callable[[TrainSpec], dict[Phase, Moment]] | None = getattr(at, "moments", None)
    wb = p.weights
    blocks = flatten_blocks(m, train, wb, u=fsdp_gathered_bytes(train, wb), ranks=shard_ranks(train))
    if train.packing or at is None or moments_at is None or not blocks:
        return own
    parts_at = parts_of(at)

    def terms(b: int, ell: int) -> _FlattenTerms | None:
        t = train.at_shape(b, ell)
        shape_default = {ph: mo.total - side_live(t, mo) for ph, mo in moments_at(t).items()}
        return _flatten_terms(m, t, parts_at(t), shape_default)

    best = own
    B, L = train.micro_batch, train.seq_len
    for size in sorted({0, *blocks}):  # 0: the loss's blocks alone, where no flattening block is made again

        def on(b: int, ell: int, size: int = size) -> bool:
            x = terms(b, ell)
            return x is not None and x.packed and (size == 0 or size > x.largest_cached_block)

        for b, ell in largest_on(B, L, on):
            x = terms(b, ell)
            assert x is not None
            best = max(best, x.floor())
    return best


class _FlattenTerms(NamedTuple):
    """``flatten_pool_floor``'s inputs at one shape."""

    blocks: tuple[int, ...]
    optimizer_default: int
    loss_blocks: int
    largest_cached_block: int
    packed: bool

    def floor(self) -> int:
        return flatten_pool_floor(
            self.blocks,
            optimizer_default=self.optimizer_default,
            loss_blocks=self.loss_blocks,
            largest_cached_block=self.largest_cached_block,
            packed=self.packed,
        )


def _flatten_floor(m: ModelSpec, train: TrainSpec, p: StepParts, default: dict[Phase, int]) -> int:
    """FSDP1's root flattening blocks made again from step 2 on at one shape (distributed/fsdp_root_flatten.py
    ``flatten_pool_floor``)."""
    terms = _flatten_terms(m, train, p, default)
    return 0 if terms is None else terms.floor()


def _flatten_terms(m: ModelSpec, train: TrainSpec, p: StepParts, default: dict[Phase, int]) -> _FlattenTerms | None:
    """``flatten_pool_floor``'s inputs (None: no flattening). Step 1 holds no states until its optimizer step, so
    the cached bytes free when that step begins are its forward's or backward's peak less the states, less what the
    optimizer moment holds besides its states and temporaries; the optimizer's largest block is one state of the
    largest parameter's share (a parameter is cut where its unit's shard ends: use_orig_params' sharded views); the
    loss's, its fp32 logits."""
    wb, ranks = p.weights, shard_ranks(train)
    blocks = flatten_blocks(m, train, wb, u=fsdp_gathered_bytes(train, wb), ranks=ranks)
    if not blocks or Phase.OPTIMIZER not in default:
        return None
    step1_peak = max(default.get(Phase.FORWARD, 0), default.get(Phase.BACKWARD, 0)) - p.state_bytes
    before_step = default[Phase.OPTIMIZER] - p.state_bytes - p.step_temp_bytes
    packed = p.state_bytes + p.step_temp_bytes >= step1_peak - before_step
    root = embedding_params(m) + head_params(m)
    layer = fsdp_layer_elements(m, train, wb, fsdp_gathered_bytes(train, wb))
    widest = max((lin.in_features * lin.out_features for lin in layer_linears(m)), default=0)
    largest = max(min(embedding_params(m), -(-root // ranks)), min(widest, -(-layer // ranks)))
    largest_loss = min(p.logits_forward, 4 * m.vocab_size * train.tokens)  # the fp32 logits, at most
    if not p.step_temp_bytes:
        # no temporaries (fused): the states are live, so the largest cached block is the loss's, freed by then
        return _FlattenTerms(
            blocks, default[Phase.OPTIMIZER], step2_on_packed_pool(m, engine_dtypes(train), p), largest_loss, packed
        )
    # the foreach temporaries' largest block, or the loss's
    largest_cached = max(largest * wb.trainable_dtype.bytes, largest_loss)
    return _FlattenTerms(blocks, default[Phase.OPTIMIZER], p.logits_forward, largest_cached, packed)


def step2_on_packed_pool(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """What step 2 makes on the default stream before its end of backward when step 1's optimizer leaves no freed
    block behind (``flatten_pool_floor``'s ``loss_blocks`` for an optimizer step without temporaries): the forward's
    held tensors and the loss's whole chain, each in segments of their own.

    Fused AdamW updates the states in place (torch/optim/adam.py ``_fused_adam``: one ``torch._fused_adamw_`` call
    over the group, no intermediate tensor; analytic/optimizer.py counts no step temporaries), so where its states
    fill the blocks backward freed (``packed``) step 1 ends with nothing of size cached free: FSDP1's lazy
    initialisation segments and the loss's hold states (the replay, Llama-3.1-8B FSDP1 on 8 ranks: 4 MiB rests in
    the 20 MiB segments, 12 MiB in the 252 MiB one). Step 2 then cuts none of its tensors from step 1's cache
    (CUDACachingAllocator.cpp ``get_free_block``: no free block large enough, so ``alloc_block``): its forward's
    checkpointed inputs (or saved activations), the final norm's and RoPE's saved tensors and one layer's forward
    transients (as many bytes as its recompute: torch/utils/checkpoint.py reruns the same forward), and all four
    blocks of the logits chain live at the log-softmax backward (``logits_blocks``: the c·V·T logits, the fp32 upcast
    freed in forward and taken again by ``nll_loss_backward``'s gradient, the saved log-softmax, and
    ``_log_softmax_backward_data``'s gradient), each in a segment rounded up to 2 MiB (``get_allocation_size``).
    Backward's own transients are cut from those blocks once the loss has freed them. With foreach temporaries
    (``_multi_tensor_adamw``'s ``torch._foreach_sqrt``) step 1 ends with their blocks cached and free, which take
    the forward's tensors and the third fp32 block there: ``flatten_pool_floor`` counts forward's chain only
    (measured on the grid's foreach row). Traced (``vramledger trace llama-3.1-8b --method full --fsdp-version 1
    --world-size 8 --fsdp full_shard --grad-ckpt --seq 1024``, fused AdamW): step 2 makes 416 MiB of segments in
    its forward (16, 16, 20 and thirteen of 28 MiB) and 252 + 3 × 502 MiB for the chain; this counts
    256 + 32.5 + 196 and the same 1,758."""
    forward = p.saved_layers_bytes + p.extra_saved_bytes + p.recompute_bytes
    return forward + sum(allocation_size(b) for b in logits_blocks(m, train))


def side_live(train: TrainSpec, mo: Moment) -> int:
    """Bytes of ``mo`` that live in a side pool: the rank's sharded gradients and the buffers a side stream
    allocates (none where there is no side pool)."""
    if not has_side_pools(train):
        return 0
    labels = _ALL_GATHER_LABELS[train.fsdp_version]
    offload = train.offload_params or train.offload_optimizer
    # Under accumulation without sync, forward and backward hold autograd's unsharded gradients (default stream).
    unsharded = (train.keeps_unsharded_grads or skips_gradient_sync(train)) and mo.phase is not Phase.OPTIMIZER
    grads = sum(i.bytes for i in mo.items if i.category is Category.GRADIENTS and i.label == _SHARDED_GRADIENTS)
    return (0 if offload or unsharded else grads) + sum(i.bytes for i in mo.items if i.label in labels)


class ReserveLine(NamedTuple):
    """One ALLOCATOR_RESERVE line of a phase."""

    bytes: int
    label: str
    source: str
    basis: Basis


def pooled_phase_reserves(
    m: ModelSpec,
    train: TrainSpec,
    p: StepParts,
    moments: dict[Phase, Moment],
    at: ShapePeaks | None = None,
    every: dict[Phase, tuple[Moment, ...]] | None = None,
) -> dict[Phase, list[ReserveLine]]:
    """The ALLOCATOR_RESERVE lines of each phase under FSDP: analytic/reserve ``phase_reserves`` of what the
    default stream holds (at least distributed/fsdp_workspace.py's floor), and the side pools' reserved bytes less what
    of them is live at the phase's peak. ``at``: the step at another shape (analytic/reserve ``ShapePeaks``),
    for a run with dynamic padding; ``every``: every moment of each phase (analytic/step.py ``phase_moments``;
    None: the peaks alone)."""
    off = {ph: side_live(train, mo) for ph, mo in moments.items()}
    default = {ph: mo.total - off[ph] for ph, mo in moments.items()}
    # The default stream's own peak in a phase is the moment that holds the most outside the side pools, not
    # always the phase's peak: Llama-3.2-1B, full, FSDP2 on 4 ranks, eager, checkpointing, from 1 × 3075 to 3076
    # backward's peak moved to a moment 1.75 MiB larger with the root's 1,002 MiB unsharded parameters live in the
    # all-gather pool, and the default pool's reserve, taken at that moment, fell by 748 MiB.
    every = every or {}
    stream = {ph: max(c.total - side_live(train, c) for c in every.get(ph, (mo,))) for ph, mo in moments.items()}
    # The default stream's blocks follow the engine's compute dtypes; the side pools the dtypes as loaded (an fp32
    # base's shards are cast there before their all-gather).
    engine = engine_dtypes(train)
    # each line is what is cached at the phase's peak: the reserve less the default stream's bytes there
    base = {
        ph: (n + stream[ph] - default[ph], source, basis)
        for ph, (n, source, basis) in phase_reserves(m, engine, p, stream).items()
    }
    pools = side_pools(m, train, p.weights).total
    # step 1's backward workspace in an fp32 logits block: a floor under the default pool
    # (distributed/fsdp_workspace.py)
    loss_peak = training_peaks(default)[0]
    side_at_loss = next((off[ph] for ph in (Phase.BACKWARD, Phase.FORWARD) if default.get(ph) == loss_peak), 0)
    floor = held_floor(m, engine, p, loss_peak, shard_ranks(train), at, side_at_loss) if pools else 0
    flat_floor = _held_flatten_floor(m, train, p, default, at)
    floor_source = WORKSPACE_SOURCE
    if flat_floor > floor:
        floor, floor_source = flat_floor, FLATTEN_POOL_SOURCE
    out: dict[Phase, list[ReserveLine]] = {}
    for ph, (n, source, basis) in base.items():
        if (
            not pools or basis is not Basis.FORMULA
        ):  # no side pool; or a phase analytic/reserve/ leaves to its assumption
            out[ph] = [ReserveLine(n, RESERVE_LABEL, source, basis)]
            continue
        if floor - default[ph] > n:
            n, source = floor - default[ph], f"{source}; {floor_source}"
        # The side pools hold at least what is live in them (never less over the grid nor over 606 configs of an
        # 8B model: full/LoRA/QLoRA/freeze, FSDP1/2, every sharding, offload, 2-64 ranks, accumulation).
        out[ph] = [
            ReserveLine(n, DEFAULT_POOL_LABEL, source, basis),
            ReserveLine(max(pools - off[ph], 0), SIDE_POOLS_LABEL, SOURCE, Basis.FORMULA),
        ]
    return out
