"""The OOM post-mortem (``explain.postmortem.PostMortem``) in the terminal and as JSON.

The reason codes of ``explain.postmortem`` become sentences here, with their figures; nothing else formats them.
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

from vramledger.explain.postmortem import Diagnosis, PostMortem
from vramledger.units import fmt_bytes

TITLES = {
    Diagnosis.REQUEST_EXCEEDS_GPU: "one request larger than the GPU",
    Diagnosis.FRAGMENTATION: "fragmentation",
    Diagnosis.OTHER_PROCESSES: "other processes hold the memory",
    Diagnosis.MEMORY_FRACTION_CAP: "the per-process memory cap",
    Diagnosis.DRIVER_REFUSED: "the driver refused free memory",
    Diagnosis.CAPACITY: "the step does not fit",
    Diagnosis.UNKNOWN: "not enough evidence",
}


def wrap(line: str, indent: int = 2) -> str:
    """100 columns; continuation lines hang under the text, ``indent`` spaces in."""
    return textwrap.fill(
        line, width=100, subsequent_indent=" " * indent, break_on_hyphens=False, break_long_words=False
    )


def _b(n: int | None) -> str:
    return "?" if n is None else fmt_bytes(n)


def reason_text(pm: PostMortem) -> str:
    """The cause in one or two sentences, with the figures it rests on."""
    req = _b(pm.requested_bytes)
    d = pm.diagnosis
    if d is Diagnosis.REQUEST_EXCEEDS_GPU:
        limit = min(v for v in (pm.capacity_bytes, pm.allowed_bytes) if v is not None)
        return (
            f"a single allocation of {req} is larger than the {fmt_bytes(limit)} the GPU gives this process: "
            "no batch split or cache setting helps; shrink the tensor (usually the logits, batch x length x "
            "vocabulary)."
        )
    if d is Diagnosis.FRAGMENTATION:
        largest = (
            ""
            if pm.largest_free_block_bytes is None
            else f" (the largest free block was {fmt_bytes(pm.largest_free_block_bytes)})"
        )
        text = (
            f"the allocator held {_b(pm.cached_free_bytes)} reserved but unallocated, at least the {req} "
            f"asked, but no free block was large enough{largest}: the free space sits between live blocks, in "
            "segments PyTorch cannot release."
        )
        cap = pm.allowed_bytes or pm.capacity_bytes
        if cap and pm.allocated_bytes is not None and pm.allocated_bytes + (pm.requested_bytes or 0) > 0.9 * cap:
            share = (pm.allocated_bytes + (pm.requested_bytes or 0)) / cap
            text += (
                f" But live tensors and the request alone come to {share:.0%} of the GPU: defragmenting buys "
                "little headroom; shrink the step too."
            )
        return text
    if d is Diagnosis.OTHER_PROCESSES:
        return (
            f"other processes on the GPU hold {_b(pm.other_processes_bytes)}, and only {_b(pm.free_bytes)} "
            f"was free for the {req} asked."
        )
    if d is Diagnosis.MEMORY_FRACTION_CAP:
        return (
            f"set_per_process_memory_fraction capped this process at {_b(pm.allowed_bytes)}; the {req} asked "
            f"on top of {_b(pm.allocated_bytes)} live would have fitted the GPU's {_b(pm.capacity_bytes)}."
        )
    if d is Diagnosis.DRIVER_REFUSED:
        return (
            f"the driver reported {_b(pm.free_bytes)} free, at least the {req} asked, yet cudaMalloc failed: the "
            "device's free memory is not in one piece (memory outside PyTorch, the display driver on Windows), or "
            "it was freed between the failure and the reading. Smaller allocations (a smaller micro-batch) or "
            "expandable_segments:True, which maps memory in 20 MiB pages, avoid needing one large piece."
        )
    if d is Diagnosis.CAPACITY:
        left = (
            f" ({fmt_bytes(pm.free_bytes)} free of {fmt_bytes(pm.capacity_bytes)})"
            if pm.free_bytes is not None and pm.capacity_bytes is not None
            else ""
        )
        cache = (
            f"; the cache held only {fmt_bytes(pm.cached_free_bytes)} free, so this is the step's size, not "
            "fragmentation"
            if pm.cached_free_bytes is not None
            else ""
        )
        return (
            f"{_b(pm.allocated_bytes)} in live tensors plus the {req} asked exceed what the GPU had left{left}{cache}."
        )
    return f"only the request ({req}) is known; pass the whole error message or a snapshot for a cause."


def _figures(pm: PostMortem) -> list[tuple[str, str]]:
    ev, msg = pm.evidence, pm.evidence.message
    rows = [("requested", _b(pm.requested_bytes)), ("GPU capacity", _b(pm.capacity_bytes))]
    if pm.allowed_bytes is not None:
        rows.append(("allowed (memory fraction)", fmt_bytes(pm.allowed_bytes)))
    rows.append(("free on the GPU", _b(pm.free_bytes)))
    if pm.process_bytes is not None:
        extra = (
            f"   (outside PyTorch's allocator: {fmt_bytes(pm.process_bytes - pm.reserved_bytes)})"
            if pm.reserved_bytes is not None
            else ""
        )
        label = (
            "this process (NVML)" if pm.own_pid_inferred is None else f"this process (NVML pid {pm.own_pid_inferred})"
        )
        rows.append((label, fmt_bytes(pm.process_bytes) + extra))
    if pm.other_processes_bytes is not None:
        rows.append(("other processes", fmt_bytes(pm.other_processes_bytes)))
    rows += [
        ("allocated (live tensors)", _b(pm.allocated_bytes)),
        ("reserved by PyTorch", _b(pm.reserved_bytes)),
        ("reserved but unallocated", _b(pm.cached_free_bytes)),
    ]
    if pm.largest_free_block_bytes is not None:
        rows.append(("largest free cached block", fmt_bytes(pm.largest_free_block_bytes)))
    if ev.phase or ev.step is not None:
        rows.append(
            ("running", " ".join(x for x in (ev.phase or "", "" if ev.step is None else f"step {ev.step}") if x))
        )
    if ev.batch:
        rows.append(("batch", ", ".join(f"{k} {v}" for k, v in ev.batch.items())))
    if msg is not None:
        rows.append(("message wording", msg.wording))
    return rows


def render_postmortem(pm: PostMortem) -> str:
    """The post-mortem as terminal text (100 columns, no colour)."""
    lines = [f"out of memory: {TITLES[pm.diagnosis]}  ({pm.evidence.source})", wrap("  " + reason_text(pm)), ""]
    lines.append("the failure")
    lines += [f"  {k:<32}{v}" for k, v in _figures(pm)]
    if pm.own_pid_inferred is not None:
        lines.append(
            wrap(
                f"  (the message has no 'this process' line; process {pm.own_pid_inferred}'s is taken for it: the "
                "listed processes and PyTorch's reserve exceed the GPU's used memory, as when a container's pids "
                "differ from the host's that NVML reports)",
                3,
            )
        )
    shares = pm.evidence.shares
    if shares:
        total = sum(s.bytes for s in shares)
        lines += ["", f"where the memory went (live blocks of the snapshot, {fmt_bytes(total)})"]
        for s in shares:
            lines.append(f"  {s.bucket.display:<34}{fmt_bytes(s.bytes):>11} {s.blocks:>6} blocks  {s.example}"[:100])
    c = pm.comparison
    if c is not None:
        led = c.ledger
        lines += ["", f"the prediction ({led.engine}, phase {c.phase.value})"]
        lines.append(f"  {'predicted allocated':<32}{fmt_bytes(c.predicted_allocated_bytes)}")
        lines.append(f"  {'predicted reserved':<32}{fmt_bytes(c.predicted_reserved_bytes)}")
        if c.needed_allocated_bytes is not None:
            lines.append(f"  {'needed (allocated + request)':<32}at least {fmt_bytes(c.needed_allocated_bytes)}")
        if led.verdict is not None:
            v = led.verdict
            word = "fits" if v.fits else "does NOT fit"
            lines.append(
                wrap(
                    f"  {'predicted verdict':<32}{word}: device total {fmt_bytes(v.device_total_bytes)} "
                    f"vs usable {fmt_bytes(v.usable_bytes)} on {v.gpu}",
                    34,
                )
            )
        by_cat = {s.bucket.category: s.bytes for s in shares if s.bucket.category is not None}
        if by_cat:
            lines.append(f"  {'line':<32}{'predicted':>12}{'measured':>12}")
            for cat in led.categories():
                if cat.allocated and (led.bytes_of(cat, c.phase) or cat in by_cat):
                    got = by_cat.get(cat)
                    lines.append(
                        f"  {cat.display:<32}{fmt_bytes(led.bytes_of(cat, c.phase)):>12}"
                        f"{'-' if got is None else fmt_bytes(got):>12}"
                    )
    if pm.fixes:
        lines += [
            "",
            "cheapest fixes (priced by `vramledger plan`; memory saved against your setup)"
            if pm.comparison is not None
            else "fix (pass --config or the setup's flags for remedies priced against your setup)",
        ]
        for i, f in enumerate(pm.fixes, 1):
            saved = "" if f.memory_saved_bytes is None else f"saves {fmt_bytes(f.memory_saved_bytes)}, "
            cost = "" if f.time_cost_s is None else f"{f.time_cost_s:+.2f} s per optimizer step, "
            lines.append(wrap(f"  {i}. {f.title}: {f.change} — {saved}{cost}{f.price}", 5))
            if f.keys:
                lines.append(wrap("     set: " + ", ".join(f"{k}: {json.dumps(v)}" for k, v in f.keys.items()), 10))
    return "\n".join(lines)


def postmortem_to_dict(pm: PostMortem) -> dict[str, Any]:
    """Bytes everywhere; null where the evidence does not say."""
    msg = pm.evidence.message
    out: dict[str, Any] = {
        "source": pm.evidence.source,
        "requested_bytes": pm.requested_bytes,
        "capacity_bytes": pm.capacity_bytes,
        "free_bytes": pm.free_bytes,
        "process_bytes": pm.process_bytes,
        "allowed_bytes": pm.allowed_bytes,
        "allocated_bytes": pm.allocated_bytes,
        "reserved_bytes": pm.reserved_bytes,
        "reserved_unallocated_bytes": pm.cached_free_bytes,
        "largest_free_block_bytes": pm.largest_free_block_bytes,
        "other_processes_bytes": pm.other_processes_bytes,
        "own_pid_inferred": pm.own_pid_inferred,
        "diagnosis": pm.diagnosis.value,
        "reason": reason_text(pm),
        "wording": msg.wording if msg else None,
        "phase": pm.evidence.phase,
        "step": pm.evidence.step,
        "batch": dict(pm.evidence.batch) if pm.evidence.batch else None,
        "by_category": [
            {"category": s.bucket.value, "bytes": s.bytes, "blocks": s.blocks, "example": s.example}
            for s in pm.evidence.shares
        ],
        "fixes": [
            {
                "title": f.title,
                "change": f.change,
                "keys": dict(f.keys),
                "memory_saved_bytes": f.memory_saved_bytes,
                "time_cost_s": f.time_cost_s,
                "fits": f.fits,
                "price": f.price,
            }
            for f in pm.fixes
        ],
    }
    c = pm.comparison
    if c is not None:
        out["prediction"] = {
            "phase": c.phase.value,
            "predicted_allocated_bytes": c.predicted_allocated_bytes,
            "predicted_reserved_bytes": c.predicted_reserved_bytes,
            "needed_allocated_bytes": c.needed_allocated_bytes,
            "predicted_fits": c.predicted_fits,
            "by_category": {cat.value: c.ledger.bytes_of(cat, c.phase) for cat in c.ledger.categories()},
        }
    return out


def dumps(pm: PostMortem) -> str:
    return json.dumps(postmortem_to_dict(pm), indent=2)
