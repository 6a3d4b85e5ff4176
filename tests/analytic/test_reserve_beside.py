"""Step 1's optimizer states beside the logits chain under checkpointing (reserve/shape.py ``states_beside_chain``).

Truths used: a hand-built allocation sequence replayed through ``allocator/model.py`` (the port of
CUDACachingAllocator.cpp), whose reserved memory follows from best fit and splitting alone; and
bench/reserve/replay_states.jsonl, where the replay of each traced full fine-tuning step puts step 1's states
(``python bench/reserve/run_grid.py --states ID``). No tracing here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from vramledger.analytic.reserve import replay_excess
from vramledger.analytic.reserve.full import blocks_with_states, remade_blocks
from vramledger.analytic.reserve.shape import states_beside_chain, stranded_bytes
from vramledger.analytic.step import step_parts
from vramledger.specs import Method

MiB = 2**20
ROOT = Path(__file__).resolve().parents[2]
STATES = ROOT / "bench" / "reserve" / "replay_states.jsonl"


def test_states_in_a_checkpointed_layers_freed_blocks_reach_one_fp32_block_not_two() -> None:
    """From the allocator rules alone. Weights 200 MiB; step 1's checkpointed layer leaves four 80 MiB transient
    blocks R free, the loss a c·V·T block X = 100 MiB and three fp32 blocks F = 200 MiB. Backward makes two 80 MiB
    gradients (best fit: two R, exactly), AdamW then four 80 MiB states (``_init_group``): two in the other R, one
    in X (rest 20), the last cut from an F. Step 2 (gradients freed) runs the layer again (its four R are cut from
    what is free and freed before the loss), then the loss: X from F's rest (120), two F whole, the third made
    anew. One block, as ``blocks_with_states`` counts with the states beside the chain left out (4R − 2 gradients
    = 160 MiB: S − 160 spills 60 MiB past X); counting every state into the chain gives two.
    Reserved = 200 + 4·80 + 100 + 3·200 + 200 = 1420 MiB."""
    R, X, F, W = 80 * MiB, 100 * MiB, 200 * MiB, 200 * MiB
    layer1 = tuple((10 + i, R) for i in range(4)) + tuple((10 + i, 0) for i in range(4))
    loss1 = ((2, X), (3, F), (4, F), (5, F), (2, 0), (3, 0), (4, 0), (5, 0))
    grads = ((20, R), (21, R))
    states = tuple((30 + i, R) for i in range(4))
    layer2 = tuple((40 + i, R) for i in range(4)) + tuple((40 + i, 0) for i in range(4))
    loss2 = ((50, X), (51, F), (52, F), (53, F), (50, 0), (51, 0), (52, 0), (53, 0))
    reserved, _ = replay_excess(((1, W), *layer1, *loss1, *grads, *states, (20, 0), (21, 0), *layer2, *loss2))
    beside = 4 * R - 2 * R
    counted = blocks_with_states(4 * R - beside, X, (F, F, F))
    every = blocks_with_states(4 * R, X, (F, F, F))
    print(f"expected reserved 1420 MiB, 1 block (2 counting every state); got {reserved // MiB}, {counted}, {every}")
    assert (reserved, counted, every) == (1420 * MiB, 1, 2)


def _grid() -> Any:  # noqa: ANN401
    sys.path.insert(0, str(ROOT / "bench" / "reserve"))
    try:
        import run_grid
    finally:
        sys.path.pop(0)
    return run_grid


def _checkpointed_full() -> list[dict[str, Any]]:
    g = _grid()
    rows = {g.config_id(r): r for r in g.GRID}
    recs = [json.loads(line) for line in STATES.read_text().splitlines()]
    return [r for r in recs if r["id"] in rows and "/full/" in r["id"] and "/ckpt/" in r["id"]]


@pytest.mark.parametrize("rec", _checkpointed_full(), ids=lambda r: r["id"])
def test_states_beside_the_chain_never_exceed_the_replays(rec: dict[str, Any]) -> None:
    """The states the estimate keeps out of the chain are never more than the replay put outside it (so the count
    of blocks step 2 makes again is not lowered past what the allocator does), on every checkpointed full
    fine-tuning config of replay_states.jsonl."""
    g = _grid()
    model, train, _ = g.specs({g.config_id(r): r for r in g.GRID}[rec["id"]])
    assert train.method is Method.FULL and train.grad_ckpt
    p = step_parts(model, train, None)
    beside = min(states_beside_chain(model, train, p), p.state_bytes)
    print(
        f"{rec['id']}: beside {beside / 2**30:.2f} GiB, replay outside the chain {rec['states_elsewhere'] / 2**30:.2f}"
    )
    assert 0 <= beside <= rec["states_elsewhere"]


def test_qwen3_0_6b_eager_states_stay_in_the_hole() -> None:
    """Qwen3-0.6B full, eager, bf16-true, checkpointed, 8 × 1024: the replay puts 1.39 GiB of the 2.22 GiB of states
    outside the chain and the rest in the c·V·T block, none in an fp32 block, and step 2 makes nothing again
    (replay_states.jsonl). The estimate: a recomputed layer's free blocks (eager's fp32 scores among them) less the
    gradients hold 1.14 GiB, the rest fits the 2.32 GiB c·V·T block, at 8 × 1024 and at the shorter 8 × 980 the
    padded run holds (where counting every state into the chain reached one fp32 block by 2 MiB)."""
    from dataclasses import replace

    rec = next(r for r in _checkpointed_full() if r["id"] == "qwen3-0.6b/full/b8/L1024/ckpt/eager/bf16-true")
    g = _grid()
    model, train, _ = g.specs({g.config_id(r): r for r in g.GRID}[rec["id"]])
    for ell in (1024, 980):
        t = replace(train, seq_len=ell)
        p = step_parts(model, t, None)
        hole, blocks = remade_blocks(model, t)
        beside = states_beside_chain(model, t, p)
        assert beside == stranded_bytes(model, t, p) - hole - p.grad_bytes
        got = blocks_with_states(p.state_bytes - beside, hole, blocks)
        print(f"8 × {ell}: beside {beside / 2**30:.2f} GiB, blocks reached {got} (replay at 8 × 1024: 0)")
        assert got == 0
    assert rec["fp32_blocks_with_states"] == 0 and rec["made_in_step_2_fp32_blocks"] == 0
