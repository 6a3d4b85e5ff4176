"""The saved activations cached at step 1's optimizer peak (analytic/reserve/held_activations.py): where they switch
on and off, how much stays cached, and the reserve of a run with dynamic padding across those edges.

Truths used: hand-built allocation sequences whose reserved memory follows from CUDACachingAllocator.cpp's rules alone
(replayed through ``allocator/model.py``, its port); bench/reserve/held_activations.jsonl, the step templates of real
transformers steps traced on fake tensors replayed at single shapes on both sides of the edges, with the free bytes in
the forward's segments at step 1's optimizer peak (``python bench/reserve/run_held_activations.py``; no tracing here);
bench/reserve/runs.jsonl's fine sweeps.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.analytic.test_reserve import _specs
from vramledger.analytic import estimate
from vramledger.analytic.reserve import replay_excess
from vramledger.analytic.reserve.full import decoder_mlp_width
from vramledger.analytic.reserve.held_activations import activations_cached, mlp_tensors_unfit
from vramledger.analytic.reserve.runs import switches_on
from vramledger.analytic.reserve.shape import single_shape
from vramledger.analytic.reserve.switches import Switching
from vramledger.analytic.step import _ShapePeaks
from vramledger.catalog import resolve_model
from vramledger.ledger import Phase
from vramledger.specs import Method, Precision, TrainSpec

MiB = 2**20
GiB = 2**30
ROOT = Path(__file__).resolve().parents[2]
HELD = ROOT / "bench" / "reserve" / "held_activations.jsonl"
RUNS = ROOT / "bench" / "reserve" / "runs.jsonl"
TRAIN = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)


def _sequence(mlp_block: int) -> tuple[tuple[int, int], ...]:
    """Weights W = 100 MiB; forward saves four MLP blocks and four 18 MiB ones and backward frees them all; the
    optimizer then makes four 48 MiB tensors (an MLP matrix's) and four 18 MiB ones (q's and o's)."""
    forward = tuple((10 + i, mlp_block) for i in range(4)) + tuple((20 + i, 18 * MiB) for i in range(4))
    freed = tuple((i, 0) for i, _ in forward)
    opt = tuple((30 + i, 48 * MiB) for i in range(4)) + tuple((40 + i, 18 * MiB) for i in range(4))
    return ((1, 100 * MiB), *forward, *freed, *opt)


def test_the_tensors_that_fit_take_the_activation_segments_and_the_rest_stays_cached() -> None:
    """From the allocator rules alone (``get_allocation_size``, ``get_free_block``, ``try_merge_blocks``).

    MLP blocks of 46 MiB get 46 MiB segments (kRoundLarge): no 48 MiB tensor fits them, so those get four new
    segments, while the 18 MiB tensors are cut from the 18 MiB blocks. At the optimizer's peak the four MLP segments
    are free: reserved = 100 + 4·46 + 4·18 + 4·48 = 548 MiB for 364 allocated, and the free 184 MiB are the saved
    activations (256) less the tensors that fit them (72), as ``activations_cached`` counts. With 46.0625 MiB blocks
    the segments are 48 MiB (rounded up to 2 MiB), and once freed each merges back whole: the 48 MiB tensors take
    them and nothing is left free, 364 MiB reserved. The switch follows the segment, not the block."""
    below, above = replay_excess(_sequence(46 * MiB)), replay_excess(_sequence(46 * MiB + 64 * 1024))
    print(f"expected (548, 364) and (364, 364) MiB; got {[x // MiB for x in below]}, {[x // MiB for x in above]}")
    assert below == (548 * MiB, 364 * MiB)
    assert above == (364 * MiB, 364 * MiB)
    H, I = 3072, 8192  # noqa: E741 - Llama-3.2-3B, bf16-true: 4 × 736 is 46 MiB a block, 4 × 737 46.06 MiB
    assert mlp_tensors_unfit(2, 2, H, I, 4 * 736) and not mlp_tensors_unfit(2, 2, H, I, 4 * 737)


def _records() -> list[dict[str, Any]]:
    return [json.loads(line) for line in HELD.read_text().splitlines()]


@pytest.mark.parametrize("rec", _records(), ids=lambda r: f"{r['id']}@{r['length']}")
def test_the_cached_activations_and_the_shape_against_the_replay(rec: dict[str, Any]) -> None:
    """At each replayed shape: the switch on where the replay keeps the forward's segments free at step 1's optimizer
    peak (more than 0.5 GiB), off where it does not; the cached bytes within 2% of the step's reserve of what the
    replay keeps free there; and the single shape's reserve with the mechanism on, as a run with dynamic padding
    holds it, never more than 3% under the replay's."""
    m, train = _specs(rec["id"])
    t = dataclasses.replace(train, seq_len=rec["length"])
    p, loss, step, opt = _ShapePeaks(m, None)(t)
    on = switches_on(m, t, p)
    b, ell = t.micro_batch, t.seq_len
    act = bool(on.activations and on.activations(b, ell))
    cached = activations_cached(m, t, p, decoder_mlp_width(m)) if act else 0
    held = single_shape(
        m, t, p, loss, step, opt, Switching(relaid=True, activations=act, tied=bool(on.tied and on.tied(b, ell)))
    )
    free, reserved = rec["opt1_free_in_forward_segments"], rec["peak_reserved"]
    print(
        f"{rec['id']} @ {ell}: switch {act}; cached {cached / GiB:.2f} GiB, replay free {free / GiB:.2f} GiB; "
        f"single shape {held / GiB:.2f} GiB, replay {reserved / GiB:.2f} GiB ({held / reserved - 1:+.1%})"
    )
    if free > GiB // 2:
        assert act
    assert abs(cached - free) <= 0.02 * reserved
    assert held >= 0.97 * reserved


@pytest.mark.parametrize(
    ("cid", "on", "off"),
    [
        ("llama-3.2-3b/full/b4/L768/nockpt/sdpa/bf16-true", 720, 744),
        ("llama-3-8b/full/b1/L4096/nockpt/sdpa/bf16-true", 3968, 4096),
    ],
)
def test_the_switch_stops_where_the_fine_sweep_falls(cid: str, on: int, off: int) -> None:
    """runs.jsonl's fine sweep: the single shape's reserve falls between ``on`` and ``off`` (Llama-3.2-3B 4 × 720:
    39.27 GiB, 4 × 744: 34.56; Llama-3-8B 1 × 3968: 95.26, 1 × 4096: 79.88). The switch is on at the first and off
    at the second (the block's own condition, c·T < b·H, was on at 4 × 744 and up to 4 × 767)."""
    run = {r["id"]: r for r in map(json.loads, RUNS.read_text().splitlines())}[cid]
    fine = {int(k): v for k, v in run["fine"].items()}
    m, train = _specs(cid)
    c, bw, b = train.precision.compute.bytes, 2, train.micro_batch
    print(f"{cid}: replay {fine[on] / GiB:.2f} GiB at {on}, {fine[off] / GiB:.2f} at {off}")
    assert fine[off] < 0.9 * fine[on]
    assert mlp_tensors_unfit(c, bw, m.hidden_size, decoder_mlp_width(m), b * on)
    assert not mlp_tensors_unfit(c, bw, m.hidden_size, decoder_mlp_width(m), b * off)


def _reserved(m: Any, train: TrainSpec) -> int:
    led = estimate(m, train)
    return max(led.reserved(ph) for ph in TRAIN)


@settings(max_examples=40, deadline=None)
@example(
    train=TrainSpec(method=Method.FULL, precision=Precision.BF16, micro_batch=4, seq_len=736),
    model="llama-3.2-3b",
    db=0,
    dl=1,
)
@example(
    train=TrainSpec(method=Method.FULL, precision=Precision.FP32, micro_batch=1, seq_len=448),
    model="llama-3.2-1b",
    db=0,
    dl=1,
)
@example(train=TrainSpec(method=Method.FULL, micro_batch=1, seq_len=639), model="llama-3.2-1b", db=0, dl=1)
@given(
    train=st.builds(
        TrainSpec,
        method=st.just(Method.FULL),
        precision=st.sampled_from([Precision.BF16_MIXED, Precision.BF16, Precision.FP32]),
        micro_batch=st.integers(1, 8),
        seq_len=st.integers(1, 4096),
        grad_ckpt=st.just(False),
    ),
    model=st.sampled_from(["llama-3.2-1b", "llama-3.2-3b", "qwen3-0.6b"]),
    db=st.integers(0, 2),
    dl=st.integers(0, 512),
)
def test_reserved_never_falls_across_the_edges(train: TrainSpec, model: str, db: int, dl: int) -> None:
    """The single shape's cached activations fall at the switch (4 × 736 → 737 for Llama-3.2-3B in bf16), where a
    matrix's tensors start fitting the MLP block's segment (Llama-3.2-1B fp32 1 × 448 → 449: q's and o's) and where
    the MLP block reaches 10 MiB (Llama-3.2-1B bf16-mixed 1 × 639 → 640); a run with dynamic padding holds each edge,
    so its estimate never falls as the micro-batch or the length grows."""
    m = resolve_model(model)
    more = dataclasses.replace(train, micro_batch=train.micro_batch + db, seq_len=train.seq_len + dl)
    assert _reserved(m, more) >= _reserved(m, train)
