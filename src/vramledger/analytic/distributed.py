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
- DeepSpeed ZeRO-1/2: deepspeed/runtime/zero/stage_1_and_2.py ``DeepSpeedZeroOptimizer``: trainable parameters
  flattened into ``bit16_groups_flat`` (in place, s bytes, whole on every rank), ``single_partition_of_fp32_groups``
  (the fp32 master partition), the fp32 gradient partition built in ``step`` (``single_grad_partition``),
  ``grads_in_partition`` (stage 2 with ``contiguous_gradients``), the ``ipg_buckets`` reduce buffers of
  ``reduce_bucket_size`` elements (a second one with ``overlap_comm``); frozen parameters stay outside the
  optimizer, in the engine's dtype (engine.py ``_configure_distributed_model``: ``module.bfloat16()``).
- DeepSpeed ZeRO-3: deepspeed/runtime/zero/stage3.py ``DeepSpeedZeroOptimizer_Stage3``: every parameter,
  frozen ones too, partitioned (parameter_offload.py ``_convert_to_zero_parameters``); those under
  ``param_persistence_threshold`` elements kept whole (``mark_persistent_parameters``); one ipg bucket of
  ``reduce_bucket_size``; ``grad_partitions_flat_buffer``; gathered parameters bounded by the prefetch bucket and
  ``max_live_parameters`` (partitioned_param_coordinator.py ``fetch_sub_module``).
- DeepSpeed's own figure: stage_1_and_2.py ``estimate_zero2_model_states_mem_needs`` (2·P + 18·P/N) and stage3.py
  ``estimate_zero3_model_states_mem_needs`` (4·largest layer + 18·P/N), which assume every parameter trains and
  count model states only.

Assumptions (stated, awaiting a GPU measurement): FSDP wraps each decoder layer and the root (accelerate's
``TRANSFORMER_BASED_WRAP``, torchtune's ``shard_model``); under a mixed-precision policy the all-gathered
parameters and the reduce-scatter are in the compute dtype (accelerate's bf16 policy) and autocast then copies
nothing; ZeRO-3 keeps one decoder layer plus the prefetch bucket gathered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from vramledger.analytic.params import embedding_params, head_params, layer_norm_params, layer_params
from vramledger.analytic.weights import WeightBudget
from vramledger.ledger import Category, Phase
from vramledger.specs import DType, GPUSpec, Method, ModelSpec, Optimizer, Precision, Sharding, TrainSpec, ZeroBuffers

_FB = frozenset((Phase.FORWARD, Phase.BACKWARD))
_ALL = frozenset((Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER))

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
FSDP_RS_SOURCE = (
    "torch fsdp/_fully_shard/_fsdp_collectives.py foreach_reduce: one unit's unsharded gradients and its "
    "reduce_scatter_input"
)
ZERO12_SOURCE = "deepspeed/runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer"
ZERO3_SOURCE = "deepspeed/runtime/zero/stage3.py DeepSpeedZeroOptimizer_Stage3"


@dataclass(frozen=True, kw_only=True, slots=True)
class Buffer:
    """One engine buffer: its bytes on rank 0 and the phases in which it is live at the phase's peak."""

    label: str
    category: Category
    bytes: int
    phases: frozenset[Phase]
    source: str


@dataclass(frozen=True, kw_only=True, slots=True)
class RankParts:
    """What rank 0 holds of the persistent lines, the buffers its engine adds, and what moved to the host."""

    engine: str
    """``ddp``, ``fsdp1``/``fsdp2`` with the strategy, ``zero-1..3``, or ``single`` (offload on one GPU)."""
    ranks: int
    """Ranks one shard is spread over (N)."""
    frozen: int
    trainable: int
    master: int
    grads: int
    states: int
    step_temp: int
    autocast: int
    buffers: tuple[Buffer, ...] = ()
    host_bytes: int = 0
    """Bytes the engine keeps in host memory instead (offload)."""
    sharded: tuple[str, ...] = ()
    replicated: tuple[str, ...] = ()
    master_label: str = "fp32 master copy (ZeRO partition)"
    notes: tuple[str, ...] = field(default=(), compare=False)


def _div(n: int, ranks: int) -> int:
    """Rank 0's share: the ceiling (the padded shard)."""
    return -(-n // ranks)


def _engine(train: TrainSpec) -> str:
    if train.fsdp is not None:
        return f"fsdp{train.fsdp_version} {train.fsdp.value}"
    if train.zero_stage:
        return f"zero-{train.zero_stage}"
    return "ddp" if train.world_size > 1 else "single"


def _layer_trainable_numel(m: ModelSpec, wb: WeightBudget, train: TrainSpec) -> int:
    """Trainable elements in one trained decoder layer (adapters, or the whole layer)."""
    if train.adapters:
        return sum(a.params for a in wb.adapted)
    return layer_params(m) if wb.trainable_layers else 0


def _fp32_states(states: int, train: TrainSpec, wb: WeightBudget) -> int:
    """Optimizer states over an fp32 copy: DeepSpeed steps its fp32 master partition whatever the model dtype."""
    eight_bit = train.optimizer in (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT, Optimizer.LION_8BIT)
    return states if eight_bit else states * 4 // wb.trainable_dtype.bytes


def rank_parts(
    m: ModelSpec,
    train: TrainSpec,
    wb: WeightBudget,
    *,
    frozen: int,
    trainable: int,
    grads: int,
    states: int,
    step_temp: int,
    autocast: int,
) -> RankParts:
    """Rank 0's share of the single-GPU lines under ``train``'s data-parallel engine, with its buffers."""
    if train.fsdp is not None:
        return _fsdp(m, train, wb, frozen, trainable, grads, states, step_temp, autocast)
    if train.zero_stage:
        return _zero(m, train, wb, frozen, grads, states)
    host = 0
    notes: tuple[str, ...] = ()
    if train.offload_optimizer:
        # DeepSpeed ZeRO-Offload's CPU Adam without ZeRO sharding: states and the step on the host; the GPU keeps
        # weights and gradients (copied to the host each step).
        host, states, step_temp = states, 0, 0
    if train.offload_params:
        notes = ("parameter offload needs ZeRO-3 or FSDP: weights are counted on the GPU",)
    buffers: tuple[Buffer, ...] = ()
    if train.world_size > 1:
        buffers = (
            Buffer(
                label="DDP gradient buckets (a second copy of the gradients)",
                category=Category.GRADIENTS,
                bytes=grads,
                phases=_ALL,
                source=DDP_SOURCE,
            ),
        )
    return RankParts(
        engine=_engine(train),
        ranks=1,
        frozen=frozen,
        trainable=trainable,
        master=0,
        grads=grads,
        states=states,
        step_temp=step_temp,
        autocast=autocast,
        buffers=buffers,
        host_bytes=host,
        replicated=("weights", "gradients", "optimizer state"),
        notes=notes,
    )


def _fsdp(
    m: ModelSpec,
    train: TrainSpec,
    wb: WeightBudget,
    frozen: int,
    trainable: int,
    grads: int,
    states: int,
    step_temp: int,
    autocast: int,
) -> RankParts:
    strategy = train.fsdp
    assert strategy is not None
    ranks = {Sharding.NO_SHARD: 1, Sharding.HYBRID_SHARD: min(train.gpus_per_node, train.world_size)}.get(
        strategy, train.world_size
    )
    if strategy is Sharding.NO_SHARD:
        # NO_SHARD all-reduces each unit's gradients in place: DDP's memory without the buckets.
        return RankParts(
            engine=_engine(train),
            ranks=1,
            frozen=frozen,
            trainable=trainable,
            master=0,
            grads=grads,
            states=states,
            step_temp=step_temp,
            autocast=autocast,
            replicated=("weights", "gradients", "optimizer state"),
        )
    mixed = train.precision.mixed
    u = train.precision.compute.bytes if mixed else wb.trainable_dtype.bytes
    if train.method is not Method.FULL and not mixed:
        u = train.frozen_dtype.bytes
    if train.quant is not None:
        u = train.precision.compute.bytes  # bnb's FSDP path all-gathers the packed storage; bounded by bf16
    layer = layer_params(m) + (sum(a.params for a in wb.adapted) if train.adapters else 0)
    root = embedding_params(m) + head_params(m)
    buffers = [
        Buffer(
            label="root unit unsharded (embeddings, final norm, output layer)",
            category=Category.WEIGHTS,
            bytes=root * u,
            phases=_FB,
            source=FSDP_ROOT_SOURCE,
        )
    ]
    if strategy is Sharding.SHARD_GRAD_OP:
        buffers.append(
            Buffer(
                label="every decoder layer unsharded (kept from forward to backward)",
                category=Category.WEIGHTS,
                bytes=m.num_layers * layer * u,
                phases=_FB,
                source="FSDP SHARD_GRAD_OP / fully_shard(reshard_after_forward=False)",
            )
        )
        # Seen in the bench/distributed traces (FSDP2), not yet explained from the source: at the loss one more
        # layer-sized all-gather buffer is live; gone by the backward peak.
        buffers.append(
            Buffer(
                label="one more layer-sized all-gather buffer (traced, unexplained)",
                category=Category.WEIGHTS,
                bytes=layer * u,
                phases=frozenset((Phase.FORWARD,)),
                source="bench/distributed/grid.jsonl FSDP2 SHARD_GRAD_OP traces",
            )
        )
    else:
        # At the loss, where forward and backward peak, one unit is unsharded besides the root: the last decoder
        # layer, gathered for the start of backward (the bench/distributed traces). Inside a layer's backward it is
        # two (current + prefetch) plus that layer's unsharded gradients and reduce-scatter input
        # (FSDP_RS_SOURCE), a moment that peaks only when the loss is small; not modelled.
        buffers.append(
            Buffer(
                label="one decoder layer unsharded",
                category=Category.WEIGHTS,
                bytes=layer * u,
                phases=_FB,
                source=FSDP_AG_SOURCE,
            )
        )
    notes: list[str] = []
    host = 0
    frozen_r, trainable_r = _div(frozen, ranks), _div(trainable, ranks)
    grads_r, states_r, temp_r = _div(grads, ranks), _div(states, ranks), _div(step_temp, ranks)
    if train.offload_optimizer and not train.offload_params:
        notes.append(
            "FSDP offloads the optimizer only together with the parameters (CPUOffload(offload_params="
            "True)): modelled as --offload param"
        )
    if train.offload_optimizer or train.offload_params:
        # CPUOffload / CPUOffloadPolicy: sharded parameters, their gradients and the optimizer step on the host; each
        # unit's shard is copied to the GPU for its all-gather.
        host = frozen_r + trainable_r + grads_r + states_r
        buffers.append(
            Buffer(
                label="host-to-device copy of one unit's shard",
                category=Category.TEMPORARIES,
                bytes=_div(layer * u, ranks),
                phases=_FB,
                source="torch fsdp _fsdp_param.py: offloaded shards copied to the device before all-gather",
            )
        )
        frozen_r = trainable_r = grads_r = states_r = temp_r = 0
    return RankParts(
        engine=_engine(train),
        ranks=ranks,
        frozen=frozen_r,
        trainable=trainable_r,
        master=0,
        grads=grads_r,
        states=states_r,
        step_temp=temp_r,
        autocast=0 if mixed else autocast,
        buffers=tuple(buffers),
        host_bytes=host,
        sharded=("weights", "gradients", "optimizer state"),
        replicated=("activations", "logits", "one or two unsharded layers at a time"),
        notes=tuple(notes),
    )


def zero_buffers(m: ModelSpec, train: TrainSpec) -> ZeroBuffers:
    """DeepSpeed's bucket sizes for this run (its defaults, ``"auto"`` resolved from the hidden size)."""
    return (train.zero_buffers or ZeroBuffers()).resolved(m.hidden_size)


def _persistent_numel(m: ModelSpec, threshold: int) -> int:
    """ZeRO-3 keeps parameters under ``threshold`` elements whole: the norms (and biases) of a Llama-like model."""
    small = layer_norm_params(m) if m.hidden_size < threshold else 0
    final = m.hidden_size if m.hidden_size < threshold else 0
    return m.num_layers * small + final


def _zero(m: ModelSpec, train: TrainSpec, wb: WeightBudget, frozen: int, grads: int, states: int) -> RankParts:
    stage, N = train.zero_stage, train.world_size
    zb = zero_buffers(m, train)
    c = train.precision.compute.bytes
    s = 2 if c == 2 else 4  # the engine casts the module to bf16/fp16 (engine.py _configure_distributed_model)
    Pt = wb.trainable_params
    src = ZERO3_SOURCE if stage == 3 else ZERO12_SOURCE
    fp32_states = _fp32_states(states, train, wb)
    master = 0 if c == 4 else _div(4 * Pt, N)
    trainable = Pt * s if stage < 3 else _div(Pt * s, N)
    # stage 1: each parameter's .grad, whole, until the reduce at the accumulation boundary; stage 2:
    # grads_in_partition; stage 3: grad_partitions_flat_buffer
    grads_r = Pt * s if stage == 1 else _div(Pt * s, N)
    frozen_r = frozen
    buffers: list[Buffer] = []
    n_buckets = 2 if (stage < 3 and zb.overlap(stage)) else 1
    if zb.contiguous_gradients or stage == 3:
        buffers.append(
            Buffer(
                label=f"reduce bucket{'s' if n_buckets > 1 else ''} ({n_buckets} × reduce_bucket_size "
                f"{zb.reduce_bucket_size:,})",
                category=Category.GRADIENTS,
                bytes=n_buckets * zb.reduce_bucket_size * s,
                phases=_ALL,
                source=f"{src}: ipg_buckets buffer of reduce_bucket_size elements"
                + (" (buf_0, buf_1 with overlap_comm)" if stage < 3 else ""),
            )
        )
    if stage == 3:
        persistent = _persistent_numel(m, zb.param_persistence_threshold)
        frozen_numel = wb.total_params - Pt
        frozen_r = _div(max(frozen_numel - persistent, 0) * s, N) + persistent * s
        if train.quant is not None:
            # QLoRA under ZeRO-3 (bnb_4bit_quant_storage in the engine's dtype): the packed 4-bit storage is what
            # is partitioned
            frozen_r = _div(frozen, N) + persistent * s
        gathered = min(zb.max_live_parameters, layer_params(m) + zb.prefetch_bucket_size)
        buffers.append(
            Buffer(
                label="gathered parameters (one layer + prefetch bucket, ≤ max_live_parameters)",
                category=Category.WEIGHTS,
                bytes=gathered * s,
                phases=_FB,
                source=f"{src}: partitioned_param_coordinator.py fetch_sub_module, stage3_prefetch_bucket_size "
                f"{zb.prefetch_bucket_size:,}, stage3_max_live_parameters {zb.max_live_parameters:,}",
            )
        )
    elif train.quant is None:
        frozen_r = (wb.total_params - Pt) * s  # in the engine's dtype, whole on every rank
    host = 0
    if train.offload_optimizer:
        host += master + _div(fp32_states, N) + _div(4 * Pt, N)
        master, fp32_states = 0, 0
        grads_r = 0 if stage >= 2 else grads_r  # partitions accumulate in pinned host memory
    else:
        fp32_states = _div(fp32_states, N)
        buffers.append(
            Buffer(
                label="fp32 gradient partition for the step",
                category=Category.TEMPORARIES,
                bytes=_div(4 * Pt, N),
                phases=frozenset((Phase.OPTIMIZER,)),
                source=f"{src}: step() single_grad_partition = flat partition .to(fp32)",
            )
        )
    if train.offload_params and stage == 3:
        host += frozen_r + trainable
        persistent_b = _persistent_numel(m, zb.param_persistence_threshold) * s
        frozen_r, trainable = persistent_b, 0
    sharded = {
        1: ("optimizer state", "fp32 master"),
        2: ("optimizer state", "fp32 master", "gradients"),
        3: ("optimizer state", "fp32 master", "gradients", "weights"),
    }[stage]
    replicated = ("weights", "activations") if stage < 3 else ("activations", "small parameters (persistent)")
    return RankParts(
        engine=_engine(train),
        ranks=N,
        frozen=frozen_r,
        trainable=trainable,
        master=master,
        grads=grads_r,
        states=fp32_states,
        step_temp=0,
        autocast=0,
        buffers=tuple(buffers),
        host_bytes=host,
        sharded=sharded,
        replicated=replicated,
        master_label="fp32 master copy (ZeRO partition)",
    )


def deepspeed_estimate(m: ModelSpec, train: TrainSpec, total_params: int) -> int | None:
    """DeepSpeed's own per-GPU figure for the model states (stage_1_and_2.py
    ``estimate_zero2_model_states_mem_needs`` for ZeRO-1/2, stage3.py ``estimate_zero3_model_states_mem_needs``
    for ZeRO-3), or None without ZeRO. It assumes every parameter trains and counts no buffers or activations."""
    if not train.zero_stage:
        return None
    N, P = train.world_size, total_params
    if train.zero_stage < 3:
        return 2 * P if train.offload_optimizer else 2 * P + int(18 * P / N)
    largest = 4 * max(layer_params(m), embedding_params(m))
    if train.offload_optimizer:
        return largest if train.offload_params else largest + int(2 * P / N)
    return largest + int(18 * P / N)


def add_buffers(moment: object, phase: Phase, buffers: tuple[Buffer, ...]) -> None:
    """Add the engine's buffers live in ``phase`` to a step moment (analytic/step.py ``_Moment``)."""
    for b in buffers:
        if phase in b.phases:
            moment.add(b.category, b.label, b.bytes, b.source)  # type: ignore[attr-defined]


def single_gpu_spec(train: TrainSpec) -> TrainSpec:
    """The same step on one GPU without an engine: what every rank computes before sharding."""
    return replace(train, world_size=1, zero_stage=0, fsdp=None, offload_optimizer=False, offload_params=False)


_ACTIVATION_FIELDS = (
    "saved_layers_bytes",
    "layer_bytes",
    "scores_bytes",
    "layer_scores_bytes",
    "extra_saved_bytes",
    "logits_forward",
    "logits_saved",
    "logits_backward",
    "logits_head",
    "final_hidden_bytes",
    "layer_backward_temp",
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


def compute_view(train: TrainSpec) -> TrainSpec:
    """The single-GPU step whose activations rank 0 has: under an engine that casts the whole model
    (``_engine_casts``), pure precision with the adapters in the compute dtype too (FSDP's policy casts them with
    the rest; PEFT's fp32 adapter path never runs); otherwise the step itself."""
    one = single_gpu_spec(train)
    if not _engine_casts(train):
        return one
    pure = Precision.BF16 if train.precision.compute is DType.BF16 else Precision.FP16
    lora = replace(one.lora, adapter_fp32=False) if one.lora is not None else None
    return replace(one, precision=pure, lora=lora)


def rank_step_parts(m: ModelSpec, train: TrainSpec, gpu: GPUSpec | None, *, single: Callable[..., Any]) -> Any:
    """analytic/step.py ``StepParts`` of rank 0: the single-GPU parts (``single`` is ``step_parts``), with the
    activations of the engine's compute dtype and rank 0's share of the persistent lines, plus the buffers."""
    one = single_gpu_spec(train)
    p = single(m, one, gpu)
    if _engine_casts(train):
        act = single(m, compute_view(train), gpu)
        p = replace(p, head_cast_bytes=0, **{f: getattr(act, f) for f in _ACTIVATION_FIELDS})
    rp = rank_parts(
        m,
        train,
        p.weights,
        frozen=p.frozen_bytes,
        trainable=p.trainable_bytes,
        grads=p.grad_bytes,
        states=p.state_bytes,
        step_temp=p.step_temp_bytes,
        autocast=p.autocast_copy_bytes,
    )
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


def _rank_parts_of(m: ModelSpec, train: TrainSpec, single: Callable[..., Any]) -> RankParts:
    p = single(m, single_gpu_spec(train))
    return rank_parts(
        m,
        train,
        p.weights,
        frozen=p.frozen_bytes,
        trainable=p.trainable_bytes,
        grads=p.grad_bytes,
        states=p.state_bytes,
        step_temp=p.step_temp_bytes,
        autocast=p.autocast_copy_bytes,
    )


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
    return out
