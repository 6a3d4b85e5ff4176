"""``vramledger trace MODEL``: run the real transformers/PEFT training step on fake tensors and itemise it."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from vramledger.cli.args import out_path
from vramledger.cli.common import add_gpu_options, add_model_options, add_output_options, add_train_options
from vramledger.ledger import Ledger

_TRACE_KEYS = ("allocator", "allocator_default", "top_modules")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace",
        help="trace the real training step on fake tensors (CPU, no GPU, no weights)",
        description="Run two training steps of the real transformers/PEFT code on fake CPU tensors, with the "
        "code paths a CUDA run takes, itemise every allocation, and replay them through PyTorch's caching "
        "allocator (with --gpu: where it would run out of memory).",
    )
    add_model_options(p)
    add_train_options(p)
    add_gpu_options(p)
    p.add_argument(
        "--alloc-conf",
        metavar="CONF",
        help="PYTORCH_CUDA_ALLOC_CONF to replay, e.g. expandable_segments:True (default: the "
        "environment's PYTORCH_CUDA_ALLOC_CONF, else torch's defaults); compared with the defaults",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output (estimate's keys + trace keys)")
    p.add_argument(
        "--snapshot",
        type=out_path,
        metavar="FILE",
        help="write the traced step as a PyTorch memory snapshot (torch.cuda.memory._dump_snapshot's "
        "pickle), taken at the OOM point or the peak: open it at pytorch.org/memory_viz or with "
        "`vramledger explain FILE`",
    )
    p.add_argument("--timeline", action="store_true", help="with --json: include the live-bytes timeline")
    add_output_options(p)
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from vramledger.allocator.conf import parse_alloc_conf
    from vramledger.cli.common import resolve_inputs, show_bars, write_outputs
    from vramledger.report.progress import Progress
    from vramledger.trace import trace_step
    from vramledger.trace.api import trace_step_snapshot

    inputs = resolve_inputs(args)
    conf_text, note = args.alloc_conf, ""
    if conf_text is None and os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        conf_text = os.environ["PYTORCH_CUDA_ALLOC_CONF"]
        note = f"allocator settings from the environment: PYTORCH_CUDA_ALLOC_CONF={conf_text}"
    conf = parse_alloc_conf(conf_text or "")
    snapshot = None
    with Progress(f"tracing {inputs.model.name} on fake tensors (tens of seconds)"):
        if args.snapshot is None:
            ledger = trace_step(inputs.model, inputs.train, gpu=inputs.gpu, headroom=inputs.headroom, alloc_conf=conf)
        else:
            ledger, snapshot = trace_step_snapshot(
                inputs.model, inputs.train, gpu=inputs.gpu, headroom=inputs.headroom, alloc_conf=conf
            )
    ledger = replace(ledger, warnings=tuple(inputs.warnings) + ledger.warnings)
    if args.json:
        import json

        print(json.dumps(trace_json(ledger, timeline=args.timeline), indent=2, default=str))
    else:
        from vramledger.report.terminal import render_ledger
        from vramledger.report.trace_text import render_trace_extras

        versions = ledger.settings.get("versions", "")
        print(render_ledger(ledger, title=f"{ledger.model}  (trace on fake tensors: {versions})"))
        print(render_trace_extras(ledger))
        if note:
            print(note)
        if show_bars(args):
            from vramledger.report.terminal_bars import render_bars

            print()
            print(render_bars(ledger))
    if snapshot is not None:
        import pickle

        from vramledger.userfiles import write_atomic

        print(f"wrote {write_atomic(args.snapshot, pickle.dumps(snapshot), '--snapshot')}", file=sys.stderr)
    for path in write_outputs(args, ledger, inputs=inputs):
        print(f"wrote {path}", file=sys.stderr)
    # As `estimate`: exit 3 when the step does not fit the GPU, so scripts can branch on it.
    return 3 if ledger.verdict is not None and not ledger.verdict.fits else 0


def trace_json(ledger: Ledger, *, timeline: bool = False) -> dict[str, Any]:
    """Estimate's JSON (``report.json_out.ledger_to_dict``) plus the trace-only keys at the top level:
    ``allocator`` (the replay, with ``oom``), ``allocator_default`` (the same under torch's defaults, when
    other settings were given), ``top_modules`` and, asked for, ``timeline``."""
    from vramledger.report.json_out import ledger_to_dict

    out = ledger_to_dict(ledger)
    settings = out["settings"]
    for key in _TRACE_KEYS:
        if key in settings:
            out[key] = settings.pop(key)
    out.setdefault("allocator_default", None)
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
