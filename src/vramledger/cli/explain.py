"""``vramledger explain EVIDENCE``: what a crash left behind — an OOM message, a log, a memory snapshot, the
callback's JSONL — turned into a post-mortem, compared with the prediction when the setup is given."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vramledger.cli.common import add_gpu_options, add_model_options, add_train_options


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explain",
        help="explain an OOM: an error message, a log, a memory snapshot or the callback's JSONL (no GPU needed)",
        description="Read the evidence of an out-of-memory failure and say where the memory went, whether "
        "fragmentation is the cause, and (with the model and --config or flags) how it compares with the "
        "prediction and what the cheapest fix costs.",
    )
    p.add_argument(
        "evidence",
        help="a file (snapshot .pickle[.gz]/.json[.gz], log, JSONL, ground-truth oom_*.json), "
        "'-' for standard input, or the error text itself in quotes",
    )
    add_model_options(p)
    add_train_options(p)
    add_gpu_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--html", type=Path, metavar="FILE", help="also write the post-mortem as a self-contained HTML page")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from vramledger.explain import explain, read_evidence, read_evidence_text
    from vramledger.report.postmortem import dumps, render_postmortem

    if args.evidence == "-":
        ev = read_evidence_text(sys.stdin.read(), source="standard input")
    elif "Tried to allocate" in args.evidence:
        ev = read_evidence_text(args.evidence, source="the message given")
    else:
        ev = read_evidence(Path(args.evidence))
    setup = {}
    if args.model or args.config or args.deepspeed or args.accelerate_config:
        from vramledger.cli.common import resolve_inputs
        from vramledger.cli.plan import _format_of

        inputs = resolve_inputs(args)
        setup = {
            "model": inputs.model,
            "train": inputs.train,
            "gpu": inputs.gpu,
            "headroom": inputs.headroom,
            "fmt": _format_of(args),
        }
    pm = explain(ev, **setup)  # type: ignore[arg-type]
    print(dumps(pm) if args.json else render_postmortem(pm))
    if args.html is not None:
        from vramledger.report.postmortem_html import write_postmortem_html

        print(f"wrote {write_postmortem_html(args.html, pm)}", file=sys.stderr)
    return 0
