"""The OOM post-mortem as one self-contained HTML page (no scripts, no network; the CSS of ``report.html``)."""

from __future__ import annotations

from pathlib import Path

from vramledger.errors import VramledgerError
from vramledger.explain.postmortem import PostMortem
from vramledger.report.html import _CSS, _e
from vramledger.report.postmortem import TITLES, _figures, reason_text
from vramledger.units import fmt_bytes


def _bars(pm: PostMortem) -> str:
    """Where the memory went, as CSS bars scaled to the largest share."""
    shares = pm.evidence.shares
    if not shares:
        return ""
    top = max(s.bytes for s in shares) or 1
    rows = "".join(
        f"<tr><td>{_e(s.bucket.display)}</td><td>{_e(fmt_bytes(s.bytes))}</td>"
        f'<td style="text-align:left"><span style="display:inline-block;height:0.8em;background:#4477AA;'
        f'width:{max(1, round(300 * s.bytes / top))}px"></span></td><td style="text-align:left">'
        f"<code>{_e(s.example)}</code></td></tr>"
        for s in shares
    )
    return (
        "<h2>Where the memory went</h2><table><thead><tr><th>line</th><th>bytes</th><th></th>"
        f'<th style="text-align:left">largest block allocated at</th></tr></thead><tbody>{rows}</tbody></table>'
    )


def _comparison(pm: PostMortem) -> str:
    c = pm.comparison
    if c is None:
        return ""
    measured = {s.bucket.category: s.bytes for s in pm.evidence.shares if s.bucket.category is not None}
    rows = "".join(
        f"<tr><td>{_e(cat.display)}</td><td>{_e(fmt_bytes(c.ledger.bytes_of(cat, c.phase)))}</td>"
        f"<td>{_e(fmt_bytes(measured[cat]) if cat in measured else '-')}</td></tr>"
        for cat in c.ledger.categories()
        if cat.allocated
    )
    needed = "" if c.needed_allocated_bytes is None else f"; needed at least {fmt_bytes(c.needed_allocated_bytes)}"
    return (
        f"<h2>The prediction (phase {_e(c.phase.value)})</h2><p>predicted allocated "
        f"{_e(fmt_bytes(c.predicted_allocated_bytes))}, reserved {_e(fmt_bytes(c.predicted_reserved_bytes))}"
        f"{_e(needed)}</p><table><thead><tr><th>line</th><th>predicted</th><th>measured</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
    )


def _fixes(pm: PostMortem) -> str:
    if not pm.fixes:
        return ""
    items = "".join(
        f"<li><b>{_e(f.title)}</b>: <code>{_e(f.change)}</code>"
        + ("" if f.memory_saved_bytes is None else f" — saves {_e(fmt_bytes(f.memory_saved_bytes))}")
        + ("" if f.time_cost_s is None else f", {f.time_cost_s:+.2f} s per optimizer step")
        + f"; {_e(f.price)}"
        + ("" if not f.keys else "<br>set: " + ", ".join(f"<code>{_e(k)}: {_e(v)}</code>" for k, v in f.keys.items()))
        + "</li>"
        for f in pm.fixes
    )
    return f"<h2>Cheapest fixes</h2><ol>{items}</ol>"


def render_postmortem_html(pm: PostMortem) -> str:
    figures = "".join(f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in _figures(pm))
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>OOM post-mortem: {_e(TITLES[pm.diagnosis])}</title><style>{_CSS}</style></head><body>"
        f'<h1>Out of memory: {_e(TITLES[pm.diagnosis])}</h1><p class="sub">{_e(pm.evidence.source)}</p>'
        f'<div class="verdict oom">{_e(reason_text(pm))}</div>'
        f"<h2>The failure</h2><table><tbody>{figures}</tbody></table>"
        f"{_bars(pm)}{_comparison(pm)}{_fixes(pm)}</body></html>\n"
    )


def write_postmortem_html(path: Path, pm: PostMortem) -> Path:
    if path.exists():
        raise VramledgerError(f"--html: {path} exists; pick a new file (vramledger never overwrites your files)")
    try:
        path.write_text(render_postmortem_html(pm), encoding="utf-8")
    except OSError as exc:
        raise VramledgerError(f"--html: cannot write {path} ({exc.strerror}); pick another path") from None
    return path
