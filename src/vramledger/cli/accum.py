"""`vramledger accum`: each micro-batch x accumulation split of a global batch — memory, time, steps, LR schedule."""

from __future__ import annotations

import argparse

from vramledger.cli.args import MAX_BATCH, count, fraction, name
from vramledger.cli.common import (
    add_gpu_options,
    add_model_options,
    add_train_options,
    resolve_inputs,
)
from vramledger.errors import VramledgerError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "accum",
        help="every micro-batch x accumulation split of a global batch: memory, time per step, LR schedule",
        description="What gradient accumulation saves (one micro-batch's activations), what it costs (time), "
        "and what it changes (optimizer steps, the LR schedule when stepped per micro-batch).",
    )
    add_model_options(p)
    add_train_options(p)
    add_gpu_options(p)
    p.add_argument(
        "--global-batch",
        type=count(hi=MAX_BATCH, what="batch"),
        help="sequences per optimizer step (default batch x accum)",
    )
    p.add_argument(
        "--dataset-size",
        type=count(hi=2**40, what="sample count"),
        help="samples per epoch (default: counts per 1000 samples)",
    )
    p.add_argument("--epochs", type=count(hi=10_000, what="count"), default=1, help="epochs (default 1)")
    p.add_argument(
        "--lr-scheduler", type=name, default="linear", help="linear | cosine | constant (default linear, as HF)"
    )
    p.add_argument("--warmup-ratio", type=fraction, default=0.0, help="warmup fraction of the steps (default 0)")
    p.add_argument("--json", action="store_true", help="machine-readable output (schedules as arrays)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from vramledger.plan.accum import accum_report

    inputs = resolve_inputs(args)
    if inputs.gpu is None:
        raise VramledgerError("accum needs a GPU: pass --gpu NAME (see `vramledger gpus`) or a size like --gpu 24GiB")
    g = args.global_batch or inputs.train.micro_batch * inputs.train.grad_accum
    report = accum_report(
        inputs.model,
        inputs.train,
        inputs.gpu,
        inputs.headroom,
        global_batch=g,
        dataset_size=args.dataset_size,
        epochs=args.epochs,
        scheduler=args.lr_scheduler.strip().lower(),
        warmup_ratio=args.warmup_ratio,
    )
    if inputs.warnings:
        from dataclasses import replace

        report = replace(report, warnings=tuple(inputs.warnings) + report.warnings)
    from vramledger.report.plan_view import render_accum, to_json

    print(to_json(report) if args.json else render_accum(report))
    return 0
