"""DDP full fine-tuning in bf16-mixed: the rank's reserved from step 1's optimizer peak replayed
(analytic/distributed/ddp_reserve.py), against the committed traces of the real DDP wrapper
(bench/distributed/grid.jsonl)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.analytic._distributed_grid import records, runner, specs
from vramledger.allocator.model import CachingAllocatorModel
from vramledger.analytic import estimate
from vramledger.analytic.distributed.ddp_reserve import SOURCE, replayed
from vramledger.analytic.step import step_parts
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.ledger import Category
from vramledger.specs import Method, Precision, TrainSpec

MiB = 2**20


def _replayed_rows() -> list[dict[str, Any]]:
    out = []
    for rec in records():
        m, t = specs(rec)
        packed = dataclasses.replace(t, packing=True)
        if replayed(m, packed, step_parts(m, packed)):
            out.append(rec)
    return out


def test_the_replayed_rows_are_the_traced_bf16_mixed_full_ddp_ones() -> None:
    """The rows the replay takes over: DDP full fine-tuning in bf16-mixed where the MLP's c·I·T block is under 10 MiB
    (1 × 1024: 2·2816·1024 B = 5.5 MiB; 1 × 512; 1 × 1536: 8.25 MiB; Qwen2.5-0.5B 1 × 512: 2·4864·512 B = 4.75 MiB;
    Llama-3.1-8B 1 × 128 and 1 × 256), with and without checkpointing; not bf16-true, freeze, LoRA, FSDP, nor
    2 × 1024 and 1 × 2048 (11 MiB)."""
    ids = {r["id"] for r in _replayed_rows()}
    print(sorted(ids))
    mid = "mid/ddp/{}/full/bf16-mixed/b1/L{}/{}"
    assert ids == {
        mid.format("w2", 1024, "nockpt"),
        mid.format("w8", 1024, "nockpt"),
        mid.format("w2", 512, "nockpt"),
        mid.format("w2", 1536, "nockpt"),
        "qwen2.5-0.5b/ddp/w2/full/bf16-mixed/b1/L512/nockpt",
        mid.format("w8", 1024, "ckpt"),
        mid.format("w2", 512, "ckpt"),
        mid.format("w2", 1536, "ckpt"),
        "qwen2.5-0.5b/ddp/w2/full/bf16-mixed/b1/L512/ckpt",
        "llama-3.1-8b/ddp/w8/full/bf16-mixed/b1/L128/nockpt",  # 2·14336·128 B = 3.5 MiB
        "llama-3.1-8b/ddp/w8/full/bf16-mixed/b1/L256/ckpt",
    }


# Rows the estimate still misses by more than 3%, kept visible as strict xfails: id -> what the trace shows.
KNOWN = {
    "mid/ddp/w2/full/bf16-mixed/b1/L1536/nockpt": (
        "−3.1%: the replay is −0.1%, but over the padded run's figure (the closed forms, whose stand-in counts the "
        "saved activations cached at the optimizer's peak), which caps a packed run's"
    ),
    "mid/ddp/w2/full/bf16-mixed/b1/L1536/ckpt": (
        "+3.6%, the closed form's (the replay, +4.6%, makes three fp32 logits blocks again in step 2 where the trace "
        "makes two, and is capped by the padded run's figure)"
    ),
}


@pytest.mark.parametrize(
    "rec",
    [
        pytest.param(
            r, id=r["id"], marks=[pytest.mark.xfail(strict=True, reason=KNOWN[r["id"]])] if r["id"] in KNOWN else []
        )
        for r in _replayed_rows()
    ],
)
def test_replayed_rows_within_3_percent_of_the_trace(rec: dict[str, Any]) -> None:
    """A packed run's reserved (the trace is of one shape) against the trace's. Before the replay the mid model at
    1 × 1024 was 4,063 MiB against the trace's 3,774 (+7.7%): every saved activation counted as cached at the
    optimizer's peak, where the trace holds 144 MiB over the allocated bytes, 109 of them the rests of 11 MiB fp32
    tensors in 12 MiB blocks; under checkpointing 3,630 MiB (−3.8%), no rest at all. Where the replay exceeds what a
    run with dynamic padding gets (mid 1 × 1536, Qwen2.5-0.5B 1 × 512) the padded run's figure stands
    (ddp_reserve.py ``ddp_peak_reserved``)."""
    m, t = specs(rec)
    got, want = estimate(m, dataclasses.replace(t, packing=True)).peak_reserved, rec["trace"]["peak_reserved"]
    print(rec["id"], "trace", want // MiB, "MiB, estimate", got // MiB, f"MiB ({100 * (got - want) / want:+.1f}%)")
    assert abs(got - want) <= 0.03 * want


def test_the_1024_token_rows_within_1_5_percent() -> None:
    """The three rows the brief named: trace 3,774 MiB on 2 and 8 ranks and under checkpointing on 8; the estimate
    was 4,063 (+7.7%) and 3,630 (−3.8%), the replay gives 3,816 (+1.1%) and 3,760 (−0.4%). Under checkpointing the
    run with dynamic padding holds the replay at one token (its per-parameter tensors' rests), 3,774 MiB, where its
    closed forms said 3,630: the trace's figure at 1 × 1024."""
    rows = [r for r in _replayed_rows() if "/b1/L1024/" in r["id"]]
    assert len(rows) == 3
    for rec in rows:
        m, t = specs(rec)
        ledger = estimate(m, dataclasses.replace(t, packing=True))
        want = rec["trace"]["peak_reserved"]
        print(rec["id"], "trace", want, "estimate", ledger.peak_reserved)
        assert want == 3774 * MiB
        assert abs(ledger.peak_reserved - want) <= 0.015 * want
        assert any(i.source == SOURCE for i in ledger.items if i.category is Category.ALLOCATOR_RESERVE)
        if t.grad_ckpt:
            padded = estimate(m, t).peak_reserved
            print("padded run", padded)
            assert abs(padded - want) <= 0.01 * want


def test_every_row_the_model_changes_within_3_percent() -> None:
    """Each grid row whose estimate, packed or with dynamic padding, comes from ddp_reserve.py (its reserve line's
    source) against the trace: the replayed rows and the padded runs that hold the one-token replay under
    checkpointing (Llama-3.2-1B at 1 × 1024 among them, the trace 29,374 MiB)."""
    changed = 0
    for rec in records():
        m, t = specs(rec)
        for run in (t, dataclasses.replace(t, packing=True)):
            ledger = estimate(m, run)
            if not any(i.source == SOURCE for i in ledger.items):
                continue
            changed += 1
            got, want = ledger.peak_reserved, rec["trace"]["peak_reserved"]
            print(rec["id"], "packed" if run.packing else "padded", got, want, f"{100 * (got - want) / want:+.1f}%")
            assert abs(got - want) <= 0.03 * want
    assert changed >= 10


def test_unsplit_rests_by_hand() -> None:
    """The mechanism, on the allocator model (a port of CUDACachingAllocator.cpp): the mid model's fp32 MLP matrix,
    1024 × 2816 × 4 B = 11 MiB, is at least kMinLargeAlloc (10 MiB), so its segment is rounded up to kRoundLarge
    (2 MiB): 12 MiB; the 1 MiB rest is not above kSmallSize, so ``should_split`` keeps it in the block. A 4 MiB q
    state cut from a 5 MiB rest keeps its 1 MiB likewise; bf16 (5.5 MiB) is cut from a 20 MiB kLargeBuffer segment
    and split."""
    pool = CachingAllocatorModel()
    blk = pool.malloc(1024 * 2816 * 4)
    assert blk is not None
    print("fp32 MLP tensor: block", blk.size, "segment", pool.reserved)
    assert (blk.size, pool.reserved) == (12 * MiB, 12 * MiB)
    bf16 = CachingAllocatorModel()
    blk = bf16.malloc(1024 * 2816 * 2)
    assert blk is not None
    assert (blk.size, bf16.reserved) == (1024 * 2816 * 2, 20 * MiB)


@settings(max_examples=15, deadline=None)
@given(
    batch=st.integers(min_value=1, max_value=2),
    length=st.integers(min_value=1, max_value=1800),
    grow=st.integers(min_value=1, max_value=600),
    world=st.sampled_from([2, 4, 8]),
    ckpt=st.booleans(),
)
def test_packed_never_above_padded_and_padded_never_falls(
    batch: int, length: int, grow: int, world: int, ckpt: bool
) -> None:
    """A packed run meets one shape, a run with dynamic padding that one and every shorter one, keeping their
    segments: its reserve is at least the packed run's (bench/invariants_sweep.py ``PACKED``) and never falls as the
    length grows (``fit`` and ``plan`` bisect on it); reserved holds what is allocated."""
    m = model_spec_from_config(runner().MID, name="mid", source="test")
    t = TrainSpec(
        method=Method.FULL,
        precision=Precision.BF16_MIXED,
        micro_batch=batch,
        seq_len=length,
        world_size=world,
        grad_ckpt=ckpt,
    )
    packed, padded = estimate(m, dataclasses.replace(t, packing=True)), estimate(m, t)
    longer = estimate(m, dataclasses.replace(t, seq_len=length + grow))
    assert packed.peak_reserved <= padded.peak_reserved <= longer.peak_reserved
    assert packed.peak_reserved >= packed.peak_allocated
