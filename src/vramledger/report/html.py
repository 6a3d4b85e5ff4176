"""One self-contained HTML page: the ledger table, the verdict, and the figures that apply, as inline SVG.

Self-contained means it opens with no network at all: no scripts, no fonts, no stylesheets or images from
anywhere; the CSS is inline, the figures are matplotlib SVG inlined into the page (text kept as text, system
fonts), and the page holds no ``http://`` or ``https://`` string at all (the SVG namespace declarations, the
DOCTYPE and the RDF metadata are stripped: the HTML parser puts inline ``<svg>`` in the SVG namespace by itself).
"""

from __future__ import annotations

import html
import re
from collections.abc import Mapping
from pathlib import Path

from vramledger.ledger import Basis, Category, Ledger
from vramledger.report.figures import Figures, bill_figure
from vramledger.report.verdict import verdict_sentence
from vramledger.units import fmt_bytes

_ID = re.compile(r'\bid="([^"]+)"')


def inline_svg(svg: str, prefix: str) -> str:
    """Make one matplotlib SVG document fit for inlining into HTML next to others.

    Drops the XML prolog, DOCTYPE, metadata and namespace declarations (all carry URLs, none is needed inline),
    and prefixes every id and every reference to it so that ids from different figures cannot collide
    (matplotlib names markers and clip paths by a hash of their content, so two figures share names).
    """
    svg = re.sub(r"<\?xml[^>]*\?>\s*", "", svg)
    svg = re.sub(r"<!DOCTYPE[^>]*>\s*", "", svg, flags=re.S)
    svg = re.sub(r"\s*<metadata>.*?</metadata>", "", svg, flags=re.S)
    svg = re.sub(r'\s+xmlns(?::\w+)?="[^"]*"', "", svg)
    ids = set(_ID.findall(svg))
    svg = _ID.sub(lambda m: f'id="{prefix}-{m.group(1)}"', svg)

    def ref(m: re.Match[str]) -> str:
        name = m.group(2)
        return f"{m.group(1)}#{prefix}-{name}" if name in ids else m.group(0)

    svg = re.sub(r'(url\(|href=")#([^")]+)', ref, svg)
    return svg.replace("<svg ", f'<svg role="img" aria-labelledby="{prefix}-caption" ', 1).strip()


_CSS = """
:root { color-scheme: light; --ink: #222; --muted: #666; --rule: #ddd; --bad: #BB5566; --good: #004488; }
* { box-sizing: border-box; }
body { font-family: system-ui, -apple-system, "Segoe UI", "DejaVu Sans", "Liberation Sans", Arial, sans-serif;
       color: var(--ink); margin: 0 auto; max-width: 1180px; padding: 24px 28px 64px; line-height: 1.45; }
h1 { font-size: 1.45rem; margin: 0 0 4px; }
h2 { font-size: 1.15rem; margin: 32px 0 8px; border-bottom: 1px solid var(--rule); padding-bottom: 4px; }
.sub { color: var(--muted); margin: 0 0 16px; }
.verdict { padding: 10px 14px; border-radius: 6px; font-weight: 600; margin: 12px 0; border-left: 6px solid; }
.verdict.fits { background: #E8F0F8; border-color: var(--good); }
.verdict.oom { background: #F8E8EC; border-color: var(--bad); }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; font-size: 0.92rem; }
th, td { padding: 4px 12px; text-align: right; border-bottom: 1px solid #eee; }
th:first-child, td:first-child { text-align: left; }
thead th { border-bottom: 2px solid var(--ink); }
td.peak, th.peak { background: #FFF4D6; font-weight: 600; }
tr.total td { border-top: 2px solid var(--ink); font-weight: 600; }
tr.overhead td { color: var(--muted); }
.swatch { display: inline-block; width: 0.9em; height: 0.9em; margin-right: 6px; vertical-align: -1px;
          border: 1px solid #999; }
figure.vl-figure { margin: 12px 0 28px; }
figure.vl-figure svg { display: block; width: 100%; height: auto; max-width: 1100px; }
figcaption { color: var(--muted); font-size: 0.9rem; margin-top: 4px; }
details { margin: 8px 0; }
.sources td { text-align: left; font-size: 0.85rem; vertical-align: top; }
.sources td.num { text-align: right; white-space: nowrap; }
ul.notes { padding-left: 20px; }
code { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 0.9em; }
"""


def _plain(value: object) -> str:
    """A setting as words for the page's header: scalars as they are, lists joined; mappings and objects (the
    trace's allocator replay, its module table) belong to the sections below, never a Python repr up here."""
    if isinstance(value, bool | int | float | str):
        return str(value)
    if isinstance(value, list | tuple) and all(isinstance(x, bool | int | float | str) for x in value):
        return ", ".join(str(x) for x in value)
    return ""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _cell(n: int) -> str:
    return fmt_bytes(n) if n else "–"


def ledger_table(ledger: Ledger) -> str:
    """The bill as an HTML table: categories × phases, the peak phase highlighted, totals below."""
    from vramledger.report.plots import COLORS

    phases = ledger.phases
    peak = ledger.peak_phase

    def cls(p: object) -> str:
        return ' class="peak"' if p is peak else ""

    rows = ['<table class="ledger"><thead><tr><th>line</th>']
    rows += [f"<th{cls(p)}>{_e(p.value)}{' ▲ peak' if p is peak else ''}</th>" for p in phases]
    rows.append("</tr></thead><tbody>")

    def row(label: str, values: list[int], tr: str = "", swatch: Category | None = None) -> None:
        sw = f'<span class="swatch" style="background:{COLORS[swatch]}"></span>' if swatch is not None else ""
        rows.append(f"<tr{tr}><td>{sw}{_e(label)}</td>")
        rows.extend(f"<td{cls(p)}>{_e(_cell(v))}</td>" for p, v in zip(phases, values, strict=True))
        rows.append("</tr>")

    for cat in ledger.categories():
        if cat.allocated:
            row(cat.display, [ledger.bytes_of(cat, p) for p in phases], swatch=cat)
    row("peak allocated", [ledger.allocated(p) for p in phases], ' class="total"')
    row(
        "+ " + Category.ALLOCATOR_RESERVE.display,
        [ledger.bytes_of(Category.ALLOCATOR_RESERVE, p) for p in phases],
        ' class="overhead"',
        Category.ALLOCATOR_RESERVE,
    )
    row("= peak reserved", [ledger.reserved(p) for p in phases])
    row(
        "+ " + Category.CUDA_CONTEXT.display,
        [ledger.bytes_of(Category.CUDA_CONTEXT, p) for p in phases],
        ' class="overhead"',
        Category.CUDA_CONTEXT,
    )
    if Category.NCCL in ledger.categories():
        row(
            "+ " + Category.NCCL.display,
            [ledger.bytes_of(Category.NCCL, p) for p in phases],
            ' class="overhead"',
            Category.NCCL,
        )
    if Category.MANAGED_MEMORY in ledger.categories():
        row(
            "+ " + Category.MANAGED_MEMORY.display,
            [ledger.bytes_of(Category.MANAGED_MEMORY, p) for p in phases],
            ' class="overhead"',
            Category.MANAGED_MEMORY,
        )
    row("= device total (nvidia-smi)", [ledger.device(p) for p in phases], ' class="total"')
    rows.append("</tbody></table>")
    return "".join(rows)


def _sources(ledger: Ledger) -> str:
    out = [
        "<details><summary>Every line, with its formula and source</summary>",
        '<table class="sources"><thead><tr><th>phase</th><th>category</th><th>bytes</th><th>what</th>'
        "<th>basis</th><th>source</th></tr></thead><tbody>",
    ]
    for i in ledger.items:
        out.append(
            f'<tr><td>{_e(i.phase.value)}</td><td>{_e(i.category.display)}</td><td class="num">'
            f"{_e(fmt_bytes(i.bytes))}</td><td>{_e(i.label)}</td><td>{_e(i.basis.value)}</td>"
            f"<td>{_e(i.source)}</td></tr>"
        )
    out.append("</tbody></table></details>")
    return "".join(out)


def _verdict(ledger: Ledger) -> str:
    v = ledger.verdict
    if v is None:
        return (
            '<div class="verdict fits">No GPU given: pass <code>--gpu</code> for a verdict and the capacity '
            "lines.</div>"
        )
    text = f"{verdict_sentence(v)} (device total {fmt_bytes(v.device_total_bytes)})"
    return f'<div class="verdict {"fits" if v.fits else "oom"}">{_e(text)}</div>'


def _allocator_replay(ledger: Ledger) -> list[str]:
    """A trace's allocator replay: the OOM point (if any) as a verdict line, then the replay in the terminal's
    words (``trace_text.render_allocator``, one home for that wording)."""
    from vramledger.report.trace_text import oom_sentence, render_allocator

    if ledger.engine != "trace":
        return []
    text = render_allocator(ledger)
    if not text:
        return []
    out = []
    given = ledger.settings.get("allocator")
    if isinstance(given, Mapping) and given.get("oom"):
        out.append(f'<div class="verdict oom">{_e(oom_sentence(given["oom"]))}</div>')
    return [*out, "<h2>Allocator replay</h2>", f'<pre class="replay">{_e(text)}</pre>']


def render_html(ledger: Ledger, figures: Figures | None = None, *, title: str | None = None) -> str:
    """The whole page as a string. ``figures`` defaults to the bill alone; figures need matplotlib."""
    from vramledger.report.plots import render

    figs = figures or Figures(bill=bill_figure(ledger))
    svgs = render(figs, "svg")
    head = title or f"vramledger: {ledger.model}"
    settings = ", ".join(f"{k} {_plain(v)}" for k, v in ledger.settings.items() if _plain(v))
    peak = ledger.peak_phase
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(head)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_e(head)}</h1>",
        f'<p class="sub">{_e(ledger.engine)} engine · params {ledger.params:,} · trainable '
        f"{ledger.trainable_params:,} ({100 * ledger.trainable_params / max(1, ledger.params):.2f}%)"
        + (f"<br>{_e(settings)}" if settings else "")
        + "</p>",
        _verdict(ledger),
        f"<p>Peak in <b>{_e(peak.value)}</b>: {_e(ledger.moments.get(peak, ''))}. Peak allocated "
        f"{_e(fmt_bytes(ledger.peak_allocated))} · reserved {_e(fmt_bytes(ledger.peak_reserved))} · device total "
        f"<b>{_e(fmt_bytes(ledger.device_total))}</b>.</p>",
    ]
    if ledger.advice:
        parts.append(f"<p>{_e(ledger.advice)}</p>")
    parts += _allocator_replay(ledger)
    parts += ["<h2>The bill</h2>", ledger_table(ledger), _sources(ledger)]
    notes = [
        f"assumed, not yet measured: {c}"
        for c in sorted({i.category.display for i in ledger.items if i.basis is Basis.ASSUMPTION})
    ]
    notes += [f"warning: {w}" for w in ledger.warnings]
    if notes:
        parts.append('<ul class="notes">' + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>")
    parts.append("<h2>Figures</h2>")
    for stem, caption, svg in svgs:
        parts.append(
            f'<figure class="vl-figure" id="fig-{stem}" data-figure="{stem}">'
            f"{inline_svg(svg.decode('utf-8'), stem)}"
            f'<figcaption id="{stem}-caption">{_e(caption)}</figcaption></figure>'
        )
    parts.append('<p class="sub">Made by vramledger. Sizes in GiB (2<sup>30</sup> bytes).</p></body></html>')
    return "\n".join(parts)


_NOTEBOOK_CSS = """
.vramledger table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
.vramledger th, .vramledger td { padding: 2px 10px; text-align: right; }
.vramledger th:first-child, .vramledger td:first-child { text-align: left; }
.vramledger td.peak, .vramledger th.peak { background: #FFF4D6; font-weight: 600; }
.vramledger tr.total td { border-top: 2px solid currentColor; font-weight: 600; }
.vramledger .verdict { padding: 6px 10px; margin: 8px 0; border-left: 6px solid; font-weight: 600; }
.vramledger .verdict.fits { border-color: #004488; } .vramledger .verdict.oom { border-color: #BB5566; }
.vramledger .swatch { display: inline-block; width: 0.8em; height: 0.8em; margin-right: 5px; }
"""


def notebook_html(ledger: Ledger) -> str:
    """The bill for a notebook cell (Jupyter's ``_repr_html_``): the table, the verdict and the advice, styles
    scoped to the cell, no figures (so no matplotlib)."""
    parts = [
        f'<div class="vramledger"><style>{_NOTEBOOK_CSS}</style>',
        f"<b>{_e(ledger.model)}</b> ({_e(ledger.engine)}): peak allocated {_e(fmt_bytes(ledger.peak_allocated))} · "
        f"device total <b>{_e(fmt_bytes(ledger.device_total))}</b> in {_e(ledger.peak_phase.value)}",
    ]
    if ledger.verdict is not None:
        parts.append(_verdict(ledger))
    if ledger.advice:
        parts.append(f"<p>{_e(ledger.advice)}</p>")
    parts += [ledger_table(ledger), "</div>"]
    return "\n".join(parts)


def write_html(path: Path, ledger: Ledger, figures: Figures | None = None) -> Path:
    """Write the page to ``path`` (parent folders must exist) through a temporary file renamed into place, and
    return it."""
    from vramledger.userfiles import write_atomic

    return write_atomic(path, render_html(ledger, figures), "--html")
