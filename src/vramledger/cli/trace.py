"""``vramledger trace MODEL``: run the real transformers/PEFT training step on fake tensors and itemise it."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from vramledger.cli.common import add_gpu_options, add_model_options, add_train_options
from vramledger.ledger import Ledger, Phase


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "trace",
        help="trace the real training step on fake tensors (CPU, no GPU, no weights)",
        description="Run two training steps of the real transformers/PEFT code on fake CPU tensors, with the "
        "code paths a CUDA run takes, and itemise every allocation.",
    )
    add_model_options(p)
    add_train_options(p)
    add_gpu_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output (same keys as estimate)")
    p.add_argument("--timeline", action="store_true", help="with --json: include the live-bytes timeline")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from vramledger.cli.common import resolve_inputs
    from vramledger.trace import trace_step

    inputs = resolve_inputs(args)
    ledger = trace_step(inputs.model, inputs.train, gpu=inputs.gpu, headroom=inputs.headroom)
    if args.json:
        print(json.dumps(ledger_json(ledger, timeline=args.timeline), indent=2))
    else:
        _print_table(ledger, inputs.warnings)
    return 0


# TODO(report): switch to the estimate's renderer and JSON from vramledger.report once it is on main, so that
# both commands share one format; until then this keeps the Ledger's own field names.
def ledger_json(ledger: Ledger, *, timeline: bool = False) -> dict[str, Any]:
    """The Ledger as plain JSON: its fields plus the derived per-phase totals."""
    out: dict[str, Any] = {
        "model": ledger.model,
        "engine": ledger.engine,
        "params": ledger.params,
        "trainable_params": ledger.trainable_params,
        "items": [
            {
                "category": i.category.value,
                "phase": i.phase.value,
                "bytes": i.bytes,
                "label": i.label,
                "source": i.source,
                "basis": i.basis.value,
            }
            for i in ledger.items
        ],
        "phases": {
            p.value: {
                "allocated": ledger.allocated(p),
                "reserved": ledger.reserved(p),
                "device": ledger.device(p),
            }
            for p in ledger.phases
        },
        "peak_phase": ledger.peak_phase.value if ledger.items else None,
        "peak_allocated": ledger.peak_allocated,
        "peak_reserved": ledger.peak_reserved,
        "device_total": ledger.device_total,
        "moments": {p.value: m for p, m in ledger.moments.items()},
        "verdict": dataclasses.asdict(ledger.verdict) if ledger.verdict else None,
        "advice": ledger.advice,
        "warnings": list(ledger.warnings),
        "settings": dict(ledger.settings),
    }
    if timeline:
        out["timeline"] = [
            {
                "index": s.index,
                "phase": s.phase.value,
                "live_bytes": s.live_bytes,
                "by_category": {c.value: b for c, b in s.by_category.items()},
                "op": s.op,
                "module": s.module,
            }
            for s in ledger.timeline
        ]
    return out


def _print_table(ledger: Ledger, warnings: tuple[str, ...]) -> None:
    from vramledger.units import fmt_bytes

    phases = [p for p in ledger.phases if p is not Phase.LOAD] or list(ledger.phases)
    print(f"{ledger.model}: traced on fake tensors ({ledger.settings.get('versions', '')})")
    print(f"params {ledger.params:,}, trainable {ledger.trainable_params:,}")
    print(f"{'category':<34}" + "".join(f"{p.value:>14}" for p in phases))
    for cat in ledger.categories():
        labels = sorted({i.label for i in ledger.items if i.category is cat})
        for label in labels:
            row = [
                sum(i.bytes for i in ledger.items if i.category is cat and i.phase is p and i.label == label)
                for p in phases
            ]
            name = cat.display if len(labels) == 1 else f"{cat.display}: {label[:20]}"
            print(f"{name[:34]:<34}" + "".join(f"{fmt_bytes(b):>14}" for b in row))
    print(
        f"{'allocated at the phase peak':<34}"
        + "".join(f"{fmt_bytes(ledger.allocated(p)):>14}" for p in phases)
    )
    peak = ledger.peak_phase
    print(f"peak: {fmt_bytes(ledger.peak_allocated)} in {peak.value}, at {ledger.moments.get(peak, '?')}")
    for p in phases:
        if p is not peak and p in ledger.moments:
            print(f"  {p.value} peak at {ledger.moments[p]}")
    top = ledger.settings.get("top_modules") or []
    if top:
        print("top allocating modules (bytes allocated over both steps):")
        for name, b in top[:5]:  # type: ignore[misc]
            print(f"  {fmt_bytes(b):>12}  {name}")
    if ledger.verdict is not None:
        v = ledger.verdict
        word = "fits" if v.fits else "does not fit"
        print(
            f"{v.gpu}: {word} (usable {fmt_bytes(v.usable_bytes)}, "
            f"margin {fmt_bytes(v.margin_bytes, signed=True)}; "
            "allocated only: allocator reserve and CUDA context not added)"
        )
    if ledger.advice:
        print(ledger.advice)
    for w in (*warnings, *ledger.warnings):
        print(f"warning: {w}")
