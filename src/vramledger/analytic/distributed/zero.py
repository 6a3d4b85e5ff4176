"""DeepSpeed ZeRO-1/2/3 on one rank, buffer by buffer, each from the DeepSpeed source that allocates it.

Legend: N ranks; Pt trainable parameters; s bytes per element of DeepSpeed's model copy (2 under bf16/fp16, else 4).

Sources:
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
"""

from __future__ import annotations

from vramledger.analytic.distributed.rank import ALL_PHASES, FWD_BWD, Buffer, RankParts, engine_name, share
from vramledger.analytic.params import embedding_params, layer_norm_params, layer_params
from vramledger.analytic.quant_state import quant_state_bytes
from vramledger.analytic.weights import WeightBudget
from vramledger.ledger import Category, Phase
from vramledger.specs import ModelSpec, Optimizer, TrainSpec, ZeroBuffers

ZERO12_SOURCE = "deepspeed/runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer"
ZERO3_SOURCE = "deepspeed/runtime/zero/stage3.py DeepSpeedZeroOptimizer_Stage3"


def _fp32_states(states: int, train: TrainSpec, wb: WeightBudget) -> int:
    """Optimizer states over an fp32 copy: DeepSpeed steps its fp32 master partition whatever the model dtype."""
    eight_bit = train.optimizer in (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT, Optimizer.LION_8BIT)
    return states if eight_bit else states * 4 // wb.trainable_dtype.bytes


def zero_buffers(m: ModelSpec, train: TrainSpec) -> ZeroBuffers:
    """DeepSpeed's bucket sizes for this run (its defaults, ``"auto"`` resolved from the hidden size)."""
    return (train.zero_buffers or ZeroBuffers()).resolved(m.hidden_size)


def _persistent_numel(m: ModelSpec, threshold: int) -> int:
    """ZeRO-3 keeps parameters under ``threshold`` elements whole: the norms (and biases) of a Llama-like model."""
    small = layer_norm_params(m) if m.hidden_size < threshold else 0
    final = m.hidden_size if m.hidden_size < threshold else 0
    return m.num_layers * small + final


# What ZeRO's stage partitions across the ranks.
_SHARDED = {
    1: ("optimizer state", "fp32 master"),
    2: ("optimizer state", "fp32 master", "gradients"),
    3: ("optimizer state", "fp32 master", "gradients", "weights"),
}


def zero_rank_parts(m: ModelSpec, train: TrainSpec, wb: WeightBudget, frozen: int, states: int) -> RankParts:
    """Rank 0 under DeepSpeed ZeRO: the model copy, fp32 master, gradients and states as the stage partitions them,
    the engine's buffers, and what CPU offload moves to the host."""
    stage, N = train.zero_stage, train.world_size
    zb = zero_buffers(m, train)
    c = train.precision.compute.bytes
    s = 2 if c == 2 else 4  # the engine casts the module to bf16/fp16 (engine.py _configure_distributed_model)
    Pt = wb.trainable_params
    src = ZERO3_SOURCE if stage == 3 else ZERO12_SOURCE
    fp32_states = _fp32_states(states, train, wb)
    master = 0 if c == 4 else share(4 * Pt, N)
    trainable = Pt * s if stage < 3 else share(Pt * s, N)
    # stage 1: each parameter's .grad, whole, until the reduce at the accumulation boundary; stage 2:
    # grads_in_partition; stage 3: grad_partitions_flat_buffer
    grads_r = Pt * s if stage == 1 else share(Pt * s, N)
    frozen_r = frozen
    buffers = _reduce_buckets(stage, zb, s, src)
    if stage == 3:
        frozen_r = _zero3_frozen_share(m, train, wb, zb, frozen, s)
        buffers.append(_gathered_parameters(m, zb, s, src))
    elif train.quant is None:
        frozen_r = (wb.total_params - Pt) * s  # in the engine's dtype, whole on every rank
    host = 0
    if train.offload_optimizer:
        host += master + share(fp32_states, N) + share(4 * Pt, N)
        master, fp32_states = 0, 0
        grads_r = 0 if stage >= 2 else grads_r  # partitions accumulate in pinned host memory
    else:
        fp32_states = share(fp32_states, N)
        buffers.append(
            Buffer(
                label="fp32 gradient partition for the step",
                category=Category.TEMPORARIES,
                bytes=share(4 * Pt, N),
                phases=frozenset((Phase.OPTIMIZER,)),
                source=f"{src}: step() single_grad_partition = flat partition .to(fp32)",
            )
        )
    if train.offload_params and stage == 3:
        kept = quant_state_bytes(m, train)  # the QuantState is no parameter: not offloaded (analytic/quant_state.py)
        host += frozen_r - kept + trainable
        persistent_b = _persistent_numel(m, zb.param_persistence_threshold) * s
        frozen_r, trainable = persistent_b + kept, 0
    replicated = ("weights", "activations") if stage < 3 else ("activations", "small parameters (persistent)")
    return RankParts(
        engine=engine_name(train),
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
        sharded=_SHARDED[stage],
        replicated=replicated,
        master_label="fp32 master copy (ZeRO partition)",
    )


def _reduce_buckets(stage: int, zb: ZeroBuffers, s: int, src: str) -> list[Buffer]:
    """The ipg reduce bucket(s), allocated whole when gradients are contiguous (always under ZeRO-3)."""
    n_buckets = 2 if (stage < 3 and zb.overlap(stage)) else 1
    if not (zb.contiguous_gradients or stage == 3):
        return []
    return [
        Buffer(
            label=f"reduce bucket{'s' if n_buckets > 1 else ''} ({n_buckets} × reduce_bucket_size "
            f"{zb.reduce_bucket_size:,})",
            category=Category.GRADIENTS,
            bytes=n_buckets * zb.reduce_bucket_size * s,
            phases=ALL_PHASES,
            source=f"{src}: ipg_buckets buffer of reduce_bucket_size elements"
            + (" (buf_0, buf_1 with overlap_comm)" if stage < 3 else ""),
        )
    ]


def _zero3_frozen_share(m: ModelSpec, train: TrainSpec, wb: WeightBudget, zb: ZeroBuffers, frozen: int, s: int) -> int:
    """ZeRO-3 partitions the frozen parameters too, except the small persistent ones, kept whole."""
    persistent = _persistent_numel(m, zb.param_persistence_threshold)
    frozen_numel = wb.total_params - wb.trainable_params
    frozen_r = share(max(frozen_numel - persistent, 0) * s, train.world_size) + persistent * s
    if train.quant is not None:
        # QLoRA under ZeRO-3 (bnb_4bit_quant_storage in the engine's dtype): the packed 4-bit storage is what
        # is partitioned; the QuantState is no parameter and stays whole (analytic/quant_state.py)
        qstate = quant_state_bytes(m, train)
        frozen_r = share(frozen - qstate, train.world_size) + qstate + persistent * s
    return frozen_r


def _gathered_parameters(m: ModelSpec, zb: ZeroBuffers, s: int, src: str) -> Buffer:
    """ZeRO-3's parameters gathered at once during forward and backward."""
    gathered = min(zb.max_live_parameters, layer_params(m) + zb.prefetch_bucket_size)
    return Buffer(
        label="gathered parameters (one layer + prefetch bucket, ≤ max_live_parameters)",
        category=Category.WEIGHTS,
        bytes=gathered * s,
        phases=FWD_BWD,
        source=f"{src}: partitioned_param_coordinator.py fetch_sub_module, stage3_prefetch_bucket_size "
        f"{zb.prefetch_bucket_size:,}, stage3_max_live_parameters {zb.max_live_parameters:,}",
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
