"""What matplotlib actually draws: bar heights, cells and line points read back from the artists, in GiB."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("matplotlib")

from vramledger.ledger import Category, Phase, TimelineSample  # noqa: E402
from vramledger.report.figures import (  # noqa: E402
    Figures,
    bill_figure,
    cliff_figure,
    remedies_figure,
    timeline_figure,
)
from vramledger.report.plots import draw_bill, draw_cliff_curves, draw_cliff_grid, render, style  # noqa: E402
from vramledger.units import GiB  # noqa: E402


def test_bill_bars_are_the_ledger(hand_ledger):
    with style():
        fig = draw_bill(bill_figure(hand_ledger))
    ax = fig.axes[0]
    tops: dict[float, float] = {}
    for bar in (b for container in ax.containers for b in container):
        if bar.get_fill():  # the peak outline is an unfilled bar on top of the stack
            x = round(bar.get_x() + bar.get_width() / 2, 6)
            tops[x] = max(tops.get(x, 0.0), bar.get_y() + bar.get_height())
    expected = [hand_ledger.device(p) / GiB for p in hand_ledger.phases]
    assert [tops[x] for x in sorted(tops)] == pytest.approx(expected)
    # the capacity and usable lines sit at 16 GiB and 0.92 × 16 GiB
    ys = sorted(line.get_ydata()[0] for line in ax.lines)
    assert ys == pytest.approx([16 * 0.92, 16.0], abs=1e-6)
    labels = [t.get_text() for t in ax.texts]
    assert f"{hand_ledger.device_total / GiB:.2f} GiB" in labels


def test_cliff_drawn_values(lora8b):
    model, train, gpu, ledger = lora8b
    d = cliff_figure(model, train, gpu=gpu, batches=(1, 2, 4), lengths=(1024, 2048))
    with style():
        grid = draw_cliff_grid(d)
        curves = draw_cliff_curves(d)
    image = grid.axes[0].images[0].get_array()
    usable = ledger.verdict.usable_bytes
    for i in range(len(d.lengths)):
        for j in range(len(d.batches)):
            assert image[i][j] == pytest.approx(d.device[i][j] / usable)  # colour = device total ÷ usable
    cell_texts = {t.get_text().split("\n")[0] for t in grid.axes[0].texts}
    assert f"{ledger.device_total / GiB:.1f}" in cell_texts
    a = curves.axes[0]
    est, guess = a.lines[0], a.lines[1]
    assert list(est.get_xdata()) == [1, 2, 4]
    assert list(est.get_ydata()) == pytest.approx([v / GiB for v in d.by_batch.device])
    assert list(guess.get_ydata()) == pytest.approx([v / GiB for v in d.by_batch.linear_guess])


def test_render_all_present(hand_ledger):
    samples = tuple(
        TimelineSample(index=i, phase=ph, live_bytes=b, by_category={Category.WEIGHTS: b}, op="op", module="m")
        for i, (ph, b) in enumerate([(Phase.FORWARD, GiB), (Phase.BACKWARD, 2 * GiB), (Phase.OPTIMIZER, GiB)])
    )
    traced = dataclasses.replace(hand_ledger, timeline=samples)
    figs = Figures(
        bill=bill_figure(traced),
        timeline=timeline_figure(traced),
        remedies=remedies_figure([("a", GiB, 1.0), ("b", 20 * GiB, 0.5)], traced),
    )
    out = render(figs, "png", dpi=40)
    assert [stem for stem, _, _ in out] == ["bill", "timeline", "remedies"]
    assert all(data.startswith(b"\x89PNG") for _, _, data in out)
