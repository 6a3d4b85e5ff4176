"""`vramledger estimate`: the analytic ledger, instant and offline."""

from __future__ import annotations

import argparse
import sys

from vramledger.cli.common import (
    add_gpu_options,
    add_model_options,
    add_output_options,
    add_train_options,
    resolve_inputs,
    show_bars,
    write_outputs,
)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "estimate",
        help="itemised GPU memory of a training step, per category and phase, and the verdict for a GPU",
        description="Estimate the GPU memory of one training step from formulas (instant, offline, no torch).",
    )
    add_model_options(p)
    add_train_options(p)
    add_gpu_options(p)
    p.add_argument("--json", action="store_true", help="print the ledger as JSON")
    p.add_argument("--sources", action="store_true", help="list every line of the peak with its formula and source")
    add_output_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from vramledger.analytic import estimate

    inputs = resolve_inputs(args)
    ledger = estimate(inputs.model, inputs.train, gpu=inputs.gpu, headroom=inputs.headroom)
    if inputs.warnings:
        from dataclasses import replace

        ledger = replace(ledger, warnings=tuple(inputs.warnings) + ledger.warnings)
    if args.json:
        from vramledger.report.json_out import dumps

        print(dumps(ledger))
    else:
        from vramledger.report.terminal import render_ledger, render_provenance, render_sources

        print(render_ledger(ledger))
        if show_bars(args):
            from vramledger.report.terminal_bars import render_bars

            print()
            print(render_bars(ledger))
        if any(v != "flag" for v in inputs.provenance.values()):
            print()
            print(render_provenance(inputs.provenance))
        if args.sources:
            print()
            print(render_sources(ledger))
    for path in write_outputs(args, ledger, inputs=inputs):
        print(f"wrote {path}", file=sys.stderr)
    if ledger.verdict is not None and not ledger.verdict.fits:
        return 3
    return 0
