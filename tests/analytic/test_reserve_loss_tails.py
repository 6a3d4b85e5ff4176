"""The trained weights' segment tails free at step 2's loss peak (full fine-tuning without checkpointing;
analytic/reserve/load_residue.py ``loss_tails``, ``loss_tails_switch``).

Truths used: allocation sequences replayed through ``allocator/model.py`` (the port of CUDACachingAllocator.cpp), and
bench/reserve/replay_causes.jsonl: the free blocks at step 2's peak of the replay of a traced step, by what made
their segment (``python bench/reserve/run_grid.py --causes ID``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.analytic.test_reserve import _specs
from vramledger.allocator.model import CachingAllocatorModel
from vramledger.analytic.reserve.load_residue import loss_tails, loss_tails_switch
from vramledger.analytic.step import step_parts

MiB = 2**20
CAUSES = Path(__file__).resolve().parents[2] / "bench" / "reserve" / "replay_causes.jsonl"


@pytest.mark.parametrize(("kv", "free"), [(MiB // 2, 2 * 11 * MiB // 8), (5 * MiB // 4, 0)], ids=["small", "large"])
def test_weight_tails_stay_free_while_k_and_v_are_small_pool_blocks(kv: int, free: int) -> None:
    """Two 16.625 MiB weights (Qwen2.5-0.5B's MLP matrices in fp32) each get an 18 MiB segment (kRoundLarge), a
    1.375 MiB tail left; a 3.5 MiB saved activation (c·H·T) does not fit a tail and is cut from a 20 MiB segment
    (kLargeBuffer, under kMinLargeAlloc). k and v of 0.5 MiB are small-pool requests (≤ 1 MiB) and leave the tails
    whole: 2.75 MiB free in the weights' segments. At 1.25 MiB they are large-pool requests, and best fit hands each
    a whole tail (its 0.125 MiB rest is under the 1 MiB a large block's split needs): nothing free there."""
    model = CachingAllocatorModel()
    weights = [model.malloc(16_625 * MiB // 1000) for _ in range(2)]
    model.malloc(7 * MiB // 2)
    model.malloc(kv)
    model.malloc(kv)
    segs = {w.seg for w in weights if w is not None}
    got = sum(b.size for b in model._large.blocks.values() if b.seg in segs)  # noqa: SLF001 - the pool's free blocks
    print(f"k and v of {kv / MiB} MiB: {got / MiB} MiB free in the weights' segments, expected {free / MiB}")
    assert got == free


def test_loss_tails_against_the_replay() -> None:
    """Qwen2.5-0.5B full, fp32, fused AdamW, 4 × 256: the replay keeps 114 MiB free in 97 blocks of the load's
    segments at step 2's peak; the tails under its 3.06 MiB q and o projections, counted, within 5%; on at that
    shape (c·kv·T = 0.5 MiB), off once k and v leave the small pool (4 × 513: 1.002 MiB)."""
    cid = "qwen2.5-0.5b/full/b4/L256/nockpt/sdpa/fp32/adamw_torch_fused"
    rec = next(r for r in map(json.loads, CAUSES.read_text().splitlines()) if r["id"] == cid)
    traced = next(f["bytes"] for f in rec["free_at_peak"] if f["made_by"].startswith("step 0 load"))
    m, train = _specs(cid)
    train = dataclasses.replace(train, packing=True)
    p = step_parts(m, train)
    got = loss_tails(m, train, p)
    on = loss_tails_switch(m, train, p)
    print(f"replay {traced / MiB:.1f} MiB free in the load's segments, counted {got / MiB:.1f} MiB")
    assert abs(got / traced - 1) <= 0.05
    assert on is not None and on(4, 256) and not on(4, 513)
