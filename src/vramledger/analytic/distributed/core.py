"""Per-rank memory of a data-parallel step: DDP, PyTorch FSDP (1 and 2), DeepSpeed ZeRO-1/2/3, CPU offload.

The single-GPU step (analytic/step.py) is computed first; ``rank_parts`` then says what rank 0 keeps of each
persistent line and which communication buffers the engine adds. Rank 0 is the rank that holds most: FSDP2 pads
each parameter's dim-0 shard and ZeRO pads its flat partitions, both giving the first ranks the ceiling share.

Legend: N ranks sharing a shard (world size; the GPUs of a node under HYBRID_SHARD); Pt trainable parameters;
u bytes per element of the unsharded (all-gathered) parameters: the compute dtype under a mixed-precision policy,
else the storage dtype; s bytes per element of DeepSpeed's model copy (2 under bf16/fp16, else 4).

Sources, each the code that allocates:
- DDP: torch/nn/parallel/distributed.py ``DistributedDataParallel(bucket_cap_mb=25, gradient_as_bucket_view=
  False)``; torch/csrc/distributed/c10d/reducer.cpp ``Reducer::initialize_buckets`` allocates every bucket's
  flat ``gradients`` tensor at construction: together one more copy of all gradients, for the whole run.
- FSDP2: torch/distributed/fsdp/_fully_shard/_fsdp_param.py (each parameter a DTensor sharded on dim 0),
  _fsdp_collectives.py ``foreach_all_gather`` (``all_gather_output`` of a whole unit, in the param dtype of the
  ``MixedPrecisionPolicy``) and ``foreach_reduce`` (``reduce_scatter_input`` of the unit's unsharded gradients),
  _fsdp_state.py ``_lazy_init`` ("For the root, do not reshard after forward": the root unit, embeddings, final
  norm and output layer, stays unsharded from forward to backward), _fsdp_param_group.py implicit prefetching
  (the next unit's all-gather is issued while the current one computes). FSDP1 (_flat_param.py, _runtime_utils.py
  ``_post_forward_reshard``: the root is not freed after forward either) holds the same bytes.

Assumptions (stated, awaiting a GPU measurement): FSDP wraps each decoder layer and the root (accelerate's
``TRANSFORMER_BASED_WRAP``, torchtune's ``shard_model``); under a mixed-precision policy the all-gathered
parameters and the reduce-scatter are in the compute dtype (accelerate's bf16 policy) and autocast then copies
nothing; ZeRO-3 keeps one decoder layer plus the prefetch bucket gathered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from vramledger.analytic.distributed.fsdp1_shards import layer_unit_tensors, trainable_per_rank
from vramledger.analytic.distributed.fsdp_no_sync import (
    FSDP2_NOTE,
    fsdp2_kept_buffers,
    no_sync_buffers,
    skips_gradient_sync,
)
from vramledger.analytic.distributed.fsdp_no_sync import NOTE as NO_SYNC_NOTE
from vramledger.analytic.distributed.fsdp_root_flatten import FlattenMoment, flattens_root, root_flatten_moments
from vramledger.analytic.distributed.rank import (
    ALL_PHASES,
    FWD_BWD,
    Buffer,
    RankParts,
    SingleLines,
    add_buffers,
    engine_name,
    share,
)
from vramledger.analytic.distributed.zero import deepspeed_estimate, zero_rank_parts
from vramledger.analytic.params import embedding_params, head_params, layer_linears, layer_params
from vramledger.analytic.quant_state import quant_state_bytes
from vramledger.analytic.weights import WeightBudget
from vramledger.ledger import Category, Phase
from vramledger.specs import DType, GPUSpec, Method, ModelSpec, Precision, Sharding, TrainSpec

__all__ = [
    "Buffer",
    "add_buffers",
    "compute_view",
    "engine_dtypes",
    "rank_step_parts",
    "root_flatten",
    "single_gpu_spec",
]

DDP_SOURCE = (
    "torch/nn/parallel/distributed.py DistributedDataParallel (bucket_cap_mb=25, gradient_as_bucket_view=False): "
    "c10d reducer.cpp Reducer::initialize_buckets allocates every bucket's flat gradients at construction"
)
FSDP_AG_SOURCE = (
    "torch fsdp/_fully_shard/_fsdp_collectives.py foreach_all_gather: a unit's all_gather_output, copied out into "
    "its unsharded parameters; the next unit prefetched (_fsdp_param_group.py)"
)
FSDP_ROOT_SOURCE = (
    "torch fsdp/_fully_shard/_fsdp_state.py _lazy_init: the root unit is not resharded after forward "
    "(FSDP1 _runtime_utils.py _post_forward_reshard likewise)"
)
# Labels of the buffers that distributed/stream_pools.py places in a side stream's pool.
ROOT_UNSHARDED_LABEL = "root unit unsharded (embeddings, final norm, output layer)"
LAYER_UNSHARDED_LABEL = "one decoder layer unsharded"
LAYERS_UNSHARDED_LABEL = "every decoder layer unsharded (kept from forward to backward)"
ALL_GATHER_BUFFER_LABEL = "one more layer-sized all-gather buffer (traced, unexplained)"
OFFLOAD_COPY_LABEL = "host-to-device copy of one unit's shard"
OFFLOAD_GRADS_LABEL = "sharded gradients kept on the GPU until the end of backward (FSDP1 CPU offload)"
FSDP1_OFFLOAD_GRADS_SOURCE = (
    "torch fsdp _runtime_utils.py _accumulate_sharded_grad keeps each unit's reduce-scattered gradient, cast to the "
    "parameter dtype, as flat_param._saved_grad_shard, and _offload_grad only copies it into the pinned _cpu_grad; "
    "the attribute is deleted by _flat_param.py prepare_gradient_for_optim, which _post_backward_final_callback "
    "(_finalize_params) runs at the end of backward (torch 2.1.0 _runtime_utils.py l. 899-920, flat_param.py "
    "l. 1530-1575; the same in 2.13)"
)
NO_SHARD_CAST_LABEL = "root unit cast to the compute dtype (NO_SHARD mixed precision)"
NO_SHARD_LAYER_CAST_LABEL = "last decoder layer cast to the compute dtype, prefetched for backward (NO_SHARD)"
NO_SHARD_CAST_SOURCE = (
    "torch fsdp/_flat_param.py _use_low_precision_shard: under NO_SHARD the low-precision flat parameter "
    "(_mp_shard) is the unit's whole cast, allocated in the pre-unshard stream and freed only in post_reshard; the "
    "root's spans forward (its post-forward reshard comes last) and, cast again by its pre-backward hook, backward"
)
FSDP2_RS_STATES_SOURCE = (
    "torch fsdp/_fully_shard/_fsdp_param_group.py post_backward: comm_ctx.reduce_scatter_states holds the last "
    "reduce_scatter_input until the next unit's post_backward (reduce_scatter_max_input_buffers = 1)"
)
LAST_REDUCE_SCATTER_INPUT_LABEL = "last layer reduce-scatter input (until the root's post-backward)"
FSDP_RS_SOURCE = (
    "torch fsdp/_fully_shard/_fsdp_collectives.py foreach_reduce: one unit's unsharded gradients and its "
    "reduce_scatter_input"
)


def rank_parts(m: ModelSpec, train: TrainSpec, wb: WeightBudget, one: SingleLines) -> RankParts:
    """Rank 0's share of the single-GPU lines under ``train``'s data-parallel engine, with its buffers."""
    if train.fsdp is not None:
        return _fsdp(m, train, wb, one)
    if train.zero_stage:
        return zero_rank_parts(m, train, wb, one.frozen, one.states)
    host = 0
    notes: tuple[str, ...] = ()
    if train.offload_optimizer:
        # DeepSpeed ZeRO-Offload's CPU Adam without ZeRO sharding: states and the step on the host; the GPU keeps
        # weights and gradients (copied to the host each step).
        host, one = one.states, replace(one, states=0, step_temp=0)
    if train.offload_params:
        notes = ("parameter offload needs ZeRO-3 or FSDP: weights are counted on the GPU",)
    buffers: tuple[Buffer, ...] = ()
    if train.world_size > 1:
        buffers = (
            Buffer(
                label="DDP gradient buckets (a second copy of the gradients)",
                category=Category.GRADIENTS,
                bytes=one.grads,
                phases=ALL_PHASES | {Phase.LOAD},  # allocated when DDP wraps the model
                source=DDP_SOURCE,
            ),
        )
    return _replicated(train, one, buffers=buffers, host=host, notes=notes)


def _replicated(
    train: TrainSpec, one: SingleLines, *, buffers: tuple[Buffer, ...] = (), host: int = 0, notes: tuple[str, ...] = ()
) -> RankParts:
    """Every rank holds the whole model, gradients and states (DDP, FSDP NO_SHARD)."""
    return RankParts(
        engine=engine_name(train),
        ranks=1,
        frozen=one.frozen,
        trainable=one.trainable,
        master=0,
        grads=one.grads,
        states=one.states,
        step_temp=one.step_temp,
        autocast=one.autocast,
        buffers=buffers,
        host_bytes=host,
        replicated=("weights", "gradients", "optimizer state"),
        notes=notes,
    )


def _no_shard(m: ModelSpec, train: TrainSpec, wb: WeightBudget, one: SingleLines) -> RankParts:
    """NO_SHARD: every rank holds the whole model, as under DDP. Under a mixed-precision policy FSDP1 runs each unit
    on a cast of its flat parameter instead of autocast's weight copies (NO_SHARD_CAST_SOURCE): a layer's lives
    through its own forward or backward, the root's through the loss; a unit already in the compute dtype (a
    frozen bf16 root or layer) is used as it is (_flat_param.py ``_uses_param_mixed_precision``). The root's
    pre-backward hook prefetches the last layer (``BACKWARD_PRE``, _runtime_utils.py ``_prefetch_handle``), so its
    cast is live through the loss's backward too."""
    if not train.precision.mixed:
        return _replicated(train, one)
    u = train.precision.compute.bytes
    root_flat = wb.trainable_dtype if (wb.embedding_trainable or wb.head_trainable) else train.frozen_dtype
    last_flat = wb.trainable_dtype if wb.trainable_layers else train.frozen_dtype
    casts = []
    if root_flat.bytes != u:
        root = embedding_params(m) + head_params(m)
        casts.append(
            Buffer(
                label=NO_SHARD_CAST_LABEL,
                category=Category.WEIGHTS,
                bytes=u * root,
                phases=FWD_BWD,
                source=NO_SHARD_CAST_SOURCE,
            )
        )
    if last_flat.bytes != u:
        layer = fsdp_layer_elements(m, train, wb, u)
        casts.append(
            Buffer(
                label=NO_SHARD_LAYER_CAST_LABEL,
                category=Category.WEIGHTS,
                bytes=u * layer,
                phases=frozenset({Phase.BACKWARD}),
                source=NO_SHARD_CAST_SOURCE,
            )
        )
    return replace(_replicated(train, one, buffers=tuple(casts)), autocast=0)


def _fsdp(m: ModelSpec, train: TrainSpec, wb: WeightBudget, one: SingleLines) -> RankParts:
    """Rank 0 under FSDP: a 1/N share of every persistent line, plus the units unsharded at once (the root, one or
    every decoder layer, the root's gradients); under CPU offload the shares live on the host instead."""
    strategy = train.fsdp
    assert strategy is not None
    ranks = shard_ranks(train)
    if strategy is Sharding.NO_SHARD:  # all-reduces each unit's gradients in place: DDP without the buckets
        return _no_shard(m, train, wb, one)
    mixed = train.precision.mixed
    u = fsdp_gathered_bytes(train, wb)
    layer = fsdp_layer_elements(m, train, wb, u)
    root = embedding_params(m) + head_params(m)
    buffers = [
        _fsdp_root_buffer(train, wb, root, u),
        *_fsdp_layer_buffers(m, train, strategy, layer, u),
        *_fsdp_root_grad_buffers(m, train, wb, root, u),
    ]
    notes: list[str] = []
    host = 0
    qstate = quant_state_bytes(m, train)  # bitsandbytes' QuantState: whole on every rank (analytic/quant_state.py)
    frozen_r, trainable_r = share(one.frozen - qstate, ranks) + qstate, share(one.trainable, ranks)
    grads_r, states_r, temp_r = share(one.grads, ranks), share(one.states, ranks), share(one.step_temp, ranks)
    whole_units = train.adapters and adapters_in_layer_units(train, wb)
    if whole_units:
        # FSDP1's gradient is one flat tensor per unit, frozen elements included (_flat_param.py: flat_param.grad
        # has the flat parameter's shape): every adapted layer's whole shard (the traces of LoRA under FSDP1). Only
        # when adapters and base share a dtype and so a unit (use_orig_params=True, e.g. LitGPT, torchtune); fp32
        # adapters over a bf16 base cannot share one, and PEFT's fsdp_auto_wrap_policy wraps them on their own.
        grads_r = share(wb.trainable_layers * layer * wb.trainable_dtype.bytes, ranks)
    uneven = _uneven_trainable(m, train, wb, one, ranks, u) if whole_units else None
    heaviest, extra = 0, 0
    if uneven is not None:
        (trainable_r, states_r, temp_r, frozen_moved), (heaviest, extra) = uneven
        frozen_r -= frozen_moved
    if train.offload_optimizer and not train.offload_params:
        notes.append(
            "FSDP offloads the optimizer only together with the parameters (CPUOffload(offload_params="
            "True)): modelled as --offload param"
        )
    offloaded_grads = 0
    if train.offload_optimizer or train.offload_params:
        # CPUOffload / CPUOffloadPolicy: sharded parameters, their gradients and the optimizer step on the host; each
        # unit's shard is copied to the GPU for its all-gather.
        host = frozen_r - qstate + trainable_r + grads_r + states_r
        buffers.append(_fsdp_offload_buffer(layer, u, ranks))
        offloaded_grads = grads_r if train.fsdp_version == 1 else 0  # FSDP2 drops its GPU copy at once
        flattening = root_flatten(m, train, wb) if offloaded_grads else ()
        if flattening:  # its moments are then the ends of backward, before the root's own shard is made
            offloaded_grads -= flattening[0].pending_shard
        trainable_r = grads_r = states_r = temp_r = 0
        frozen_r = qstate  # not a parameter: FSDP does not offload it
    kept = no_sync_buffers(  # FSDP1 + accumulation (distributed/fsdp_no_sync.py); offload leaves these on the GPU too
        train, wb, u=u, sharded_grad_bytes=grads_r, layer_elements=layer, root_elements=root, whole_units=whole_units
    )
    if kept:
        buffers.extend(kept)
        notes.append(NO_SYNC_NOTE)
    if offloaded_grads:
        buffers.extend(_fsdp1_offloaded_grads_buffer(offloaded_grads, kept))
    kept = fsdp2_kept_buffers(train, wb, sharded_grad_bytes=grads_r)  # FSDP2 + accumulation (fsdp_no_sync.py)
    if kept:
        buffers.extend(kept)
        notes.append(FSDP2_NOTE)
    return RankParts(
        engine=engine_name(train),
        ranks=ranks,
        frozen=frozen_r,
        trainable=trainable_r,
        master=0,
        grads=grads_r,
        states=states_r,
        step_temp=temp_r,
        autocast=0 if mixed else one.autocast,
        buffers=tuple(buffers),
        host_bytes=host,
        sharded=("weights", "gradients", "optimizer state"),
        replicated=("activations", "logits", "one or two unsharded layers at a time"),
        notes=tuple(notes),
        heaviest_rank=heaviest,
        heaviest_extra_bytes=extra,
    )


def _uneven_trainable(
    m: ModelSpec, train: TrainSpec, wb: WeightBudget, one: SingleLines, ranks: int, u: int
) -> tuple[tuple[int, int, int, int], tuple[int, int]] | None:
    """Rank 0's trainable weights, optimizer state and step temporaries when FSDP1 flattens the adapters with their
    layer (distributed/fsdp1_shards.py: each rank holds the adapters its chunk covers), the weight bytes that moves
    out of the frozen line, and the rank that holds most with its excess over rank 0; None when something trains
    outside the decoder layers' units (then the even share stands)."""
    per_rank = trainable_per_rank(layer_unit_tensors(m, train, wb), ranks, u)
    per_layer = sum(per_rank)
    if not per_layer or wb.trainable_params != wb.trainable_layers * per_layer:
        return None

    def part(total: int, k: int) -> int:  # rank k's bytes of a line spread evenly over the trainable elements
        return total * per_rank[k] // per_layer

    heaviest = max(range(ranks), key=lambda k: (per_rank[k], -k))
    extra = sum(part(x, heaviest) - part(x, 0) for x in (one.trainable, one.states, one.step_temp))
    trainable_r = part(one.trainable, 0)
    moved = trainable_r - share(one.trainable, ranks)  # the flat shard's size is fixed: frozen gives way
    return (trainable_r, part(one.states, 0), part(one.step_temp, 0), moved), (heaviest, extra)


def shard_ranks(train: TrainSpec) -> int:
    """N of the legend under FSDP: the ranks one unit is sharded over (a node's GPUs under HYBRID_SHARD)."""
    hybrid = min(train.gpus_per_node, train.world_size)
    return {Sharding.NO_SHARD: 1, Sharding.HYBRID_SHARD: hybrid}.get(train.fsdp, train.world_size)  # type: ignore[arg-type]


def root_flatten(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> tuple[FlattenMoment, ...]:
    """FSDP1's end-of-backward moments with a trained root unit (distributed/fsdp_root_flatten.py); none otherwise."""
    if not flattens_root(train, wb):
        return ()
    return root_flatten_moments(m, train, wb, u=fsdp_gathered_bytes(train, wb), ranks=shard_ranks(train))


def adapters_in_layer_units(train: TrainSpec, wb: WeightBudget) -> bool:
    """Whether FSDP1 flattens the adapters with their decoder layer's frozen weights into one flat parameter: only
    when they share its dtype (``use_orig_params=True``, e.g. LitGPT, torchtune; _flat_param.py
    ``_validate_tensors_to_flatten``: "Must flatten tensors with uniform dtype"). fp32 adapters over a bf16 base
    cannot, and a base loaded in a dtype of its own (``base_dtype``: TRL's fp32 default) is the HF Trainer's path,
    which wraps every LoRA leaf in a unit of its own whatever its dtype (transformers distributed/fsdp.py
    ``update_fsdp_plugin_peft`` → PEFT ``fsdp_auto_wrap_policy``'s ``lambda_policy_fn``)."""
    return (
        train.fsdp_version == 1
        and train.quant is None
        and train.base_dtype is None
        and wb.trainable_dtype is train.frozen_dtype
    )


def fsdp_gathered_bytes(train: TrainSpec, wb: WeightBudget) -> int:
    """u of the legend: bytes per element of the all-gathered parameters."""
    mixed = train.precision.mixed
    u = train.precision.compute.bytes if mixed else wb.trainable_dtype.bytes
    if train.method is not Method.FULL and not mixed:
        u = train.frozen_dtype.bytes
    if train.quant is not None:
        u = train.precision.compute.bytes  # the packed storage's dtype (bnb_4bit_quant_storage = the compute dtype)
    return u


def fsdp_layer_elements(m: ModelSpec, train: TrainSpec, wb: WeightBudget, u: int) -> int:
    """Elements of one decoder layer's unit as all-gathered, in u-byte elements. A bitsandbytes 4-bit base
    all-gathers its packed codes: bitsandbytes 0.43 ``functional.quantize_4bit(..., quant_storage=...)`` stores the
    n/2 bytes of n 4-bit codes as n/(2·u) elements of the storage dtype (PEFT's FSDP-QLoRA guide: "32/4 = 8 4-bit
    params are packed together" in an fp32 element), which is what FSDP flattens; its QuantState is no parameter
    (analytic/quant_state.py)."""
    adapters = sum(a.params for a in wb.adapted) if train.adapters else 0
    if train.quant is None or train.quant.bits != 4:
        return layer_params(m) + adapters
    linears = layer_linears(m)
    packed = sum(lin.per_layer * -(-lin.in_features * lin.out_features // 2) for lin in linears)
    weights = sum(lin.per_layer * lin.in_features * lin.out_features for lin in linears)
    return layer_params(m) - weights + -(-packed // u) + adapters


def _fsdp_root_buffer(train: TrainSpec, wb: WeightBudget, root: int, u: int) -> Buffer:
    """The root unit, unsharded from forward to backward (and on through the step when FSDP1 cannot reshard it)."""
    # FSDP1 reshards the root in its post-backward hook, which runs only for a unit with trainable parameters: with
    # a frozen root (LoRA, freeze) the root stays unsharded through the optimizer step (the traces).
    stuck = train.fsdp_version == 1 and not (wb.embedding_trainable or wb.head_trainable)
    return Buffer(
        label=ROOT_UNSHARDED_LABEL,
        category=Category.WEIGHTS,
        bytes=root * u,
        phases=ALL_PHASES if stuck else FWD_BWD,
        source=FSDP_ROOT_SOURCE,
    )


def _fsdp_layer_buffers(m: ModelSpec, train: TrainSpec, strategy: Sharding, layer: int, u: int) -> list[Buffer]:
    """The decoder layers unsharded besides the root: every one under SHARD_GRAD_OP, else one."""
    buffers = []
    if strategy is Sharding.SHARD_GRAD_OP:
        buffers.append(
            Buffer(
                label=LAYERS_UNSHARDED_LABEL,
                category=Category.WEIGHTS,
                bytes=m.num_layers * layer * u,
                phases=FWD_BWD,
                source="FSDP SHARD_GRAD_OP / fully_shard(reshard_after_forward=False)",
            )
        )
        # Seen in the bench/distributed traces (FSDP2), not yet explained from the source: at the loss one more
        # layer-sized all-gather buffer is live; gone by the backward peak.
        buffers.append(
            Buffer(
                label=ALL_GATHER_BUFFER_LABEL,
                category=Category.WEIGHTS,
                bytes=layer * u,
                phases=frozenset((Phase.FORWARD,)),
                source="bench/distributed/grid.jsonl FSDP2 SHARD_GRAD_OP traces",
            )
        )
    else:
        # At the loss, where forward and backward peak, one unit is unsharded besides the root: the last decoder
        # layer, gathered for the start of backward; FSDP1 frees it after forward and gathers it again in the loss's
        # backward, FSDP2 keeps it (the bench/distributed traces). Inside a layer's backward it is two (current +
        # prefetch) plus that layer's unsharded gradients and reduce-scatter input (FSDP_RS_SOURCE), a moment that
        # peaks only when the loss is small; modelled for FSDP1 in fsdp1_layer_grad.py, not for FSDP2.
        buffers.append(
            Buffer(
                label=LAYER_UNSHARDED_LABEL,
                category=Category.WEIGHTS,
                bytes=layer * u,
                phases=FWD_BWD if train.fsdp_version == 2 else frozenset((Phase.BACKWARD,)),
                source=FSDP_AG_SOURCE,
                at_end_of_backward=False,
            )
        )
    return buffers


def _fsdp_root_grad_buffers(m: ModelSpec, train: TrainSpec, wb: WeightBudget, root: int, u: int) -> list[Buffer]:
    """The root's unsharded gradients when full fine-tuning trains the embeddings or the output layer."""
    trained = (wb.embedding_trainable or wb.head_trainable) and train.method is Method.FULL
    root_trained = root if trained else 0
    if not root_trained or train.keeps_unsharded_grads or skips_gradient_sync(train):  # inside the kept gradients
        return []
    if flattens_root(train, wb):  # FSDP1: its own end-of-backward moments (distributed/fsdp_root_flatten.py)
        return []
    # The root's gradients stay unsharded from the output layer's backward to the embeddings' (its
    # reduce-scatter runs when the whole unit is done): live at the end of backward (the traces).
    root_grads = Buffer(
        label="root unit's unsharded gradients (until its reduce-scatter)",
        category=Category.GRADIENTS,
        bytes=root_trained * u,
        phases=frozenset((Phase.BACKWARD,)),
        source=FSDP_RS_SOURCE,
        at_end_of_backward=True,
    )
    if train.fsdp_version != 2 or not wb.trainable_layers:
        return [root_grads]
    # FSDP2 keeps the last reduce-scatter input until the next unit's post_backward (the root's, after the
    # embeddings' backward): _fsdp_param_group.py ``post_backward`` appends ``ReduceScatterState(
    # reduce_scatter_input, ...)`` to ``comm_ctx.reduce_scatter_states`` and reclaims the oldest only when
    # ``reduce_scatter_max_input_buffers`` (1) are held. That input is the lowest trained layer's unsharded
    # gradients in the reduce dtype, made on the default stream (stream_pools.py): live beside the root's.
    r = train.precision.compute.bytes if train.precision.mixed else wb.trainable_dtype.bytes
    rs_input = Buffer(
        label=LAST_REDUCE_SCATTER_INPUT_LABEL,
        category=Category.GRADIENTS,
        bytes=r * fsdp_layer_elements(m, train, wb, u),
        phases=frozenset((Phase.BACKWARD,)),
        source=FSDP2_RS_STATES_SOURCE,
        at_end_of_backward=True,
    )
    return [root_grads, rs_input]


def fsdp2_pending_root_shard(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> int:
    """Bytes of the root's gradient shard that rank 0 does not hold yet at the end of backward (FSDP2 with a trained
    root, where ``_fsdp_root_grad_buffers`` keeps the root's unsharded gradients): ``foreach_reduce`` makes the
    root's sharded gradients (one dim-0 shard per parameter, ⌈rows/N⌉ rows: _fsdp_param.py
    ``_init_sharded_param``) only in the root's post_backward, after the embeddings' backward. 0 elsewhere."""
    fsdp2 = train.fsdp not in (None, Sharding.NO_SHARD) and train.fsdp_version == 2
    if not fsdp2 or train.offload_params or train.offload_optimizer:
        return 0
    if not _fsdp_root_grad_buffers(m, train, wb, embedding_params(m) + head_params(m), 1):
        return 0
    ranks, b, V, H = shard_ranks(train), wb.trainable_dtype.bytes, m.vocab_size, m.hidden_size
    head = wb.head_trainable and not m.tie_word_embeddings
    rows = (V if wb.embedding_trainable else 0) + (V if head else 0)
    # the embedding and the output layer: ⌈V/N⌉ rows of H each; the final norm: ⌈H/N⌉ elements
    return b * (-(-V // ranks) * H * (rows // V) + (-(-H // ranks) if wb.head_trainable else 0))


def _fsdp_offload_buffer(layer: int, u: int, ranks: int) -> Buffer:
    """Under CPU offload, one unit's shard copied to the GPU for its all-gather."""
    return Buffer(
        label=OFFLOAD_COPY_LABEL,
        category=Category.TEMPORARIES,
        bytes=share(layer * u, ranks),
        phases=FWD_BWD,
        source="torch fsdp _fsdp_param.py: offloaded shards copied to the device before all-gather",
    )


def _fsdp1_offloaded_grads_buffer(sharded: int, kept: tuple[Buffer, ...]) -> list[Buffer]:
    """Under FSDP1's CPU offload, the rank's sharded gradients (cast to the parameters' dtype) stay on the GPU, in the
    post-backward stream's pool, from each unit's reduce-scatter to the end of the synchronising backward
    (FSDP1_OFFLOAD_GRADS_SOURCE). Under accumulation the other micro-steps' backward ends with the unsharded
    gradients ``no_sync`` keeps instead (``kept``, already in the moment), which the synchronising one has freed unit
    by unit: the moment holds the larger, so only the excess over those is added."""
    unsharded = sum(b.bytes for b in kept if b.category is Category.GRADIENTS)
    if sharded <= unsharded:
        return []
    return [
        Buffer(
            label=OFFLOAD_GRADS_LABEL,
            category=Category.GRADIENTS,
            bytes=sharded - unsharded,
            phases=frozenset((Phase.BACKWARD,)),
            source=FSDP1_OFFLOAD_GRADS_SOURCE,
            at_end_of_backward=True,
        )
    ]


def single_gpu_spec(train: TrainSpec) -> TrainSpec:
    """The same step on one GPU without an engine: what every rank computes before sharding."""
    return replace(train, world_size=1, zero_stage=0, fsdp=None, offload_optimizer=False, offload_params=False)


_ACTIVATION_FIELDS = (
    "saved_layers_bytes",
    "layer_bytes",
    "recompute_bytes",
    "scores_bytes",
    "layer_scores_bytes",
    "extra_saved_bytes",
    "rope_saved_bytes",
    "logits_forward",
    "logits_saved",
    "logits_backward",
    "logits_head",
    "kept_logits_bytes",
    "final_hidden_bytes",
    "layer_backward_temp",
    "softmax_backward_temp",
    "softmax_backward_freed",
    "dora_temp",
    "forward_layer_temp",
    "dequant_temp",
)


def _engine_casts(train: TrainSpec) -> bool:
    """FSDP's mixed-precision policy (parameters all-gathered in the compute dtype) and DeepSpeed's bf16/fp16 engine
    (engine.py ``module.bfloat16()``, no autocast) run the whole model in the compute dtype: its activations are
    those of pure ``*-true`` precision, not autocast's fp32 residual stream (the traces of bench/distributed show
    the same saved bytes for bf16-mixed and bf16-true under FSDP)."""
    return train.precision.mixed and (train.fsdp is not None or train.zero_stage > 0)


def engine_dtypes(train: TrainSpec) -> TrainSpec:
    """``train`` with a base loaded in another dtype (``base_dtype``) used in the compute dtype, as an engine that
    casts the whole model (``_engine_casts``) uses it: FSDP's ``MixedPrecision`` / ``MixedPrecisionPolicy``
    all-gathers the fp32 shards as ``param_dtype`` copies (FSDP1 _flat_param.py ``_use_low_precision_shard``, FSDP2
    _fsdp_param.py ``init_all_gather_outputs``), so the embedding's output and the residual stream are in the
    compute dtype; DeepSpeed's engine or zero.Init casts the parameters themselves (runtime/zero/
    partition_parameters.py ``Init._set_dtype``). Otherwise ``train`` itself."""
    return replace(train, base_dtype=None) if _engine_casts(train) else train


def compute_view(train: TrainSpec) -> TrainSpec:
    """The single-GPU step whose activations rank 0 has: under an engine that casts the whole model
    (``_engine_casts``), pure precision with the adapters in the compute dtype too (FSDP's policy casts them with
    the rest; PEFT's fp32 adapter path never runs); otherwise the step itself."""
    one = single_gpu_spec(train)
    if not _engine_casts(train):
        return one
    pure = Precision.BF16 if train.precision.compute is DType.BF16 else Precision.FP16
    lora = replace(one.lora, adapter_fp32=False) if one.lora is not None else None
    return replace(engine_dtypes(one), precision=pure, lora=lora)


def rank_step_parts(m: ModelSpec, train: TrainSpec, gpu: GPUSpec | None, *, single: Callable[..., Any]) -> Any:
    """analytic/step.py ``StepParts`` of rank 0: the single-GPU parts (``single`` is ``step_parts``), with the
    activations of the engine's compute dtype and rank 0's share of the persistent lines, plus the buffers."""
    one = single_gpu_spec(train)
    p = single(m, one, gpu)
    if _engine_casts(train):
        act = single(m, compute_view(train), gpu)
        # The engine's weights are in the compute dtype when they are used: autocast casts none of them, in forward
        # or in a checkpointed layer's recompute.
        p = replace(p, head_cast_bytes=0, recompute_cast_bytes=0, **{f: getattr(act, f) for f in _ACTIVATION_FIELDS})
    rp = rank_parts(m, train, p.weights, SingleLines.of(p))
    p = _frozen_views_saved(m, train, p)
    return replace(
        p,
        frozen_bytes=rp.frozen,
        trainable_bytes=rp.trainable,
        master_bytes=rp.master,
        grad_bytes=rp.grads,
        state_bytes=rp.states,
        step_temp_bytes=rp.step_temp,
        autocast_copy_bytes=rp.autocast,
        buffers=rp.buffers,
    )


def _frozen_views_saved(m: ModelSpec, train: TrainSpec, p: Any) -> Any:
    """FSDP1 with adapters flattened into their layer's unit: the unit's flat parameter requires grad, so every
    frozen tensor of it is a view that requires grad (_flat_param.py ``_validate_tensors_to_flatten`` and
    ``_use_unsharded_views``) and autograd saves what its gradient needs: each trained layer saves its norms'
    normalised inputs, and the inputs of linears no adapter keeps (activations.py
    ``frozen_weights_grad_bytes_per_token``). Traced: the grid's FSDP1 LoRA rows save 2·c·H per token per layer more
    than FSDP2's (``LlamaRMSNorm``'s ``hidden_states.to(input_dtype)``, kept by ``weight * ...``)."""
    if not (train.adapters and adapters_in_layer_units(train, p.weights) and p.weights.trainable_layers):
        return p
    from vramledger.analytic.activations import frozen_weights_grad_bytes_per_token

    layer = frozen_weights_grad_bytes_per_token(m, compute_view(train), p.weights) * train.tokens
    if train.grad_ckpt:  # only the recomputed layer saves them
        return replace(p, layer_bytes=p.layer_bytes + layer, recompute_bytes=p.recompute_bytes + layer)
    return replace(
        p,
        layer_bytes=p.layer_bytes + layer,
        saved_layers_bytes=p.saved_layers_bytes + p.weights.trainable_layers * layer,
    )


def _rank_parts_of(m: ModelSpec, train: TrainSpec, single: Callable[..., Any]) -> RankParts:
    p = single(m, single_gpu_spec(train))
    return rank_parts(m, train, p.weights, SingleLines.of(p))


def distributed_settings(m: ModelSpec, train: TrainSpec, single: Callable[..., Any]) -> dict[str, object]:
    """The per-rank facts shown with the ledger: engine, ranks, what is sharded and replicated, host bytes, and
    DeepSpeed's own figure beside ours. ``single`` is analytic/step.py ``step_parts``."""
    p = single(m, train)
    rp = _rank_parts_of(m, train, single)
    out: dict[str, object] = {
        "engine": rp.engine,
        "world_size": train.world_size,
        "shard_ranks": rp.ranks,
        "rank": 0,
        "sharded": list(rp.sharded),
        "replicated": list(rp.replicated),
        "host_bytes": rp.host_bytes,
        "heaviest_rank": rp.heaviest_rank,
        "heaviest_extra_bytes": rp.heaviest_extra_bytes,
        "model_states_bytes": p.frozen_bytes + p.trainable_bytes + p.master_bytes + p.grad_bytes + p.state_bytes,
    }
    ds = deepspeed_estimate(m, train, p.weights.total_params)
    if ds is not None:
        out["deepspeed_estimate_bytes"] = ds
        out["deepspeed_estimate_source"] = (
            "stage3.py estimate_zero3_model_states_mem_needs"
            if train.zero_stage == 3
            else "stage_1_and_2.py estimate_zero2_model_states_mem_needs"
        )
    return out


def distributed_warnings(m: ModelSpec, train: TrainSpec, single: Callable[..., Any]) -> list[str]:
    """Notes that go with a per-rank ledger: the engine's assumptions and DeepSpeed's own figure."""
    from vramledger.units import fmt_bytes

    rp = _rank_parts_of(m, train, single)
    out = list(rp.notes)
    if train.fsdp is not None and train.world_size == 1:
        out.append("FSDP on one GPU shards nothing: pass --world-size N")
    if rp.host_bytes:
        out.append(f"offload keeps {fmt_bytes(rp.host_bytes)} per rank in host memory (not counted on the GPU)")
    if rp.heaviest_rank:
        out.append(
            f"FSDP1's flat shards split the adapters unevenly: rank {rp.heaviest_rank} holds "
            f"{fmt_bytes(rp.heaviest_extra_bytes)} more trainable weights, optimizer state and step temporaries "
            "than rank 0 shown here"
        )
    return out
