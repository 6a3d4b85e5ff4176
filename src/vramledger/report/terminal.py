"""The bill in the terminal: lines × phases with the peak marked, the verdict, one sentence of advice.

Fits 100 columns; no colour codes at all (readable through pipes and with NO_COLOR).
"""

from __future__ import annotations

import textwrap

from vramledger.ledger import Basis, Category, Ledger, Phase
from vramledger.report.verdict import verdict_sentence
from vramledger.units import fmt_bytes

_W = 30  # label column
_C = 12  # phase column


def _cell(n: int) -> str:
    return fmt_bytes(n) if n else "-"


def render_ledger(ledger: Ledger, *, title: str | None = None) -> str:
    phases = [p for p in ledger.phases]
    peak = ledger.peak_phase
    lines: list[str] = []
    head = title or f"{ledger.model}  ({ledger.engine})"
    lines.append(head)
    lines.append(
        f"params {ledger.params:,}  trainable {ledger.trainable_params:,}"
        f" ({100 * ledger.trainable_params / max(1, ledger.params):.2f}%)"
    )
    lines.append("")
    hdr = f"{'':<{_W}}" + "".join(f"{(p.value + (' *' if p is peak else '')):>{_C}}" for p in phases)
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for cat in ledger.categories():
        if not cat.allocated:
            continue
        row = f"{cat.display:<{_W}}" + "".join(f"{_cell(ledger.bytes_of(cat, p)):>{_C}}" for p in phases)
        lines.append(row)
    lines.append("-" * len(hdr))
    lines.append(f"{'peak allocated':<{_W}}" + "".join(f"{_cell(ledger.allocated(p)):>{_C}}" for p in phases))
    lines.append(
        f"{'+ ' + Category.ALLOCATOR_RESERVE.display:<{_W}}"
        + "".join(f"{_cell(ledger.bytes_of(Category.ALLOCATOR_RESERVE, p)):>{_C}}" for p in phases)
    )
    lines.append(f"{'= peak reserved':<{_W}}" + "".join(f"{_cell(ledger.reserved(p)):>{_C}}" for p in phases))
    lines.append(
        f"{'+ ' + Category.CUDA_CONTEXT.display:<{_W}}"
        + "".join(f"{_cell(ledger.bytes_of(Category.CUDA_CONTEXT, p)):>{_C}}" for p in phases)
    )
    if Category.NCCL in ledger.categories():
        lines.append(
            f"{'+ ' + Category.NCCL.display:<{_W}}"
            + "".join(f"{_cell(ledger.bytes_of(Category.NCCL, p)):>{_C}}" for p in phases)
        )
    if Category.MANAGED_MEMORY in ledger.categories():
        lines.append(
            f"{'+ ' + Category.MANAGED_MEMORY.display:<{_W}}"
            + "".join(f"{_cell(ledger.bytes_of(Category.MANAGED_MEMORY, p)):>{_C}}" for p in phases)
        )
    lines.append(f"{'= device total (nvidia-smi)':<{_W}}" + "".join(f"{_cell(ledger.device(p)):>{_C}}" for p in phases))
    lines.append("")
    lines.append(f"peak: {peak.value} — {ledger.moments.get(peak, '')}")
    lines.append(
        f"peak allocated {fmt_bytes(ledger.peak_allocated)} · reserved {fmt_bytes(ledger.peak_reserved)}"
        f" · device total {fmt_bytes(ledger.device_total)}"
    )
    v = ledger.verdict
    if v is not None:
        lines.append(verdict_sentence(v))
    if ledger.advice:
        lines.append(ledger.advice)
    assumed = sorted({i.category.display for i in ledger.items if i.basis is Basis.ASSUMPTION})
    if assumed:
        lines.append(f"assumed, not yet measured: {', '.join(assumed)} (see README, Known limits)")
    for w in ledger.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(wrap(line) for line in lines)


def wrap(line: str, width: int = 100) -> str:
    """Prose lines wrap at 100 columns with a hanging indent; table rows are already narrower."""
    if len(line) <= width:
        return line
    return textwrap.fill(line, width=width, subsequent_indent="  ", break_on_hyphens=False)


def render_sources(ledger: Ledger, phase: Phase | None = None) -> str:
    """Every line of the peak phase with its label, bytes, basis and source."""
    phase = phase or ledger.peak_phase
    out = [f"lines of the {phase.value} peak ({ledger.moments.get(phase, '')}):"]
    for i in ledger.items:
        if i.phase is phase:
            out.append(f"  {i.category.value:<18} {fmt_bytes(i.bytes):>11}  {i.label}")
            out.append(wrap(f"      {i.basis.value}: {i.source}").replace("\n  ", "\n        "))
    return "\n".join(out)


def render_provenance(provenance: dict[str, str]) -> str:
    """Where each setting came from: the file, a framework default (with its source), or a flag."""
    if not provenance:
        return ""
    out = ["settings:"]
    for key in sorted(provenance):
        out.append(wrap(f"  {key:<12} {provenance[key]}").replace("\n  ", "\n" + " " * 16))
    return "\n".join(out)
