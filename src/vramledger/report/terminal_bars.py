"""The bill as text bars: one bar per phase, one fill character per category, the usable and capacity marks.

No colour at all, so it reads the same through pipes and under NO_COLOR; the characters alone tell the
categories apart. Fits ``width`` columns (100 by default). ``ascii_only`` swaps the block characters for
plain ASCII, for terminals whose encoding cannot print them.
"""

from __future__ import annotations

from vramledger.ledger import Category, Ledger
from vramledger.report.figures import BillFigure, bill_figure
from vramledger.units import fmt_bytes

# One fill per category; the dense blocks for what the user's tensors hold, light ones for overhead.
GLYPHS: dict[Category, str] = {
    Category.WEIGHTS: "█",
    Category.MASTER_WEIGHTS: "▓",
    Category.GRADIENTS: "▒",
    Category.OPTIMIZER_STATE: "#",
    Category.ACTIVATIONS: "░",
    Category.ATTENTION_SCORES: "%",
    Category.LOGITS_LOSS: "=",
    Category.KV_CACHE: "K",
    Category.TEMPORARIES: "~",
    Category.WORKSPACE: "w",
    Category.ALLOCATOR_RESERVE: ":",
    Category.CUDA_CONTEXT: ".",
    Category.MANAGED_MEMORY: "p",
    Category.NCCL: "n",
}
ASCII_GLYPHS: dict[Category, str] = GLYPHS | {
    Category.WEIGHTS: "W",
    Category.MASTER_WEIGHTS: "M",
    Category.GRADIENTS: "G",
    Category.ACTIVATIONS: "a",
}
USABLE_MARK, CAPACITY_MARK = "|", "]"
"""Not used as category glyphs, so a mark drawn over a bar cannot be mistaken for a line of the bill."""


def _segments(values: list[tuple[str, int]], scale: float) -> str:
    """Characters for stacked values, rounding the running total (not each part) so that the bar's length is
    exactly its total to scale; a line smaller than half a character gets none (the table still lists it)."""
    out, total, drawn = [], 0, 0
    for glyph, v in values:
        total += v
        end = round(total * scale)
        out.append(glyph * (end - drawn))
        drawn = end
    return "".join(out)


def render_bars(ledger: Ledger, *, width: int = 100, ascii_only: bool = False) -> str:
    """Text bars of the bill (device total per phase), with a legend of the characters used."""
    return render_bill_bars(bill_figure(ledger), width=width, ascii_only=ascii_only)


def render_bill_bars(d: BillFigure, *, width: int = 100, ascii_only: bool = False) -> str:
    glyphs = ASCII_GLYPHS if ascii_only else GLYPHS
    name_w = max(len(p.value) for p in d.phases) + 2
    total_w = 11  # " 31.41 GiB"
    bar_w = max(20, width - name_w - total_w - 2)
    top = max([*d.device, d.capacity_bytes or 0])
    scale = (bar_w - 1) / top if top else 0.0
    lines = ["the bill: device memory at each phase's peak" + ("" if d.gpu is None else f" on {d.gpu}")]
    marks: dict[int, str] = {}
    if d.usable_bytes is not None and d.capacity_bytes is not None:
        marks[round(d.usable_bytes * scale)] = USABLE_MARK
        marks[round(d.capacity_bytes * scale)] = CAPACITY_MARK
    bars = [_segments([(glyphs[c], vals[i]) for c, vals in d.segments], scale) for i in range(len(d.phases))]
    for i, phase in enumerate(d.phases):
        bar = bars[i]
        cells = list(bar.ljust(bar_w))
        for col, mark in marks.items():  # drawn across the bars too, so the cut is visible on every row
            if 0 <= col < bar_w:
                cells[col] = mark
        star = "*" if i == d.peak_index else " "
        name = f"{phase.value}{star}"
        lines.append(f"{name:<{name_w}}{''.join(cells)} {fmt_bytes(d.device[i]):>{total_w - 1}}")
    if marks:
        lines.append(
            f"{'':<{name_w}}{USABLE_MARK} usable {fmt_bytes(d.usable_bytes or 0)}"
            f" ({d.headroom_fraction or 0:.0%} headroom)   {CAPACITY_MARK} capacity {fmt_bytes(d.capacity_bytes or 0)}"
            f"   * peak"
        )
    shown = "".join(bars)
    legend = [f"{glyphs[c]} {c.display}" for c, _ in d.segments if glyphs[c] in shown]
    row = " " * name_w
    for item in legend:
        if len(row) + len(item) + 3 > width:
            lines.append(row.rstrip())
            row = " " * name_w
        row += item + "   "
    lines.append(row.rstrip())
    return "\n".join(lines)
