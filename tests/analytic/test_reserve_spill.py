"""Where step 1's AdamW states spill (analytic/reserve/spill.py): the c·V·T logits block step 2 makes again, and the
fp32 logits block made again beside a tied embedding's V·H block.

Truths used: hand-built allocation sequences whose reserved memory follows from CUDACachingAllocator.cpp's rules alone
(replayed through ``allocator/model.py``, its port); bench/reserve/spill_shapes.jsonl, real transformers steps traced
on fake tensors at the lengths where runs.jsonl's sweep rises by about one block, and beside them, with what the
replay makes again in step 2 (``python bench/reserve/run_spill.py``; no tracing here).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from vramledger.analytic import estimate
from vramledger.analytic.reserve import replay_excess
from vramledger.analytic.reserve.full import blocks_with_states, relaid_counted, tied_gradient_block
from vramledger.analytic.reserve.runs import switches_on
from vramledger.analytic.reserve.spill import hole_remade, tied_remade
from vramledger.analytic.step import step_parts
from vramledger.catalog import resolve_model
from vramledger.specs import Method, Optimizer, Precision, TrainSpec

MiB = 2**20
ROOT = Path(__file__).resolve().parents[2]
SHAPES = ROOT / "bench" / "reserve" / "spill_shapes.jsonl"


def test_states_in_every_logits_block_make_step_2_remake_the_logits_block() -> None:
    """``hole_remade`` from the allocator rules alone, and why it is a bound.

    Weights W = 200 MiB; step 1 frees the c·V·T logits block X = 100 MiB and three fp32 blocks F = 200 MiB; AdamW then
    creates n states of 50 MiB (``_init_group``): best fit fills X (two), then one F after another (four each). Step
    2's forward asks for X, then F (the fp32 copy) and F (the log-softmax), frees the copy and X; backward asks for
    two F (``nll_loss_backward`` in the copy's block, ``_log_softmax_backward_data``).
    - n = 13: the last F holds three states, its rest (50) is smaller than X: X is made again with three F (+700);
    - n = 11: the last F holds one, its rest (150) takes X: three F made again (+600).
    The count reaches every fp32 block in both (``blocks_with_states``), so the estimate counts X in both: an upper
    bound, met at n = 13 (the rests the states leave decide, which the estimate does not model).
    """
    X, F, S = 100 * MiB, 200 * MiB, 50 * MiB
    step1 = ((1, 200 * MiB), (2, X), (3, F), (4, F), (5, F), (2, 0), (3, 0), (4, 0), (5, 0))
    step2 = ((20, X), (21, F), (22, F), (21, 0), (20, 0), (23, F), (24, F), (22, 0), (23, 0), (24, 0))
    got = {n: replay_excess(step1 + tuple((10 + i, S) for i in range(n)) + step2)[0] for n in (13, 11)}
    reached = {n: blocks_with_states(n * S, X, (F, F, F)) for n in (13, 11)}
    expected = {13: 200 * MiB + X + 3 * F + X + 3 * F, 11: 200 * MiB + X + 3 * F + 3 * F}
    print(f"expected {expected}, got {got}; reached {reached}")
    assert got == expected
    assert reached == {13: 3, 11: 3}


def test_two_freed_vh_blocks_hold_the_loss_blocks_up_to_their_size() -> None:
    """``tied_remade`` from the allocator rules alone.

    Weights W = 200 MiB; step 1 frees three fp32 logits blocks F = 200 MiB and two V·H blocks G (a tied embedding's
    gradient sum and the foreach temporary); three 150 MiB states are cut from the three F (each the smallest block
    that holds one). Step 2's loss needs three F at once, then the embedding's backward three G at once (lm_head's
    gradient, the embedding's, their sum). Best fit takes the F requests from the G blocks, a split block's rest
    serving the next: with G = 410 MiB (⌊G/F⌋ = 2) they hold all three and only one G is made again; with G = 300 MiB
    (⌊G/F⌋ = 1) they hold two, and one F is made again beside the G: max(3 − 2·⌊G/F⌋, 0) fp32 blocks.
    """
    F = 200 * MiB

    def reserved(G: int) -> int:
        step1 = ((1, 200 * MiB), (2, F), (3, F), (4, F), (5, G), (6, G), (2, 0), (3, 0), (4, 0), (5, 0), (6, 0))
        states = ((7, 150 * MiB), (8, 150 * MiB), (9, 150 * MiB))
        loss = ((20, F), (21, F), (22, F), (20, 0), (21, 0), (22, 0))
        embedding = ((30, G), (31, G), (32, G), (30, 0), (31, 0), (32, 0))
        return replay_excess(step1 + states + loss + embedding)[0]

    def counted_again(G: int) -> int:
        return max(3 - 2 * (G // F), 0) * F

    got = {G // MiB: reserved(G) for G in (410 * MiB, 300 * MiB)}
    expected = {G // MiB: 200 * MiB + 3 * F + 2 * G + G + counted_again(G) for G in (410 * MiB, 300 * MiB)}
    print(f"expected {expected}, got {got}")
    assert got == expected
    assert (counted_again(410 * MiB), counted_again(300 * MiB)) == (0, F)


@pytest.mark.parametrize("spoiled", [2, 1, 0])
def test_at_the_tied_edge_a_logits_block_is_made_again_where_both_other_blocks_hold_something(spoiled: int) -> None:
    """``spill.at_tied_edge`` from the allocator rules alone: every block F = 200 MiB is at once an fp32 logits block
    (4·V·T) and the tied embedding's V·H gradient.

    Forward leaves two blocks, P (32 MiB) and Q (16 MiB), live as activations or freed. Step 1's loss frees its three
    F blocks A, B, C. Backward: the workspace (32 MiB, never freed) takes P where P is free, else A (best fit: the
    smallest free block at least as large); lm_head's V·H gradient takes the next whole F, two layers' gradients
    (168 and 180 MiB) the smallest blocks that hold them, so the embedding's dense gradient D and the sum find no
    whole F and get segments. lm_head's gradient and D are freed; ``_init_group`` puts the embedding's two F states
    in their blocks, and a 16 MiB state in Q where Q is free, else in the 20 MiB rest the second gradient left; the
    foreach temporary gets a segment and is freed; ``zero_grad`` frees the sum and the gradients. Step 2's loss asks
    for three F at once: the sum's and the temporary's blocks serve two, the chain's two other blocks the third only
    where one of them is whole. ``spoiled``: how many of those two hold something (0: P and Q freed; 1: Q live, the
    state in a gradient's rest; 2: both live, the workspace in A too). Made again: one F where both do, none
    otherwise, which is ``tied_remade``'s max(reached − 2·⌊V·H·b / 4·V·T⌋, 0) with reached = 1 + ``spoiled`` (the
    block the embedding's state sits in, and those two).
    """
    F, P, Q = 200 * MiB, 32 * MiB, 16 * MiB
    forward = ((99, P), (98, Q))
    loss1 = ((1, F), (2, F), (3, F), (1, 0), (2, 0), (3, 0))
    freed = ((99, 0),) * (spoiled < 2) + ((98, 0),) * (spoiled < 1)
    backward = ((4, P), (5, F), (6, 168 * MiB), (13, 180 * MiB), (7, F), (8, F), (5, 0), (7, 0))
    states = ((10, F), (11, F), (9, Q), (12, F), (12, 0), (8, 0), (6, 0), (13, 0))
    loss2 = ((20, F), (21, F), (22, F))
    reserved, _ = replay_excess(forward + loss1 + freed + backward + states + loss2)
    made = max(1 + spoiled - 2, 0) * F
    expected = P + Q + 6 * F + made
    print(f"spoiled {spoiled}: expected {expected // MiB} MiB ({made // F} F made again), got {reserved // MiB} MiB")
    assert reserved == expected


def _states_records() -> dict[str, dict[str, Any]]:
    path = ROOT / "bench" / "reserve" / "replay_states.jsonl"
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_at_the_tied_edge_the_count_matches_the_replays() -> None:
    """The checkpointed full fine-tuning configs of the grid at the tied edge (4·V·T = V·H·b) with foreach AdamW:
    the fp32 logits blocks the estimate counts step 2 making again there (shape.py ``_tied_relaid``: where step 1
    cut the backward workspace or gradients from the chain's blocks) against what the replay's step 2 makes
    (bench/reserve/replay_states.jsonl)."""
    from tests.analytic.test_reserve import _specs as grid_specs
    from vramledger.analytic.reserve.shape import _tied_relaid, gradients_in_chain, step1_loss_reserve
    from vramledger.analytic.reserve.spill import at_tied_edge
    from vramledger.analytic.reserve.switches import Switching
    from vramledger.analytic.step import _peaks_at

    expected = {
        "qwen3-1.7b/full/b2/L1024/ckpt/sdpa": 1,
        "llama-3.2-1b/full/b2/L1024/ckpt/sdpa/fp32": 1,
        "llama-3.2-1b/full/b1/L2048/ckpt/sdpa": 0,
    }
    records = _states_records()
    for cid, blocks in expected.items():
        model, train = grid_specs(cid)
        p, loss_peak, _, _ = _peaks_at(model, train, None)
        assert at_tied_edge(model, train, p)
        grads = gradients_in_chain(model, train, p, step1_loss_reserve(model, train, p, loss_peak))
        counted = _tied_relaid(model, train, p, Switching(relaid=True), grads)
        rec = records[cid]
        made = rec["made_in_step_2_fp32_blocks"]
        print(f"{cid}: replay makes {made} fp32 blocks again, counted {counted / rec['fp32_block']:.2f}")
        assert rec["made_in_step_2_fp32_blocks"] == blocks
        assert counted == blocks * 4 * model.vocab_size * train.tokens


def _shapes() -> list[dict[str, Any]]:
    return [json.loads(line) for line in SHAPES.read_text().splitlines()]


def _specs(rec: dict[str, Any]):  # noqa: ANN202
    sys.path.insert(0, str(ROOT / "bench" / "reserve"))
    try:
        import run_spill
    finally:
        sys.path.pop(0)
    row = {run_spill.g.config_id(r): r for r, _ in run_spill.SHAPES}[rec["id"]]
    model, train, _ = run_spill.g.specs(row)
    return model, train


@pytest.mark.parametrize("rec", _shapes(), ids=lambda r: r["id"])
def test_the_counted_blocks_cover_what_the_traced_step_2_makes_again(rec: dict[str, Any]) -> None:
    """At each traced shape, the blocks the estimate counts as made again in step 2 (the fp32 logits blocks the
    states reach, the c·V·T block, a tied embedding's V·H block and the fp32 block beside it, where each is on) are
    at least what the replay's step 2 makes, and at most one logits block more (the bounds' excess where the states
    leave a rest that serves the request, or reach fewer blocks than counted)."""
    model, train = _specs(rec)
    p = step_parts(model, train)
    tied_on = switches_on(model, train, p).tied
    tied = tied_on is not None and tied_on(train.micro_batch, train.seq_len)
    counted = relaid_counted(model, train, p) + hole_remade(model, train, p)
    counted += tied_gradient_block(p) + tied_remade(model, train, p) if tied else 0
    f = rec["states"]["fp32_block"]
    made = rec["states"]["made_in_step_2_fp32_blocks"] * f
    print(f"{rec['id']}: replay makes {made / f:.2f} blocks again in step 2, the estimate counts {counted / f:.2f}")
    assert made - 0.05 * f <= counted <= made + f


def _reserved(model: str, train: TrainSpec) -> int:
    return estimate(resolve_model(model), train).peak_reserved


@settings(max_examples=40, deadline=None)
@example(model="llama-3.2-1b", b=1, ell=1024, dl=1)  # T > H·b/8: the fp32 block beside V·H starts
@example(model="llama-3.2-1b", b=1, ell=2047, dl=1)  # 4·T = H·b: the tied blocks stop (held)
@example(model="qwen2.5-3b", b=2, ell=1984, dl=64)  # the c·V·T block made again at 1984, not 2048
@example(model="qwen2.5-0.5b", b=1, ell=2048, dl=600)  # where the count drops from three blocks
@given(
    model=st.sampled_from(["llama-3.2-1b", "qwen3-1.7b", "qwen2.5-3b", "qwen2.5-0.5b"]),
    b=st.integers(1, 4),
    ell=st.integers(256, 4096),
    dl=st.integers(0, 300),
)
def test_reserved_never_falls_across_the_spill_bounds(model: str, b: int, ell: int, dl: int) -> None:
    """The spill bounds switch off as the shape grows (the count drops, 4·V·T outgrows the V·H gradient); a run with
    dynamic padding holds them over the shorter shapes, so its reserved never falls as
    the length grows, for full fine-tuning with foreach AdamW under checkpointing (the configs they apply to)."""
    train = TrainSpec(
        method=Method.FULL,
        precision=Precision.BF16 if model == "qwen2.5-3b" else Precision.BF16_MIXED,
        optimizer=Optimizer.ADAMW,
        micro_batch=b,
        seq_len=ell,
        grad_ckpt=True,
    )
    assert _reserved(model, dataclasses.replace(train, seq_len=ell + dl)) >= _reserved(model, train)
