"""Drawing the figures with matplotlib (the optional extra ``report``): one function per figure, data from figures.py.

No pyplot and no global state: each function builds a ``matplotlib.figure.Figure`` and returns it, and the
style lives in ``style()``, a context manager around ``matplotlib.rc_context``. Units are GiB (2**30 bytes) on
every axis. Colours: Paul Tol's "muted" qualitative scheme (designed to stay distinct under the common forms of
colour blindness: P. Tol, "Colour Schemes", SRON technical note SRON/EPS/TN/09-002, 2021), with overhead
lines (allocator reserve, CUDA context) in greys and hatched so that they read as "not your tensors".
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from vramledger.errors import VramledgerError
from vramledger.ledger import Category
from vramledger.report.figures import BillFigure, CliffFigure, Curve, Figures, RemedyFigure, TimelineFigure
from vramledger.units import GiB

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# Tol "muted" (rose, indigo, sand, green, cyan, wine, teal, olive, purple) + Tol's medium-contrast blue; greys for
# the overhead lines. Ordered so that neighbours in the stack differ in lightness as well as hue.
COLORS: dict[Category, str] = {
    Category.WEIGHTS: "#332288",
    Category.MASTER_WEIGHTS: "#88CCEE",
    Category.GRADIENTS: "#44AA99",
    Category.OPTIMIZER_STATE: "#117733",
    Category.ACTIVATIONS: "#DDCC77",
    Category.ATTENTION_SCORES: "#999933",
    Category.LOGITS_LOSS: "#CC6677",
    Category.KV_CACHE: "#882255",
    Category.TEMPORARIES: "#AA4499",
    Category.WORKSPACE: "#6699CC",
    Category.ALLOCATOR_RESERVE: "#DDDDDD",
    Category.CUDA_CONTEXT: "#888888",
    Category.MANAGED_MEMORY: "#BBBBBB",
    Category.NCCL: "#666666",
}
HATCH: dict[Category, str] = {
    Category.ALLOCATOR_RESERVE: "///",
    Category.CUDA_CONTEXT: "xx",
    Category.MANAGED_MEMORY: "..",
    Category.NCCL: "\\\\",
}
INK = "#222222"
CAPACITY = "#000000"
USABLE = "#BB5566"  # Tol high-contrast red: the line you must stay under
FITS, MISSES = "#004488", "#BB5566"  # Tol high-contrast blue / red, also told apart by marker shape


def require_matplotlib() -> Any:
    """Import matplotlib or raise the one-line error that names the extra to install."""
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise VramledgerError(
            "figures need matplotlib: pip install 'vramledger[report]' (or pip install matplotlib)"
        ) from exc
    return matplotlib


@contextlib.contextmanager
def style() -> Iterator[None]:
    """The house style for every figure (restored on exit)."""
    mpl = require_matplotlib()
    rc = {
        "font.family": "sans-serif",
        "font.sans-serif": ["DejaVu Sans", "Liberation Sans", "Arial", "Helvetica"],
        "font.size": 10,
        "axes.titlesize": 12,
        "axes.titleweight": "bold",
        "axes.labelsize": 10,
        "axes.spines.top": False,
        "axes.spines.right": False,
        "axes.edgecolor": "#555555",
        "axes.grid": True,
        "axes.axisbelow": True,
        "grid.color": "#E6E6E6",
        "grid.linewidth": 0.8,
        "legend.frameon": False,
        "legend.fontsize": 9,
        "hatch.linewidth": 0.6,
        "svg.fonttype": "none",  # text stays text in SVG: small files, selectable, sharp (see docs/report.md)
        "svg.hashsalt": "vramledger",  # deterministic ids, so the same ledger gives the same HTML
    }
    with mpl.rc_context(rc):
        yield


def _g(n: int | float) -> float:
    return n / GiB


def _new(width: float, height: float, ncols: int = 1) -> tuple[Figure, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    return fig, fig.subplots(1, ncols)


def _gpu_lines(
    ax: Axes, capacity: int | None, usable: int | None, gpu: str | None, *, right_labels: bool = True
) -> None:
    """Capacity (solid black) and usable (dashed red) lines, with the headroom between them shaded."""
    if capacity is None or usable is None:
        return
    ax.axhspan(_g(usable), _g(capacity), color=USABLE, alpha=0.10, lw=0, zorder=0)
    ax.axhline(_g(capacity), color=CAPACITY, lw=1.8, zorder=5)
    ax.axhline(_g(usable), color=USABLE, lw=1.8, ls=(0, (6, 3)), zorder=5)
    if right_labels:
        box = {"boxstyle": "square,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85}
        trans = ax.get_yaxis_transform()
        ax.text(
            0.995,
            _g(capacity),
            f"{gpu or 'GPU'}: capacity {_g(capacity):.2f} GiB",
            transform=trans,
            va="bottom",
            ha="right",
            fontsize=8.5,
            color=CAPACITY,
            bbox=box,
            zorder=8,
        )
        ax.text(
            0.995,
            _g(usable),
            f"usable {_g(usable):.2f} GiB (keeping {1 - usable / capacity:.0%} free)",
            transform=trans,
            va="top",
            ha="right",
            fontsize=8.5,
            color=USABLE,
            fontweight="bold",
            bbox=box,
            zorder=8,
        )


# -- the bill ----------------------------------------------------------------------------------------------------
def draw_bill(d: BillFigure) -> Figure:
    fig, ax = _new(9.6, 5.4)
    x = list(range(len(d.phases)))
    bottom = [0.0] * len(x)
    for cat, values in d.segments:
        heights = [_g(v) for v in values]
        ax.bar(
            x,
            heights,
            bottom=bottom,
            width=0.62,
            color=COLORS[cat],
            hatch=HATCH.get(cat),
            edgecolor="white" if cat not in HATCH else "#666666",
            linewidth=0.6,
            label=cat.display,
            zorder=3,
        )
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    p = d.peak_index
    # the peak: a heavy outline around its bar and its total in bold
    ax.bar([p], [_g(d.device[p])], width=0.62, fill=False, edgecolor=INK, linewidth=2.4, zorder=6)
    top = max([*d.device, d.capacity_bytes or 0])
    for i, total in enumerate(d.device):
        ax.text(
            i,
            _g(total) + _g(top) * 0.012,
            f"{_g(total):.2f} GiB",
            ha="center",
            va="bottom",
            zorder=7,
            fontsize=10 if i == p else 9,
            fontweight="bold" if i == p else "normal",
            color=INK,
        )
    _gpu_lines(ax, d.capacity_bytes, d.usable_bytes, d.gpu)
    ax.set_xticks(x, [ph.value + ("\n▲ peak" if i == p else "") for i, ph in enumerate(d.phases)])
    for i, lab in enumerate(ax.get_xticklabels()):
        if i == p:
            lab.set_fontweight("bold")
    ax.set_ylim(0, _g(top) * 1.12)
    ax.set_ylabel("GiB on the device (stacked by category)")
    ax.grid(axis="x", visible=False)
    ax.set_title(d.title, loc="left")
    if d.peak_moment:
        ax.text(
            0.0,
            1.0,
            f"peak in {d.peak_phase.value}: {d.peak_moment}",
            transform=ax.transAxes,
            fontsize=8.5,
            color="#444444",
            va="bottom",
            ha="left",
        )
        ax.set_title(d.title + "\n", loc="left")
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(
        handles[::-1],
        labels[::-1],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        title="top of stack first",
        title_fontsize=8.5,
    )
    return fig


# -- the cliff ---------------------------------------------------------------------------------------------------
def draw_cliff_grid(d: CliffFigure) -> Figure:
    """Heatmap of device totals; OOM cells hatched; the frontier a heavy line; the current setting outlined."""
    from matplotlib.patches import Rectangle

    fig, ax = _new(9.6, 5.6)
    vals = [[_g(v) for v in row] for row in d.device]
    if d.usable_bytes is not None:
        # colour by how far each cell is from the usable memory, on a log scale centred on "just fits":
        # blues fit, reds do not (a diverging map that stays readable under red-green colour blindness)
        from matplotlib.colors import LogNorm

        ratio = [[v / _g(d.usable_bytes) for v in row] for row in vals]
        im = ax.imshow(ratio, origin="lower", aspect="auto", cmap="RdBu_r", norm=LogNorm(vmin=0.25, vmax=4.0), zorder=1)
        cb = fig.colorbar(im, ax=ax, pad=0.02, fraction=0.05, extend="both")
        cb.set_ticks([0.25, 0.5, 1, 2, 4], labels=["×¼", "×½", "×1 (usable)", "×2", "×4"])
        cb.minorticks_off()
        cb.set_label("device total ÷ usable memory")
        shade = [[abs(math.log2(r)) > 1.0 for r in row] for row in ratio]
    else:
        from matplotlib.colors import LogNorm

        im = ax.imshow(vals, origin="lower", aspect="auto", cmap="viridis", norm=LogNorm(), zorder=1)
        cb = fig.colorbar(im, ax=ax, pad=0.02, fraction=0.05)
        cb.set_label("device total (GiB)")
        lo, hi = math.log(min(min(r) for r in vals)), math.log(max(max(r) for r in vals))
        shade = [[(math.log(v) - lo) / ((hi - lo) or 1) < 0.6 for v in row] for row in vals]
    ax.grid(False)
    for i, row in enumerate(vals):
        for j, v in enumerate(row):
            fits = d.fits(i, j)
            ax.text(
                j,
                i,
                f"{v:.1f}" + ("" if fits is not False else "\nOOM"),
                ha="center",
                va="center",
                fontsize=8.5,
                color="white" if shade[i][j] else INK,
                fontweight="bold" if fits else "normal",
                zorder=3,
            )
    # frontier: the boundary between fitting and not-fitting cells (a staircase along the cell edges)
    if d.usable_bytes is not None:
        for i in range(len(d.lengths)):
            for j in range(len(d.batches)):
                if not d.fits(i, j):
                    continue
                if j + 1 == len(d.batches) or not d.fits(i, j + 1):
                    ax.plot([j + 0.5, j + 0.5], [i - 0.5, i + 0.5], color=INK, lw=3.2, zorder=4)
                if i + 1 == len(d.lengths) or not d.fits(i + 1, j):
                    ax.plot([j - 0.5, j + 0.5], [i + 0.5, i + 0.5], color=INK, lw=3.2, zorder=4)
    ci, cj = d.lengths.index(d.current_length), d.batches.index(d.current_batch)
    for color, lw, ls in (("white", 5.0, "-"), (INK, 2.2, (0, (3, 2)))):
        ax.add_patch(
            Rectangle(
                (cj - 0.46, ci - 0.46), 0.92, 0.92, fill=False, edgecolor=color, linewidth=lw, linestyle=ls, zorder=5
            )
        )
    ax.set_xticks(range(len(d.batches)), [str(b) for b in d.batches])
    ax.set_yticks(range(len(d.lengths)), [str(L) for L in d.lengths])
    ax.set_xlabel("micro-batch (sequences per forward)")
    ax.set_ylabel("sequence length (tokens)")
    if d.usable_bytes is not None:
        best = dict(d.frontier)
        sec = ax.secondary_yaxis("right")
        sec.set_yticks(
            range(len(d.lengths)), [f"max batch {best[L]}" if L in best else "batch 1: OOM" for L in d.lengths]
        )
        sec.tick_params(length=0, labelsize=8.5)
    sub = (
        f"black line: OOM frontier for {d.gpu} (usable {_g(d.usable_bytes):.2f} GiB); cells in GiB; "
        if d.usable_bytes is not None
        else ""
    )
    ax.set_title(d.title + "\n", loc="left")
    ax.text(
        0.0,
        1.0,
        sub + "dashed box: your setting",
        transform=ax.transAxes,
        fontsize=8.5,
        color="#444444",
        va="bottom",
        ha="left",
    )
    return fig


def _draw_curve(ax: Axes, c: Curve, d: CliffFigure, xlabel: str, current: int) -> None:
    ax.plot(c.x, [_g(v) for v in c.device], marker="o", color=FITS, lw=2.2, label="estimated device total", zorder=4)
    ax.plot(
        c.x,
        [_g(v) for v in c.linear_guess],
        ls=(0, (5, 3)),
        color="#EE7733",
        lw=1.8,
        marker="s",
        ms=4,
        label=f"affine guess from {c.x[0]} and {c.x[1] if len(c.x) > 1 else c.x[0]}: fixed + per-unit cost",
        zorder=3,
    )
    k = c.x.index(current)
    ax.plot(
        [current],
        [_g(c.device[k])],
        marker="o",
        ms=11,
        mfc="none",
        mec=INK,
        mew=2,
        zorder=5,
        ls="none",
        label=f"your setting ({_g(c.device[k]):.2f} GiB)",
    )
    _gpu_lines(ax, d.capacity_bytes, d.usable_bytes, d.gpu, right_labels=False)
    if d.usable_bytes is not None:
        ax.plot([], [], color=CAPACITY, lw=1.8, label=f"capacity {_g(d.capacity_bytes or 0):.2f} GiB")
        ax.plot([], [], color=USABLE, lw=1.8, ls=(0, (6, 3)), label=f"usable {_g(d.usable_bytes):.2f} GiB")
    # linear axes, zoomed on the region that decides the fit: from the smallest setting's memory to just above
    # the capacity (log axes squashed the last GiB before the cliff, where the guess and the curve part)
    values = [*c.device, *c.linear_guess] + ([d.capacity_bytes] if d.capacity_bytes else [])
    lo, hi = _g(min(values)), _g(max(values))
    if d.capacity_bytes:
        hi = min(hi, max(_g(d.capacity_bytes) * 1.5, _g(c.device[k]) * 1.1))
    last = next((i for i, v in enumerate(c.device) if _g(v) > hi), len(c.x) - 1)
    shown = [x for x in c.x[: last + 1]]
    span = shown[-1] - shown[0] or 1
    ax.set_xlim(shown[0] - 0.04 * span, shown[-1] + 0.04 * span)
    ax.set_ylim(max(0.0, lo - 0.08 * (hi - lo)), hi + 0.12 * (hi - lo))
    ax.set_xticks(shown, [str(v) for v in shown])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("GiB on the device")
    ax.legend(loc="upper left", fontsize=8.5)


def draw_cliff_curves(d: CliffFigure) -> Figure:
    fig, (a, b) = _new(11.0, 5.0, ncols=2)
    _draw_curve(a, d.by_batch, d, "micro-batch", d.current_batch)
    a.set_title(f"Memory against micro-batch (length {d.by_batch.fixed})", loc="left", fontsize=11)
    _draw_curve(b, d.by_length, d, "sequence length (tokens)", d.current_length)
    b.set_title(f"Memory against length (micro-batch {d.by_length.fixed})", loc="left", fontsize=11)
    fig.suptitle(
        d.title.replace("OOM cliff", "Estimate against the affine guess"),
        x=0.01,
        ha="left",
        fontweight="bold",
        fontsize=12,
    )
    return fig


# -- the timeline ------------------------------------------------------------------------------------------------
_PHASE_SHADES = ("#F4F4F4", "#FFFFFF")


def draw_timeline(d: TimelineFigure) -> Figure:
    fig, ax = _new(11.0, 5.0)
    top = max(d.live)
    for k, (phase, start, end) in enumerate(d.spans):
        ax.axvspan(start - 0.5, end + 0.5, color=_PHASE_SHADES[k % 2], zorder=0, lw=0)
        ax.text(
            (start + end) / 2,
            1.005,
            phase.value,
            ha="center",
            va="bottom",
            fontsize=9.5,
            color="#444444",
            transform=ax.get_xaxis_transform(),
        )
        if k:
            ax.axvline(start - 0.5, color="#AAAAAA", lw=0.8, zorder=1)
    ax.stackplot(
        d.index,
        *[[_g(v) for v in vals] for _, vals in d.layers],
        labels=[c.display for c, _ in d.layers],
        colors=[COLORS[c] for c, _ in d.layers],
        zorder=2,
        step=None,
    )
    ax.plot(d.index, [_g(v) for v in d.live], color=INK, lw=1.0, label="live (total)", zorder=3)
    ax.plot([d.peak_index], [_g(d.peak_bytes)], marker="v", ms=10, color=INK, zorder=6)
    where = " · ".join(s for s in (d.peak_op, d.peak_module) if s)
    ax.annotate(
        f"peak {_g(d.peak_bytes):.2f} GiB" + (f"\n{where}" if where else ""),
        xy=(d.peak_index, _g(d.peak_bytes)),
        xytext=(0, 14),
        textcoords="offset points",
        ha="center",
        va="bottom",
        fontsize=9,
        fontweight="bold",
        zorder=7,
        bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": "#999999", "alpha": 0.9},
    )
    _gpu_lines(ax, d.capacity_bytes, d.usable_bytes, d.gpu)
    ax.set_xlim(d.index[0] - 0.5, d.index[-1] + 0.5)
    ax.set_ylim(0, _g(max(top, d.capacity_bytes or 0)) * 1.2)
    ax.set_xlabel("event (allocation or free, in program order)")
    ax.set_ylabel("GiB allocated (live tensors)")
    ax.set_title(d.title + "\n", loc="left")
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


# -- remedies ----------------------------------------------------------------------------------------------------
def _place_numbers(ax: Axes, xy: list[tuple[float, float]]) -> None:
    """Number each point, choosing for each label the first of a few offsets (points) whose box overlaps no
    label or point placed before it: a greedy placement in display space, enough for a dozen remedies."""
    offsets = (
        (6, 3),
        (-14, 3),
        (6, -12),
        (-14, -12),
        (-4, 9),
        (-4, -19),
        (14, -4),
        (-24, -4),
        (20, 8),
        (-30, 8),
        (20, -16),
        (-30, -16),
    )
    ax.figure.canvas.draw()  # run the layout first: the transforms below must be the saved figure's
    to_px = ax.transData.transform
    scale = ax.figure.dpi / 72.0
    dots = [to_px(p) for p in xy]
    boxes: list[tuple[float, float, float, float]] = [(x - 5, y - 5, x + 5, y + 5) for x, y in dots]
    for i, (pt, (x, y)) in enumerate(zip(xy, dots, strict=True), 1):
        w, h = (7 + 6 * len(str(i))) * scale, 10 * scale
        choice = offsets[0]
        for dx, dy in offsets:
            bx, by = x + dx * scale, y + dy * scale
            box = (bx, by, bx + w, by + h)
            if not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in boxes):
                choice = (dx, dy)
                break
        bx, by = x + choice[0] * scale, y + choice[1] * scale
        boxes.append((bx, by, bx + w, by + h))
        ax.annotate(
            str(i), pt, xytext=choice, textcoords="offset points", fontsize=8.5, fontweight="bold", color=INK, zorder=9
        )


def draw_remedies(d: RemedyFigure) -> Figure:
    import textwrap

    fig, ax = _new(12.0, 5.2)
    # each point carries a number and the key on the right names it: labels written beside the points overlapped
    # wherever remedies land close together (they often do: several save memory at almost no time)
    key: list[str] = []
    for i, p in enumerate(d.points, 1):
        ok = p.fits is not False
        ax.plot(
            [p.step_seconds],
            [_g(p.device_bytes)],
            ls="none",
            marker="o" if ok else "X",
            ms=9,
            color=FITS if ok else MISSES,
            zorder=4,
        )
        key += textwrap.wrap(f"{i}  {p.label}", 46, subsequent_indent="    ")
    ax.text(
        1.02,
        1.0,
        "\n".join(key),
        transform=ax.transAxes,
        va="top",
        ha="left",
        fontsize=8.5,
        color=INK,
        linespacing=1.35,
    )
    _gpu_lines(ax, d.capacity_bytes, d.usable_bytes, d.gpu)
    ax.plot([], [], ls="none", marker="o", color=FITS, label="fits")
    if any(p.fits is False for p in d.points):
        ax.plot([], [], ls="none", marker="X", color=MISSES, label="does not fit")
    top = max([p.device_bytes for p in d.points] + [d.capacity_bytes or 0])
    ax.set_ylim(0, _g(top) * 1.12)
    ax.set_xlim(0, max(p.step_seconds for p in d.points) * 1.25 or 1.0)
    _place_numbers(ax, [(p.step_seconds, _g(p.device_bytes)) for p in d.points])
    ax.set_xlabel("step time (seconds per optimizer step)")
    ax.set_ylabel("GiB on the device")
    ax.set_title(d.title, loc="left")
    ax.legend(loc="lower right")
    return fig


def render(figs: Figures, fmt: str, *, dpi: int = 110) -> list[tuple[str, str, bytes]]:
    """(file stem, caption, image bytes in ``fmt``: "svg" or "png") for every figure present, in display order.

    Drawing and saving both happen inside ``style()``: matplotlib reads ``svg.*`` settings at save time.
    """
    import io

    out: list[tuple[str, str, bytes]] = []
    with style():
        drawn = [
            (
                "bill",
                "The bill: bytes per category at each phase's peak, with the GPU's capacity and usable memory.",
                lambda: draw_bill(figs.bill),
            )
        ]
        if figs.cliff is not None:
            cliff = figs.cliff
            drawn.append(
                (
                    "cliff_grid",
                    "The cliff: device total over micro-batch × sequence length, and where it stops fitting.",
                    lambda: draw_cliff_grid(cliff),
                )
            )
            drawn.append(
                (
                    "cliff_curves",
                    "Memory against batch and against length, beside the affine guess "
                    "(a fixed cost plus a cost per unit) from the two smallest settings.",
                    lambda: draw_cliff_curves(cliff),
                )
            )
        if figs.timeline is not None:
            tl = figs.timeline
            drawn.append(
                (
                    "timeline",
                    "Live bytes across the traced step, by category, with the peak's op and module.",
                    lambda: draw_timeline(tl),
                )
            )
        if figs.remedies is not None:
            rem = figs.remedies
            drawn.append(("remedies", "Each remedy's device memory against its step time.", lambda: draw_remedies(rem)))
        for stem, caption, draw in drawn:
            buf = io.BytesIO()
            fig = draw()
            meta = {"Software": "vramledger"} if fmt == "png" else {"Date": None, "Creator": "vramledger"}
            fig.savefig(buf, format=fmt, dpi=dpi, metadata=meta)
            out.append((stem, caption, buf.getvalue()))
    return out
