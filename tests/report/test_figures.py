"""The figures' data: the numbers plotted are the ledger's numbers (hand-derived or re-estimated independently)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from vramledger.analytic import estimate
from vramledger.errors import VramledgerError
from vramledger.ledger import Category, Phase, TimelineSample
from vramledger.report.figures import (
    RemedyResult,
    bill_figure,
    cliff_figure,
    remedies_figure,
    timeline_figure,
)
from vramledger.units import GiB, MiB

C, P = Category, Phase


def test_bill_hand_ledger(hand_ledger):
    d = bill_figure(hand_ledger)
    assert d.phases == (P.LOAD, P.FORWARD, P.BACKWARD, P.OPTIMIZER)
    seg = dict(d.segments)
    # bottom-up in Category order, every category that has bytes somewhere
    assert [c for c, _ in d.segments] == [
        C.WEIGHTS,
        C.GRADIENTS,
        C.OPTIMIZER_STATE,
        C.ACTIVATIONS,
        C.TEMPORARIES,
        C.ALLOCATOR_RESERVE,
        C.CUDA_CONTEXT,
    ]
    assert seg[C.WEIGHTS] == (8 * GiB,) * 4
    assert seg[C.ACTIVATIONS] == (0, 4 * GiB, 2 * GiB, 0)
    assert seg[C.GRADIENTS] == (0, 0, GiB, GiB)
    assert seg[C.ALLOCATOR_RESERVE] == (0, 512 * MiB, 512 * MiB, 0)
    expected_device = (8 * GiB + 500 * MiB, 12 * GiB + 1012 * MiB, 11 * GiB + 1012 * MiB, 11 * GiB + 1012 * MiB)
    assert d.device == expected_device
    # the stack's top is the bar's height
    assert tuple(sum(v[i] for _, v in d.segments) for i in range(4)) == expected_device
    assert d.allocated == (8 * GiB, 12 * GiB, 11 * GiB, 11 * GiB + 512 * MiB)
    assert d.peak_phase is P.FORWARD and d.peak_index == 1
    assert d.capacity_bytes == 16 * GiB
    assert d.usable_bytes == int(16 * GiB * 0.92)
    assert d.gpu == "Test GPU 16GiB"


def test_bill_matches_estimate(lora8b):
    _, _, gpu, ledger = lora8b
    d = bill_figure(ledger)
    for i, p in enumerate(d.phases):
        for cat, values in d.segments:
            assert values[i] == ledger.bytes_of(cat, p)
        assert sum(v[i] for _, v in d.segments) == ledger.device(p)
    assert max(d.device) == ledger.device_total == d.device[d.peak_index]
    assert d.capacity_bytes == gpu.memory_bytes


def test_cliff_cells_are_estimates(lora8b):
    model, train, gpu, ledger = lora8b
    d = cliff_figure(model, train, gpu=gpu, headroom=0.08, batches=(1, 2, 8), lengths=(512, 4096))
    # the current setting joins the grid
    assert d.batches == (1, 2, 4, 8) and d.lengths == (512, 2048, 4096)
    assert d.device[d.lengths.index(2048)][d.batches.index(4)] == ledger.device_total
    for i, L in enumerate(d.lengths):
        for j, b in enumerate(d.batches):
            again = estimate(model, dataclasses.replace(train, micro_batch=b, seq_len=L), gpu=gpu)
            assert d.device[i][j] == again.device_total
            assert d.fits(i, j) == again.verdict.fits
    assert d.usable_bytes == ledger.verdict.usable_bytes


def test_cliff_frontier_is_the_edge(lora8b):
    model, train, gpu, _ = lora8b
    d = cliff_figure(model, train, gpu=gpu, batches=(1, 2, 4, 8, 16), lengths=(512, 1024, 2048, 8192))
    assert d.frontier, "an 8B LoRA at 512 tokens fits a 24 GiB card at batch 1"
    for L, b in d.frontier:
        at = estimate(model, dataclasses.replace(train, micro_batch=b, seq_len=L), gpu=gpu)
        above = estimate(model, dataclasses.replace(train, micro_batch=b + 1, seq_len=L), gpu=gpu)
        assert at.verdict.fits and not above.verdict.fits, (L, b)
    # lengths missing from the frontier do not fit even at batch 1
    for L in set(d.lengths) - {L for L, _ in d.frontier}:
        assert not estimate(model, dataclasses.replace(train, micro_batch=1, seq_len=L), gpu=gpu).verdict.fits


def test_cliff_curves_and_affine_guess(lora8b):
    model, train, gpu, _ = lora8b
    d = cliff_figure(model, train, gpu=gpu, batches=(1, 2, 4, 8), lengths=(1024, 2048, 4096))
    i = d.lengths.index(2048)
    assert d.by_batch.x == (1, 2, 4, 8) and d.by_batch.device == d.device[i] and d.by_batch.fixed == 2048
    m1, m2 = d.device[i][0], d.device[i][1]
    # the affine guess through batch 1 and 2: fixed cost m1 - (m2 - m1), plus (m2 - m1) per sequence
    assert d.by_batch.linear_guess == (m1, m2, m1 + 3 * (m2 - m1), m1 + 7 * (m2 - m1))
    j = d.batches.index(4)
    assert d.by_length.device == tuple(row[j] for row in d.device)
    m0, n0 = d.by_length.device[0], d.by_length.device[1]
    assert d.by_length.linear_guess == (m0, n0, m0 + 3 * (n0 - m0))  # lengths 1024, 2048, 4096


def test_cliff_without_gpu(lora8b):
    model, train, _, _ = lora8b
    d = cliff_figure(model, train, batches=(1, 2), lengths=(1024,))
    assert d.usable_bytes is None and d.frontier == () and d.fits(0, 0) is None


def test_cliff_rejects_bad_grid(lora8b):
    model, train, _, _ = lora8b
    with pytest.raises(VramledgerError, match="positive"):
        cliff_figure(model, train, batches=(0, 2))


def _sample(i, phase, w, a, op="", module=""):
    return TimelineSample(
        index=i, phase=phase, live_bytes=w + a, by_category={C.WEIGHTS: w, C.ACTIVATIONS: a}, op=op, module=module
    )


def test_timeline(hand_ledger):
    assert timeline_figure(hand_ledger) is None  # no trace, no figure
    g = GiB
    samples = (
        _sample(0, P.FORWARD, 8 * g, 0),
        _sample(1, P.FORWARD, 8 * g, 2 * g),
        _sample(2, P.FORWARD, 8 * g, 4 * g, "aten::mm", "layers.0.mlp"),
        _sample(3, P.BACKWARD, 8 * g, 4 * g, "aten::mm", "layers.0.mlp"),  # ties go to the first
        _sample(4, P.BACKWARD, 8 * g, 1 * g),
        _sample(5, P.OPTIMIZER, 8 * g, 0),
    )
    d = timeline_figure(dataclasses.replace(hand_ledger, timeline=samples))
    assert d.index == (0, 1, 2, 3, 4, 5)
    assert d.live == (8 * g, 10 * g, 12 * g, 12 * g, 9 * g, 8 * g)
    assert dict(d.layers) == {C.WEIGHTS: (8 * g,) * 6, C.ACTIVATIONS: (0, 2 * g, 4 * g, 4 * g, g, 0)}
    assert d.spans == ((P.FORWARD, 0, 2), (P.BACKWARD, 3, 4), (P.OPTIMIZER, 5, 5))
    assert (d.peak_index, d.peak_bytes, d.peak_op, d.peak_module) == (2, 12 * g, "aten::mm", "layers.0.mlp")
    assert d.capacity_bytes == 16 * GiB


def test_remedies(hand_ledger):
    assert remedies_figure(None, hand_ledger) is None
    assert remedies_figure([], hand_ledger) is None
    usable = int(16 * GiB * 0.92)
    planned = SimpleNamespace(label="grad ckpt", device_bytes=10 * GiB, step_seconds=1.3, extra="ignored")
    assert isinstance(planned, RemedyResult)
    d = remedies_figure([("baseline", 17 * GiB, 1.0), planned, ("edge", usable, 2.0)], hand_ledger)
    assert [(p.label, p.device_bytes, p.step_seconds, p.fits) for p in d.points] == [
        ("baseline", 17 * GiB, 1.0, False),
        ("grad ckpt", 10 * GiB, 1.3, True),
        ("edge", usable, 2.0, True),  # exactly the usable memory still fits (as make_verdict decides)
    ]
    assert d.usable_bytes == usable
    with pytest.raises(VramledgerError, match="non-negative"):
        remedies_figure([("bad", -1, 1.0)])
