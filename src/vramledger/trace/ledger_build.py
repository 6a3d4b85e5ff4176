"""Turn categorised trace events into a Ledger: per phase, the bytes of each category at that phase's peak.

The live total is replayed event by event (allocated bytes only; ``host`` tensors are left out). A phase's peak is
its highest live total over both traced steps; its line items are the categories live at that moment.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType

from vramledger.ledger import Basis, Category, LineItem, Phase, TimelineSample
from vramledger.trace.recorder import Event

MAX_TIMELINE = 2000


@dataclass(frozen=True, kw_only=True, slots=True)
class PhasePeak:
    phase: Phase
    index: int
    live: int
    by_category: dict[Category, int]
    param_cast_bytes: int
    op: str
    module: str
    step: int


def replay(
    events: Sequence[Event], param_cast: frozenset[int] = frozenset()
) -> tuple[dict[Phase, PhasePeak], list[TimelineSample]]:
    """Phase peaks and the full (not yet downsampled) timeline."""
    live: Counter[Category] = Counter()
    cast_live = 0
    total = 0
    peaks: dict[Phase, PhasePeak] = {}
    timeline: list[TimelineSample] = []
    for i, e in enumerate(events):
        if e.category == "host":
            continue
        cat = Category(e.category)
        sign = 1 if e.kind == "alloc" else -1
        live[cat] += sign * e.bytes
        total += sign * e.bytes
        if e.storage in param_cast:
            cast_live += sign * e.bytes
        best = peaks.get(e.phase)
        if e.kind == "alloc" and (best is None or total > best.live):
            peaks[e.phase] = PhasePeak(
                phase=e.phase,
                index=i,
                live=total,
                by_category={c: b for c, b in live.items() if b},
                param_cast_bytes=cast_live,
                op=e.op,
                module=e.module,
                step=e.step,
            )
        timeline.append(
            TimelineSample(
                index=i,
                phase=e.phase,
                live_bytes=total,
                by_category=MappingProxyType({c: b for c, b in live.items() if b}),
                op=e.op,
                module=e.module,
            )
        )
    return peaks, timeline


def downsample(samples: list[TimelineSample], limit: int = MAX_TIMELINE) -> tuple[TimelineSample, ...]:
    """At most ``limit`` samples, keeping the highest sample of each bucket (so no peak is lost)."""
    if len(samples) <= limit:
        return tuple(samples)
    size = -(-len(samples) // limit)
    return tuple(max(samples[i : i + size], key=lambda s: s.live_bytes) for i in range(0, len(samples), size))


_LABELS = {
    Category.WEIGHTS: "parameters and buffers",
    Category.GRADIENTS: "parameter gradients",
    Category.OPTIMIZER_STATE: "optimizer states",
    Category.ACTIVATIONS: "tensors saved for backward (and checkpoint recomputes)",
    Category.ATTENTION_SCORES: "length × length tensors (eager scores, masks, math SDPA)",
    Category.LOGITS_LOSS: "logits, their fp32 upcast and the cross-entropy",
    Category.TEMPORARIES: "short-lived tensors (inputs, activation gradients, optimizer temporaries)",
}


def line_items(peaks: dict[Phase, PhasePeak], source: str) -> list[LineItem]:
    items: list[LineItem] = []
    for phase in Phase:
        peak = peaks.get(phase)
        if peak is None:
            continue
        for cat in Category:
            b = peak.by_category.get(cat, 0)
            if cat is Category.WEIGHTS and peak.param_cast_bytes:
                items.append(
                    LineItem(
                        category=cat,
                        phase=phase,
                        bytes=peak.param_cast_bytes,
                        label="autocast copies of fp32 weights (torch.autocast weight cache)",
                        source=source,
                        basis=Basis.TRACE,
                    )
                )
                b -= peak.param_cast_bytes
            if b:
                items.append(
                    LineItem(
                        category=cat,
                        phase=phase,
                        bytes=b,
                        label=_LABELS.get(cat, cat.display),
                        source=source,
                        basis=Basis.TRACE,
                    )
                )
    return items


def top_modules(events: Sequence[Event], n: int = 8) -> list[tuple[str, int]]:
    """Modules by bytes allocated during the steps (loading excluded), largest first."""
    total: Counter[str] = Counter()
    for e in events:
        if e.kind == "alloc" and e.phase is not Phase.LOAD and e.category != "host":
            total[e.module or "(top level)"] += e.bytes
    return total.most_common(n)
