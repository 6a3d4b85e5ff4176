"""Full fine-tuning under checkpointing: what step 1 leaves for step 2 (reserve/shape.py ``_full_stranded``,
``states_beside_chain``, ``workspace_in_chain``).

Truths used: hand-built allocation sequences replayed through ``allocator/model.py`` (the port of
CUDACachingAllocator.cpp), whose reserved memory follows from best fit and splitting alone; and the replays of the
traced steps in bench/reserve/: where step 1's states land and what step 1 reserved before its optimizer
(replay_states.jsonl, ``python bench/reserve/run_grid.py --states ID``) and what is free at step 2's peak
(replay_causes.jsonl). No tracing here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from vramledger.analytic.reserve import replay_excess
from vramledger.analytic.reserve.full import blocks_with_states, relaid_counted
from vramledger.analytic.reserve.shape import _full_stranded, states_beside_chain, workspace_in_chain
from vramledger.analytic.step import step_parts
from vramledger.specs import Method

MiB = 2**20
ROOT = Path(__file__).resolve().parents[2]
STATES = ROOT / "bench" / "reserve" / "replay_states.jsonl"
CAUSES = ROOT / "bench" / "reserve" / "replay_causes.jsonl"


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


def test_a_recomputed_layer_is_cut_from_the_freed_logits_blocks() -> None:
    """From the allocator rules alone: step 1's forward leaves a checkpointed layer's two 60 MiB transient blocks
    free, the loss a c·V·T block X = 100 MiB and three fp32 blocks F = 200 MiB, all freed by lm_head's backward.
    Backward then recomputes each of four layers, 2 × 60 + 2 × 40 MiB live at once (its transients and their
    gradients), with a 20 MiB weight gradient left per layer: best fit cuts them from the freed blocks, the
    smallest that hold them, and makes no segment. Reserved = 200 + 120 + 100 + 600 = 1020 MiB, where counting the
    recomputed layer as stranded besides puts 200 MiB more (the mid model, 4 × 2048: 0.29 GiB over the replay)."""
    R, X, F = 60 * MiB, 100 * MiB, 200 * MiB
    forward = ((10, R), (11, R), (10, 0), (11, 0), (2, X), (3, F), (4, F), (2, 0), (5, F), (3, 0), (4, 0), (5, 0))
    backward: list[tuple[int, int]] = []
    for layer in range(4):
        ids = [100 + 10 * layer + i for i in range(4)]
        backward += [(ids[0], R), (ids[1], R), (ids[2], 40 * MiB), (ids[3], 40 * MiB), (60 + layer, 20 * MiB)]
        backward += [(i, 0) for i in ids]
    reserved, _ = replay_excess(((1, 200 * MiB), *forward, *backward))
    print(f"expected reserved 1020 MiB; got {reserved // MiB}")
    assert reserved == 1020 * MiB


def _specs(cid: str) -> tuple[Any, Any]:
    g = _grid()
    model, train, _ = g.specs({g.config_id(r): r for r in g.GRID}[cid])
    return model, train


@pytest.mark.parametrize("rec", [r for r in _checkpointed_full() if "/freeze/" not in r["id"]], ids=lambda r: r["id"])
def test_step_1s_loss_side_reserve_is_under_the_replays(rec: dict[str, Any]) -> None:
    """Step 1's reserve before its optimizer as ``single_shape`` bounds it from its loss (R1: the loss peak less the
    states, the hole and one checkpointed layer's forward transients, or the segments its forward made) is never
    above what the replay has reserved there, on every checkpointed full fine-tuning config (with the recomputed
    layer counted too it was above on four: the mid model 4 × 2048 5.11 against 4.82 GiB, the toy 8 × 1024,
    Qwen3-0.6B 8 × 1024 eager and 4 × 4096)."""
    from vramledger.analytic.reserve.ckpt_forward import forward_segments
    from vramledger.analytic.step import _peaks_at

    model, train = _specs(rec["id"])
    p, loss, _, _ = _peaks_at(model, train, None)
    r1 = max(loss - p.state_bytes + _full_stranded(model, train, p), forward_segments(model, train, p))
    print(f"{rec['id']}: R1 {r1 / 2**30:.2f} GiB, replay {rec['reserved_end_of_step_1'] / 2**30:.2f} GiB")
    assert r1 <= rec["reserved_end_of_step_1"]


def test_the_backward_workspace_in_a_logits_block_makes_step_2_remake_it() -> None:
    """From the allocator rules alone, then the toy's replay. Step 1's forward leaves 16 MiB MLP blocks free; at
    lm_head's backward the fp32 copy F = 200 MiB is free and the c·V·T block X = 100 MiB holds the logits gradient's
    cast, so the backward thread's 32 MiB workspace (never freed) fits only the copy's block: best fit cuts it
    from there. The states (four 8 MiB) go in the small blocks. Step 2's backward needs three F at once: one
    is made anew (reserved 200 + 4·16 + 100 + 3·200 + 200 = 1164 MiB) though no state reached an F, as
    ``relaid_counted`` counts with ``workspace``. The replay of the toy, 8 × 1024 (c·I·T = 22 MiB < 32 MiB): every
    state outside the chain, 218 MiB of the copy's 250 MiB block free at step 2's peak (the workspace in the
    rest), and one fp32 block made again."""
    X, F, ws = 100 * MiB, 200 * MiB, 32 * MiB
    step1 = ((1, 200 * MiB), *((10 + i, 16 * MiB) for i in range(4)), *((10 + i, 0) for i in range(4)))
    step1 += ((2, X), (3, F), (4, F), (5, F), (3, 0), (9, ws), (2, 0), (4, 0), (5, 0))
    states = tuple((20 + i, 8 * MiB) for i in range(4))
    step2 = ((30, F), (31, F), (32, F), (30, 0), (31, 0), (32, 0))
    reserved, _ = replay_excess(step1 + states + step2)
    print(f"expected reserved 1164 MiB; got {reserved // MiB}")
    assert reserved == 1164 * MiB

    cid = "tiny/full/b8/L1024/ckpt/sdpa"
    model, train = _specs(cid)
    p = step_parts(model, train, None)
    rec = next(r for r in _checkpointed_full() if r["id"] == cid)
    causes = {json.loads(x)["id"]: json.loads(x) for x in CAUSES.read_text().splitlines()}[cid]
    copy = next(f for f in causes["free_at_peak"] if "_to_copy (logits_loss)" in f["made_by"])
    assert rec["states_elsewhere"] == rec["states"] and rec["made_in_step_2_fp32_blocks"] == 1.0
    assert rec["fp32_block"] - copy["bytes"] == 32 * MiB  # the copy's 250 MiB block less the workspace
    assert workspace_in_chain(model, train, p)
    assert relaid_counted(model, train, p, states_beside_chain(model, train, p), True) == rec["fp32_block"]
    # the mid model, 4 × 2048: its c·I·T MLP blocks (44 MiB) hold the workspace
    mid, mid_train = _specs("mid/full/b4/L2048/ckpt/sdpa")
    assert not workspace_in_chain(mid, mid_train, step_parts(mid, mid_train, None))
