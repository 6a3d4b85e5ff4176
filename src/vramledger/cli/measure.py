"""`vramledger measure`: real training steps on this GPU, the measured ledger beside the estimate."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vramledger.cli.common import add_gpu_options, add_model_options, add_train_options, resolve_inputs
from vramledger.errors import VramledgerError


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "measure",
        help="measure a training step on this GPU (random weights, no download) beside the estimate",
        description="Builds the model from its config with random weights on the GPU, runs real training "
        "steps in a fresh process, and prints peak allocated / reserved / device memory per phase beside the "
        "estimate.",
    )
    add_model_options(p)
    add_train_options(p)
    add_gpu_options(p)
    add_trial_options(p)
    p.add_argument(
        "--snapshot", type=Path, help="also write a CUDA memory snapshot (pickle for pytorch.org/memory_viz)"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=_run)


def add_trial_options(p: argparse.ArgumentParser) -> None:
    from vramledger.measure.harness import DEFAULT_STEPS, DEFAULT_TIMEOUT_S

    g = p.add_argument_group("trials")
    g.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_STEPS,
        help=f"optimizer steps per trial (default {DEFAULT_STEPS})",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds per trial (default {DEFAULT_TIMEOUT_S:g})",
    )


def _pct(e: float | None) -> str:
    return "" if e is None else f"{e * 100:+.1f}%"


def _run(args: argparse.Namespace) -> int:
    from vramledger.measure.harness import measure, require_gpu
    from vramledger.measure.results import FIGURES, ledger_figures, predictions, relative_error
    from vramledger.units import fmt_bytes

    inputs = resolve_inputs(args)
    require_gpu()
    m = measure(inputs.model, inputs.train, steps=args.steps, snapshot=args.snapshot, timeout_s=args.timeout)
    if not m.result.ok or m.ledger is None:
        hint = (
            " (the step does not fit: try `vramledger find-max` for the largest batch that does)"
            if (m.result.status == "oom")
            else ""
        )
        raise VramledgerError(f"measure: trial {m.result.status}: {m.result.error}{hint}", exit_code=1)
    ledger = m.ledger
    preds, notes = predictions(inputs.model, inputs.train, gpu=inputs.gpu, headroom=inputs.headroom)
    measured = ledger_figures(ledger)
    if args.json:
        doc = {
            "measured": measured,
            "items": [
                {"phase": i.phase.value, "category": i.category.value, "bytes": i.bytes, "label": i.label}
                for i in ledger.items
            ],
            "environment": m.result.raw.get("environment", {}),
            "counters": m.result.raw.get("counters", {}),
            "predictions": {k: ledger_figures(v) for k, v in preds.items()},
            "errors": {
                k: {f: relative_error(ledger_figures(v)[f], measured[f]) for f in FIGURES}
                for k, v in preds.items()
            },
            "notes": notes,
            "snapshot": m.result.raw.get("snapshot"),
        }
        print(json.dumps(doc, indent=2, default=str))
        return 0

    env = m.result.raw.get("environment", {})
    ver = env.get("versions", {})
    print(
        f"{inputs.model.name} — measured on {env.get('gpu', '?')} (driver {env.get('driver', '?')}, "
        f"torch {ver.get('torch')}, CUDA {ver.get('cuda')}, transformers {ver.get('transformers')}, "
        f"peft {ver.get('peft')}, bitsandbytes {ver.get('bitsandbytes')})"
    )
    t = inputs.train
    print(
        f"{t.method.value}, {t.precision.value}, {t.optimizer.value}, "
        f"batch {t.micro_batch} × {t.seq_len} tokens, "
        f"grad ckpt {'on' if t.grad_ckpt else 'off'}, attention {t.attn.value}; {args.steps} steps"
    )
    print()
    head = f"{'phase':<10}{'allocated':>13}{'reserved':>13}{'device':>13}"
    for name in preds:
        head += f"   {name + ' alloc':>15}{'err':>8}{'device':>12}{'err':>8}"
    print(head)
    for phase in ledger.phases:
        dev = ledger.device(phase) if any(i.category.value == "cuda_context" for i in ledger.items) else None
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
        print(row)
    print()
    for name, pred in preds.items():
        pf = ledger_figures(pred)
        errs = ", ".join(f"{f} {_pct(relative_error(pf[f], measured[f])) or 'n/a'}" for f in FIGURES)
        print(f"{name} error at the peak (predicted − measured) / measured: {errs}")
    peak = max(ledger.phases, key=ledger.allocated)
    print(f"peak allocated {fmt_bytes(ledger.peak_allocated)} in {peak.value}:")
    for item in ledger.items:
        if item.phase is peak:
            print(f"  {item.category.title:<34}{fmt_bytes(item.bytes):>12}  {item.label}")
    counters = m.result.raw.get("counters", {})
    print(
        f"allocator retries {counters.get('num_alloc_retries', 0)}, OOMs {counters.get('num_ooms', 0)}; "
        f"trial took {m.result.raw.get('wall_s', 0):.1f} s"
    )
    if m.result.raw.get("snapshot"):
        print(f"memory snapshot: {m.result.raw['snapshot']} (open it at https://pytorch.org/memory_viz)")
    for note in notes + list(ledger.warnings):
        print(f"note: {note}")
    return 0
