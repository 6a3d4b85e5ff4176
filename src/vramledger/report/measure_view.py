"""`vramledger measure` in the terminal and as JSON: the measured ledger beside each predictor's.

Pure functions of the measured ledger, the trial's raw report and the predictions; the CLI prints what they return.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramledger.ledger import Category, Ledger
from vramledger.specs import ModelSpec, TrainSpec
from vramledger.units import fmt_bytes


def _pct(e: float | None) -> str:
    return "" if e is None else f"{e * 100:+.1f}%"


def measure_to_dict(
    ledger: Ledger, raw: Mapping[str, Any], preds: Mapping[str, Ledger], notes: list[str]
) -> dict[str, Any]:
    """The JSON document of ``measure --json``: measured figures, items, environment, predictions and errors."""
    from vramledger.measure.results import FIGURES, ledger_figures, relative_error

    measured = ledger_figures(ledger)
    return {
        "measured": measured,
        "items": [
            {"phase": i.phase.value, "category": i.category.value, "bytes": i.bytes, "label": i.label}
            for i in ledger.items
        ],
        "environment": raw.get("environment", {}),
        "counters": raw.get("counters", {}),
        "predictions": {k: ledger_figures(v) for k, v in preds.items()},
        "errors": {
            k: {f: relative_error(ledger_figures(v)[f], measured[f]) for f in FIGURES} for k, v in preds.items()
        },
        "notes": notes,
        "snapshot": raw.get("snapshot"),
    }


def render_measure(
    model: ModelSpec,
    train: TrainSpec,
    ledger: Ledger,
    raw: Mapping[str, Any],
    preds: Mapping[str, Ledger],
    notes: list[str],
    *,
    steps: int,
) -> str:
    """The terminal report: environment, per-phase table (measured vs each predictor), errors at the peak, the
    peak phase's items, allocator counters, snapshot and notes."""
    from vramledger.measure.results import FIGURES, ledger_figures, relative_error

    measured = ledger_figures(ledger)
    env = raw.get("environment", {})
    ver = env.get("versions", {})
    lines = [
        f"{model.name} — measured on {env.get('gpu', '?')} (driver {env.get('driver', '?')}, "
        f"torch {ver.get('torch')}, CUDA {ver.get('cuda')}, transformers {ver.get('transformers')}, "
        f"peft {ver.get('peft')}, bitsandbytes {ver.get('bitsandbytes')})",
        f"{train.method.value}, {train.precision.value}, {train.optimizer.value}, "
        f"batch {train.micro_batch} × {train.seq_len} tokens, "
        f"grad ckpt {'on' if train.grad_ckpt else 'off'}, attention {train.attn.value}; {steps} steps",
        "",
    ]
    head = f"{'phase':<10}{'allocated':>13}{'reserved':>13}{'device':>13}"
    for name in preds:
        head += f"   {name + ' alloc':>15}{'err':>8}{'device':>12}{'err':>8}"
    lines.append(head)
    has_context = any(i.category is Category.CUDA_CONTEXT for i in ledger.items)
    for phase in ledger.phases:
        dev = ledger.device(phase) if has_context else None
        row = (
            f"{phase.value:<10}{fmt_bytes(ledger.allocated(phase)):>13}{fmt_bytes(ledger.reserved(phase)):>13}"
            f"{fmt_bytes(dev) if dev is not None else '—':>13}"
        )
        for pred in preds.values():
            if phase in pred.phases:
                pa, pd = pred.allocated(phase), pred.device(phase)
                row += (
                    f"   {fmt_bytes(pa):>15}{_pct(relative_error(pa, ledger.allocated(phase))):>8}"
                    f"{fmt_bytes(pd):>12}{_pct(relative_error(pd, dev)):>8}"
                )
            else:
                row += f"   {'—':>15}{'':>8}{'—':>12}{'':>8}"
        lines.append(row)
    lines.append("")
    for name, pred in preds.items():
        pf = ledger_figures(pred)
        errs = ", ".join(f"{f} {_pct(relative_error(pf[f], measured[f])) or 'n/a'}" for f in FIGURES)
        lines.append(f"{name} error at the peak (predicted − measured) / measured: {errs}")
    peak = max(ledger.phases, key=ledger.allocated)
    lines.append(f"peak allocated {fmt_bytes(ledger.peak_allocated)} in {peak.value}:")
    for item in ledger.items:
        if item.phase is peak:
            lines.append(f"  {item.category.display:<34}{fmt_bytes(item.bytes):>12}  {item.label}")
    counters = raw.get("counters", {})
    lines.append(
        f"allocator retries {counters.get('num_alloc_retries', 0)}, OOMs {counters.get('num_ooms', 0)}; "
        f"trial took {raw.get('wall_s', 0):.1f} s"
    )
    if raw.get("snapshot"):
        lines.append(f"memory snapshot: {raw['snapshot']} (open it at https://pytorch.org/memory_viz)")
    lines += [f"note: {note}" for note in [*notes, *ledger.warnings]]
    return "\n".join(lines)
