"""States in every MLP activation segment (analytic/reserve/state_rests.py): what those segments leave free at step
2's loss peak, on the band of shapes where step 1's AdamW states sit in each of them.

Truths used: hand-built allocation sequences whose reserved memory follows from CUDACachingAllocator.cpp's rules alone
(replayed through ``allocator/model.py``, its port); bench/reserve/state_rests.jsonl, real transformers steps
traced on fake tensors and replayed at lengths inside and on both sides of the band, with how many MLP activation
segments hold a state and what they have free at step 2's peak (``python bench/reserve/run_state_rests.py``; no
tracing here).
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
from vramledger.analytic.reserve.state_rests import band_edges, rests_band, state_rests_cached
from vramledger.analytic.step import step_parts
from vramledger.catalog import resolve_model
from vramledger.ledger import Phase
from vramledger.specs import Method, Optimizer, Precision, TrainSpec

MiB = 2**20
ROOT = Path(__file__).resolve().parents[2]
SHAPES = ROOT / "bench" / "reserve" / "state_rests.jsonl"
TRAIN = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)


def _step(residual: int, vh: int) -> tuple[tuple[int, int], ...]:
    """One layer's step, twice (MiB): weights W = 100; forward saves four MLP blocks A = 64 and two residual blocks R;
    backward frees them, cutting the three MLP gradients G = 52 from three A (rests of 12), and makes the V·H
    gradient; the optimizer makes the embedding's two states (V·H each), the q and o states (10 MiB, two each) and
    the MLP matrix's two states (52) in ``_init_group``'s order, then the embedding's foreach temporary (V·H, freed);
    ``zero_grad`` frees the gradients; step 2's forward asks for the four A and the two R again."""
    A, G, Q = 64 * MiB, 52 * MiB, 10 * MiB
    fwd = ((1, 100 * MiB), (2, A), (3, A), (4, A), (5, A), (6, residual), (7, residual))
    bwd = ((5, 0), (8, G), (4, 0), (9, G), (3, 0), (10, G), (2, 0), (6, 0), (7, 0), (11, vh))
    opt = ((12, vh), (13, vh), (15, Q), (16, Q), (17, Q), (18, Q), (19, G), (20, G), (14, vh), (14, 0))
    zero_grad = ((8, 0), (9, 0), (10, 0), (11, 0))
    step2 = ((21, A), (22, A), (23, A), (24, A), (25, residual), (26, residual))
    return fwd + bwd + opt + zero_grad + step2


def test_states_in_every_mlp_segment_make_step_2_make_them_again() -> None:
    """The mechanism from the allocator rules alone (``get_free_block`` best fit, a split block's rest staying free).

    Residual blocks R = 14 MiB: the q and o states (10) take the three 12 MiB rests beside the gradients (the smallest
    blocks that hold them) and R's block; the MLP states take the fourth A and a segment of their own. So every A
    holds a state after ``zero_grad`` and cannot serve step 2's A; the two freed V·H blocks (100 MiB: the gradient's
    and the temporary's) hold ⌊100/64⌋ = 1 each, and two A are made again:
    100 + 4·64 + 2·14 + 100 (V·H gradient) + 2·100 (states) + 100 (temporary) + 52 (a state) + 2·64 = 964 MiB.
    With R = 10 MiB the first two q/o states take the R blocks (smaller than the rests), one A keeps no state, and
    one A fewer is made again: 964 − 2·4 − 64 = 892 MiB. ``state_rests_cached``'s rule is the first case."""
    got = {residual // MiB: replay_excess(_step(residual, 100 * MiB))[0] // MiB for residual in (14 * MiB, 10 * MiB)}
    expected = {14: 100 + 4 * 64 + 2 * 14 + 100 + 2 * 100 + 100 + 52 + 2 * 64, 10: 892}
    print(f"expected {expected}, got {got}")
    assert got == expected


def test_the_freed_vh_blocks_hold_what_fits_in_them() -> None:
    """With V·H blocks of 130 MiB each holds ⌊130/64⌋ = 2 of step 2's A: none is made again."""
    got = replay_excess(_step(14 * MiB, 130 * MiB))[0] // MiB
    expected = 100 + 4 * 64 + 2 * 14 + 130 + 2 * 130 + 130 + 52
    print(f"expected {expected}, got {got}")
    assert got == expected


def _records() -> list[dict[str, Any]]:
    return [json.loads(line) for line in SHAPES.read_text().splitlines()]


def _at(rec: dict[str, Any]) -> tuple[Any, TrainSpec]:
    sys.path.insert(0, str(ROOT / "bench" / "reserve"))
    import run_grid

    model, train, _ = run_grid.specs({run_grid.config_id(r): r for r in run_grid.GRID}[rec["id"]])
    return model, dataclasses.replace(train, seq_len=rec["seq_len"])


@pytest.mark.parametrize("rec", _records(), ids=lambda r: f"{r['id'].split('/')[0]}-{r['micro_batch']}x{r['seq_len']}")
def test_band_is_where_every_mlp_segment_holds_a_state(rec: dict[str, Any]) -> None:
    """The band's conditions (sizes only) against the replay: on exactly where every MLP activation segment but at
    most one holds a state of step 1; there the counted free bytes are within 10% of what the replay has free in
    those segments at step 2's peak, and the estimate (dynamic padding: the band is on at the shape itself, its
    longest shape ≤ (b, ℓ)) within 3% of the replay's reserved."""
    model, t = _at(rec)
    p = step_parts(model, t, None)
    band = rests_band(model, t, p)
    on = bool(band and band(t.micro_batch, t.seq_len))
    every = rec["mlp_segments_with_states"] >= rec["mlp_segments"] - 1
    print(
        f"{rec['id']} {t.micro_batch} x {t.seq_len}: band {on}, replay {rec['mlp_segments_with_states']} of "
        f"{rec['mlp_segments']}"
    )
    assert on == every
    if not on:
        return
    counted, free = state_rests_cached(model, t, p), rec["free_in_them_at_step_2_peak"]
    got = max(estimate(model, t).reserved(ph) for ph in TRAIN)
    print(
        f"  counted {counted / 1e9:.2f} GB, replay free {free / 1e9:.2f} GB; reserved {got / 1e9:.2f} GB, replay "
        f"{rec['peak_reserved'] / 1e9:.2f} GB"
    )
    assert abs(counted / free - 1) <= 0.10
    assert abs(got / rec["peak_reserved"] - 1) <= 0.03


def test_a_padded_run_holds_the_band_and_a_packed_run_leaves_it_out() -> None:
    """Qwen2.5-1.5B full 4 × 1024 (the grid's config): the band ends at 4 × 936; a run with dynamic padding meets that
    shape and is estimated at least at its reserve with the band's term (the replay at 4 × 936: 52.25 GB); a packed
    run of 4 × 1024 never meets it."""
    model = resolve_model("qwen2.5-1.5b")
    train = TrainSpec(method=Method.FULL, micro_batch=4, seq_len=1024, grad_ckpt=False)
    assert band_edges(model, train, step_parts(model, train, None)) == [(4, 936)]
    padded = max(estimate(model, train).reserved(ph) for ph in TRAIN)
    packed = max(estimate(model, dataclasses.replace(train, packing=True)).reserved(ph) for ph in TRAIN)
    at_936 = max(estimate(model, dataclasses.replace(train, seq_len=936)).reserved(ph) for ph in TRAIN)
    print(f"padded {padded / 1e9:.2f} GB, packed {packed / 1e9:.2f} GB, padded 4 x 936 {at_936 / 1e9:.2f} GB")
    assert padded >= at_936 >= 0.97 * 52.25e9
    assert packed < 0.97 * 52.25e9


def test_off_where_the_setup_differs() -> None:
    """Checkpointing, SGD, adapters: no band; the other catalogue models up to 8B: no shape of one micro-batch up
    to 32k tokens meets every condition (the sizes' coincidence is Qwen2.5-1.5B's)."""
    qwen = resolve_model("qwen2.5-1.5b")
    base = TrainSpec(method=Method.FULL, micro_batch=4, seq_len=928, grad_ckpt=False)
    for t in (
        dataclasses.replace(base, grad_ckpt=True),
        dataclasses.replace(base, optimizer=Optimizer.SGD),
        dataclasses.replace(base, method=Method.LORA),
    ):
        assert rests_band(qwen, t, step_parts(qwen, t, None)) is None
    for name in ("llama-3.2-1b", "llama-3.2-3b", "qwen3-1.7b", "qwen2.5-3b", "llama-3-8b"):
        m = resolve_model(name)
        for precision in (Precision.BF16_MIXED, Precision.BF16):
            t = TrainSpec(method=Method.FULL, micro_batch=1, seq_len=32768, grad_ckpt=False, precision=precision)
            assert band_edges(m, t, step_parts(m, t, None)) == [], (name, precision)


@settings(max_examples=25, deadline=None)
@example(b=4, ell=906, db=0, dl=1)  # the band's lower edge
@example(b=4, ell=936, db=0, dl=1)  # its upper edge: 4 × 937 alone is 4.3 GB lower (the replay: 52.25 → 47.37 GB)
@example(b=3, ell=1248, db=1, dl=0)  # 3 × 1248 = 3744 tokens, in the band; 4 × 1248 is past it
@given(b=st.integers(1, 8), ell=st.integers(400, 4000), db=st.integers(0, 2), dl=st.integers(0, 200))
def test_a_padded_estimate_never_falls_as_batch_or_length_grows(b: int, ell: int, db: int, dl: int) -> None:
    """Qwen2.5-1.5B full, bf16-mixed, AdamW, no checkpointing, dynamic padding: the band's term is held at the
    longest shape ≤ (b, L) where it is on, so the estimate never falls as b or L grows."""
    model = resolve_model("qwen2.5-1.5b")
    small = TrainSpec(method=Method.FULL, micro_batch=b, seq_len=ell, grad_ckpt=False)
    large = dataclasses.replace(small, micro_batch=b + db, seq_len=ell + dl)
    lo = max(estimate(model, small).reserved(ph) for ph in TRAIN)
    hi = max(estimate(model, large).reserved(ph) for ph in TRAIN)
    assert hi >= lo, (b, ell, db, dl, lo, hi)
