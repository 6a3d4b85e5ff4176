"""`vramledger estimate`: the analytic ledger, instant and offline."""

from __future__ import annotations

import argparse

from vramledger.cli.common import add_gpu_options, add_model_options, add_train_options, resolve_inputs


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
        if inputs.provenance:
            print()
            print(render_provenance(inputs.provenance))
        if args.sources:
            print()
            print(render_sources(ledger))
    if ledger.verdict is not None and not ledger.verdict.fits:
        return 3
    return 0
