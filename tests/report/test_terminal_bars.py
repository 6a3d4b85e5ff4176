"""Text bars of the bill: lengths to scale (derived by hand), marks, legend, 100 columns, no colour codes."""

from __future__ import annotations

from vramledger.ledger import Category, Ledger, Phase
from vramledger.report.terminal_bars import GLYPHS, render_bars

from .conftest import item


def _simple() -> Ledger:
    # load: 8 GiB weights; forward: 8 GiB weights + 4 GiB activations. No GPU, no overhead lines.
    from vramledger.units import GiB

    items = (
        item(Category.WEIGHTS, Phase.LOAD, 8 * GiB),
        item(Category.WEIGHTS, Phase.FORWARD, 8 * GiB),
        item(Category.ACTIVATIONS, Phase.FORWARD, 4 * GiB),
    )
    return Ledger(model="m", params=1, trainable_params=1, items=items, engine="test")


def test_lengths_to_scale_by_hand():
    # name column = len("forward") + 2 = 9, totals column 11, 2 spare: width 83 leaves a 61-column bar whose
    # last column is the top (12 GiB), i.e. 60 columns for 12 GiB = 5 columns per GiB.
    out = render_bars(_simple(), width=83).splitlines()
    load, forward = out[1], out[2]
    assert load.count(GLYPHS[Category.WEIGHTS]) == 40
    assert forward.count(GLYPHS[Category.WEIGHTS]) == 40 and forward.count(GLYPHS[Category.ACTIVATIONS]) == 20
    assert forward.startswith("forward* ")  # the peak is starred
    assert load.endswith("8.00 GiB") and forward.endswith("12.00 GiB")
    assert "█ weights" in out[-1] and "░ activations (saved)" in out[-1]


def test_gpu_marks_and_width(hand_ledger, lora8b):
    out = render_bars(hand_ledger)
    lines = out.splitlines()
    assert all(len(line) <= 100 for line in lines)
    assert "| usable 14.72 GiB (8% headroom)" in out and "] capacity 16.00 GiB" in out
    # the usable mark sits in the same column on every bar row
    cols = {line.index("|") for line in lines[1:5]}
    assert len(cols) == 1
    ledger = lora8b[3]
    big = render_bars(ledger)
    assert all(len(line) <= 100 for line in big.splitlines())
    assert "\x1b" not in big  # no colour codes, ever
    assert "backward*" in big  # the 8B example peaks in the backward pass


def test_ascii_only(hand_ledger):
    out = render_bars(hand_ledger, ascii_only=True)
    assert out.isascii()
