"""The default stream's floor under FSDP (analytic/distributed/fsdp_workspace.py): derived by hand, switched off where
the trace shows another home for the backward thread's cuBLAS workspace, and never falling as the shape grows. The floor
against the replay of the traced grid is in test_stream_pools.py (the default pool within 7%)."""

from __future__ import annotations

import dataclasses

from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.analytic._distributed_grid import mid_fsdp2, runner
from vramledger.analytic import estimate
from vramledger.analytic.distributed import engine_dtypes
from vramledger.analytic.distributed.fsdp_workspace import default_pool_floor, workspace_in_logits
from vramledger.analytic.step import step_parts
from vramledger.catalog import resolve_model
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.specs import Method, ModelSpec, Precision, Sharding, TrainSpec

MiB = 2**20


def test_workspace_floor_by_hand() -> None:
    """FSDP2, 8 ranks, bf16-mixed, the top two layers trained (freeze), the grid's mid model (vocabulary 32000, 1024
    tokens, hidden 1024, MLP 2816, 4 KV heads of 64). The loss's fp32 blocks are 4·V·T = 131,072,000 B (125 MiB), each
    in a segment of its own rounded up to 2 MiB (CUDACachingAllocator.cpp ``get_allocation_size``: 126 MiB), whose 1 MiB
    rest stays in the block (``should_split``: not more than kSmallSize); those 3 MiB over the three live at the peak
    are left out (fsdp_workspace.py: the loss peak given may be another moment). The backward thread's cuBLAS workspace
    (32 MiB on Hopper) is cut from one, whose remainder is 126 − 32 = 94 MiB. The bf16 logits hole is 2·V·T = 65,536,000
    B (62.5 MiB) in a 64 MiB segment, free whole once freed. Step 1's AdamW states (two per parameter, fp32, like the
    rank's dim-0 shard) that can go into it are those over 1 MiB: the MLP's three matrices (2816/8 = 352 rows × 1024, or
    128 rows × 2816, × 4 B = 1.375 MiB each); q/o (128 × 1024 × 4 B = 0.5 MiB) and k/v are small-pool tensors. 2 layers
    × 3 × 1.375 MiB × 2 states = 16.5 MiB = 17,301,504 B, so 49,807,360 B of the hole's segment stays free. No
    checkpointing, SDPA: no layer transient is cached beside them. Floor = the default stream's loss peak + 49,807,360 B
    + 94 MiB (no small pool excess: the trained base has large tensors). The replay of the traced row (``python
    bench/distributed/run_grid.py --free mid/fsdp2/w8/freeze/bf16-mixed/b1/L1024/nockpt``) shows the 94.0 MiB free in
    the workspace's segment."""
    m, t = mid_fsdp2(Method.FREEZE)
    p = step_parts(m, t)
    want = 64 * MiB - 17_301_504 + (126 - 32) * MiB
    got = default_pool_floor(m, engine_dtypes(t), p, 0, 8)
    assert got == want


def test_an_unsharded_matrix_the_workspaces_size_takes_it() -> None:
    """Llama-3.2-1B under FSDP2 FULL_SHARD: each layer's unsharded 2048 × 8192 MLP matrices (bf16: exactly 32 MiB,
    the workspace's size) are freed after its forward (``reshard_after_forward``) and free when lm_head's backward
    runs its first matmul, so best fit takes one of them, and the replay of the trace makes no logits segment in
    step 2 (the 1B FSDP2 row's default pool: 4,202 MiB reserved, 243 over its peak allocated, less than one
    4·V·T = 501 MiB segment). FSDP1 unshards into its unshard stream's pool, so there the workspace goes
    elsewhere only through FSDP1's lazy-init buffers, which are not modelled (module docstring)."""
    m = resolve_model("llama-3.2-1b")
    for version, cut in ((2, False), (1, True)):
        t = TrainSpec(
            method=Method.FULL,
            precision=Precision.BF16_MIXED,
            seq_len=1024,
            grad_ckpt=True,
            world_size=8,
            fsdp=Sharding.FULL_SHARD,
            fsdp_version=version,
        )
        assert workspace_in_logits(m, engine_dtypes(t), step_parts(m, t)) is cut, version


@settings(max_examples=40, deadline=None)
@example(version=1, method=Method.FULL, ckpt=False, batch=1, short=263, longer=1)  # FSDP1's end of backward the peak
@given(
    version=st.sampled_from([1, 2]),
    method=st.sampled_from([Method.FULL, Method.FREEZE, Method.LORA]),
    ckpt=st.booleans(),
    batch=st.integers(1, 3),
    short=st.integers(256, 9000),
    longer=st.integers(1, 4000),
)
def test_the_floor_never_falls_as_the_sequence_grows(
    version: int, method: Method, ckpt: bool, batch: int, short: int, longer: int
) -> None:
    """The workspace finds another home once a forward-freed block outgrows it (the mid model: the fp32 norm
    intermediate 4·H·T from 8,192 tokens, a checkpointed layer's MLP product 2·I·T from 5,958): a run with dynamic
    padding keeps the segments its shorter batches made, so its peak reserved never falls as L grows (the
    planner's searches need that, as for analytic/reserve/)."""
    m, t = _mid_full_shard(version, method, ckpt, batch, short)
    a, b = estimate(m, t).peak_reserved, estimate(m, dataclasses.replace(t, seq_len=short + longer)).peak_reserved
    assert b >= a, (a, b)


@settings(max_examples=40, deadline=None)
@given(
    ckpt=st.booleans(),
    sharding=st.sampled_from([Sharding.FULL_SHARD, Sharding.SHARD_GRAD_OP]),
    batch=st.integers(1, 3),
    more_batch=st.integers(0, 2),
    short=st.integers(128, 6000),
    longer=st.integers(0, 4000),
)
def test_fsdp2_lora_reserve_never_falls_as_batch_or_length_grow(
    ckpt: bool, sharding: Sharding, batch: int, more_batch: int, short: int, longer: int
) -> None:
    """The FSDP2 LoRA floor adds the layers' cache (``adapter_forward_cache``, ``checkpointed_forward_cache``: per
    token × T): the peak reserved never falls as the micro-batch or the length grows."""
    m = model_spec_from_config(runner().MID, name="mid", source="test")
    t = TrainSpec(
        method=Method.LORA,
        precision=Precision.BF16_MIXED,
        micro_batch=batch,
        seq_len=short,
        grad_ckpt=ckpt,
        world_size=8,
        fsdp=sharding,
        fsdp_version=2,
    )
    bigger = dataclasses.replace(t, micro_batch=batch + more_batch, seq_len=short + longer)
    a, b = estimate(m, t).peak_reserved, estimate(m, bigger).peak_reserved
    assert b >= a, (a, b)


@settings(max_examples=40, deadline=None)
@given(
    version=st.sampled_from([1, 2]),
    method=st.sampled_from([Method.FULL, Method.FREEZE, Method.LORA]),
    ckpt=st.booleans(),
    batch=st.integers(1, 3),
    seq=st.integers(256, 12000),
)
def test_a_packed_run_never_reserves_more_than_a_padded_one(
    version: int, method: Method, ckpt: bool, batch: int, seq: int
) -> None:
    """A packed run meets B × L alone and gets the floor only where the workspace's band is on there; a run with
    dynamic padding meets B × L too (with its mask on top) and keeps its shorter batches' segments."""
    m, t = _mid_full_shard(version, method, ckpt, batch, seq)
    assert estimate(m, dataclasses.replace(t, packing=True)).peak_reserved <= estimate(m, t).peak_reserved


def _mid_full_shard(version: int, method: Method, ckpt: bool, batch: int, seq: int) -> tuple[ModelSpec, TrainSpec]:
    """The mid model on 8 ranks under FSDP full sharding; FSDP1's LoRA in pure bf16, so that the adapters flatten
    with their layer's frozen weights (distributed/core.py ``adapters_in_layer_units``: one dtype in each flat
    parameter)."""
    m = model_spec_from_config(runner().MID, name="mid", source="test")
    t = TrainSpec(
        method=method,
        precision=Precision.BF16 if version == 1 and method is Method.LORA else Precision.BF16_MIXED,
        micro_batch=batch,
        seq_len=seq,
        grad_ckpt=ckpt,
        world_size=8,
        fsdp=Sharding.FULL_SHARD,
        fsdp_version=version,
    )
    return m, t


def test_frozen_head_chain_by_hand_no_shard_freeze() -> None:
    """FSDP1 NO_SHARD at 2 ranks, freeze (the top two layers trained, fp32 under bf16-mixed), the grid's mid model:
    the states are not sharded. Large-pool states (> kSmallSize = 1 MiB): per layer gate/up/down 1024 × 2816 × 4 B =
    11 MiB and q/o 1024 × 1024 × 4 B = 4 MiB (k/v are 256 × 1024 × 4 B = 1 MiB exactly: small pool), two states each,
    two layers: 4 × 41 = 164 MiB; with the 32 MiB workspace they reach past the 64 MiB hole and the 126 MiB block of
    the fp32 copy into the log-softmax's (analytic/reserve/freeze.py ``frozen_head_blocks``: 2). Free in those
    segments at step 2's peak: 64 + 2 × 126 − 164 − 32 = 120 MiB (the replay's 122 + 10, docs/distributed.md item 10),
    where the floor's own terms count 94. The row was −4.3% under the replay's reserved."""
    from tests.analytic._distributed_grid import records, specs
    from vramledger.analytic.distributed.core import shard_ranks
    from vramledger.analytic.distributed.fsdp_workspace import _frozen_head_chain

    rec = next(r for r in records() if r["id"] == "mid/fsdp1-noshard/w2/freeze/bf16-mixed/b1/L1024/nockpt")
    m, t = specs(rec)
    got = _frozen_head_chain(m, engine_dtypes(t), step_parts(m, t), shard_ranks(t))
    print("expected", 120 * MiB, "got", got)
    assert got == 120 * MiB
    want, est = rec["trace"]["peak_reserved"], estimate(m, t).peak_reserved
    print(f"trace {want / MiB:,.0f} MiB, estimate {est / MiB:,.0f} MiB ({100 * (est - want) / want:+.1f}%)")
    assert abs(est - want) <= 0.03 * want
