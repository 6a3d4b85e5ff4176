"""`vramledger fit`: the largest micro-batch and length that fit, and the batch × length frontier."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from vramledger.cli.args import MAX_BATCH, MAX_FIT_BATCH, count, tokens
from vramledger.cli.common import (
    Inputs,
    add_gpu_options,
    add_model_options,
    add_output_options,
    add_train_options,
    resolve_inputs,
    write_outputs,
)
from vramledger.errors import EXIT_NO, EXIT_OK, VramledgerError

if TYPE_CHECKING:
    from vramledger.plan.frontier import FitReport


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fit",
        help="the largest micro-batch and length that fit on a GPU, and the batch x length frontier",
        description="Where the fit turns into OOM, from the analytic estimate (instant), with the headroom explicit.",
    )
    add_model_options(p)
    add_train_options(p)
    add_gpu_options(p)
    p.add_argument(
        "--granularity",
        type=count(hi=MAX_BATCH, what="token count"),
        default=128,
        help="lengths on multiples of this (default 128)",
    )
    p.add_argument(
        "--max-batch",
        type=count(hi=MAX_FIT_BATCH, what="batch"),
        default=64,
        help="frontier up to this micro-batch (default 64)",
    )
    p.add_argument(
        "--max-len",
        type=tokens(what="length"),
        help="frontier up to this length (default: the model's context)",
    )
    p.add_argument("--exact", action="store_true", help="confirm the frontier's corners by tracing (slow)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_output_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    inputs = resolve_inputs(args)
    report = fit_report(args, inputs)
    from vramledger.report.plan_view import render_fit, to_json

    print(to_json(report) if args.json else render_fit(report))
    if getattr(args, "html", None) or getattr(args, "png", None):
        import sys

        from vramledger.analytic import estimate

        ledger = estimate(inputs.model, inputs.train, gpu=inputs.gpu, headroom=inputs.headroom)
        for path in write_outputs(args, ledger, inputs=inputs):
            print(f"wrote {path}", file=sys.stderr)
    # as every command (vramledger.errors): 3 when the answer is no, here "not even one sequence fits"
    return EXIT_OK if report.frontier.points else EXIT_NO


def fit_report(args: argparse.Namespace, inputs: Inputs) -> FitReport:
    """What ``fit`` prints, for the flags in ``args`` (the config's warnings first)."""
    from vramledger.plan.frontier import fit

    if inputs.gpu is None:
        raise VramledgerError("fit needs a GPU: pass --gpu NAME (see `vramledger gpus`) or a size like --gpu 24GiB")
    report = fit(
        inputs.model,
        inputs.train,
        inputs.gpu,
        inputs.headroom,
        max_batch=args.max_batch,
        granularity=args.granularity,
        max_len=args.max_len,
        exact=args.exact,
    )
    if inputs.warnings:
        from dataclasses import replace

        report = replace(report, warnings=tuple(inputs.warnings) + report.warnings)
    return report
