"""What only a trace knows, printed after the shared table (``terminal.render_ledger``): the peak op and
module of each phase, the top allocating modules, and the allocator replay: where the step would run out of
memory, side by side with torch's default allocator settings when other settings were given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramledger.ledger import Ledger, Phase
from vramledger.trace.opnames import op_label
from vramledger.units import fmt_bytes


def _oom_lines(r: Mapping[str, Any]) -> list[str]:
    o = r.get("oom")
    if r.get("capacity_bytes") is None:
        return ["(no GPU given: replayed without a capacity limit)"]
    if o is None:
        retries = r.get("num_alloc_retries", 0)
        note = [f"  (after freeing the cache {retries}x)"] if retries else []
        return [f"no OOM within {fmt_bytes(r['capacity_bytes'])}", *note]
    return [
        f"OOM at {op_label(o['op'], o.get('category', ''), o['phase'], o['module'])}",
        f"  in {o['module'] or '(top level)'}",
        f"  {o['phase']}, step {o['step']}: {fmt_bytes(o['requested_bytes'])} requested",
        f"  allocated {fmt_bytes(o['allocated_bytes'])} of {fmt_bytes(o['capacity_bytes'])}",
        f"  free but unusable {fmt_bytes(o['unusable_free_bytes'])}",
        f"  (cached {fmt_bytes(o['free_cached_bytes'])}, largest block {fmt_bytes(o['largest_free_block_bytes'])})",
    ]


def oom_sentence(o: Mapping[str, Any]) -> str:
    """The OOM point of a replay (``OomPoint.to_dict``) in one sentence."""
    op = op_label(o["op"], o.get("category", ""), o["phase"], o["module"])
    return (
        f"Runs out of memory at {op} in {o['module'] or '(top level)'}, "
        f"{o['phase']} of step {o['step']}: {fmt_bytes(o['requested_bytes'])} requested with "
        f"{fmt_bytes(o['allocated_bytes'])} of {fmt_bytes(o['capacity_bytes'])} allocated."
    )


def _summary(r: Mapping[str, Any]) -> list[str]:
    reserved = "reserved before OOM" if r.get("oom") else "peak reserved"
    return [
        f"{reserved} {fmt_bytes(r['peak_reserved_bytes'])}",
        f"peak allocated {fmt_bytes(r['peak_allocated_bytes'])}",
        f"{r['segments_at_peak']} segments at the reserved peak",
    ]


def render_allocator(ledger: Ledger) -> str:
    """The allocator replay(s) in words; two columns when a non-default config is compared with the default."""
    given = ledger.settings.get("allocator")
    if not isinstance(given, Mapping):
        return ""
    default = ledger.settings.get("allocator_default")
    cap = given.get("capacity_bytes")
    where = f"capacity {fmt_bytes(cap)} = GPU memory − CUDA context" if cap is not None else "unlimited"
    if cap is not None and given.get("outside_bytes"):
        where += f" − NCCL communicators ({fmt_bytes(given['outside_bytes'])})"
    out = [f"caching-allocator replay ({where}):"]
    if not isinstance(default, Mapping):
        out += [f"  {line}" for line in _summary(given) + _oom_lines(given)]
        return "\n".join(out)
    left = [f"[{given['conf']}]"] + _summary(given) + _oom_lines(given)
    right = ["[default]"] + _summary(default) + _oom_lines(default)
    w = max(len(s) for s in left) + 3
    if w + max(len(s) for s in right) > 98:  # too wide for 100 columns: one after the other
        out += [f"  {line}" for line in left + right]
        return "\n".join(out)
    for i in range(max(len(left), len(right))):
        a = left[i] if i < len(left) else ""
        b = right[i] if i < len(right) else ""
        out.append(f"  {a:<{w}}{b}".rstrip())
    return "\n".join(out)


def render_trace_extras(ledger: Ledger, *, top: int = 5) -> str:
    """Peak moments of the other phases, the top allocating modules, and the allocator replay."""
    lines: list[str] = []
    peak = ledger.peak_phase
    for p in ledger.phases:
        if p is not peak and p is not Phase.LOAD and p in ledger.moments:
            lines.append(f"{p.value} peak at {ledger.moments[p]}")
    mods = ledger.settings.get("top_modules") or []
    if mods:
        lines.append("top allocating modules (bytes allocated over both steps):")
        for name, b in list(mods)[:top]:  # type: ignore[call-overload]
            lines.append(f"  {fmt_bytes(b):>12}  {name}")
    alloc = render_allocator(ledger)
    if alloc:
        lines.append(alloc)
    return "\n".join(lines)
