"""`vramledger plan`: configurations that fit, ranked by predicted throughput, and what each remedy costs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from vramledger.cli.common import (
    add_gpu_options,
    add_model_options,
    add_output_options,
    add_train_options,
    resolve_inputs,
)
from vramledger.errors import VramledgerError


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "plan",
        help="configurations that fit on a GPU, fastest first, with each remedy's memory saved and time cost",
        description="Search the remedies (precision, accumulation, checkpointing, loss, optimizer, LoRA/QLoRA, "
        "offload, attention; then shorter sequences and smaller models, flagged) for a GPU.",
    )
    add_model_options(p)
    add_train_options(p)
    add_gpu_options(p)
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step to keep (default batch x accum)")
    p.add_argument("--granularity", type=int, default=128, help="shorter lengths on multiples of this (default 128)")
    p.add_argument("--top", type=int, default=8, help="plans to show (default 8)")
    p.add_argument("--write-config", type=Path, metavar="FILE", help="write the best plan as a training config")
    p.add_argument("--write-format", help="llamafactory | trl | axolotl (default: the --config's format, "
                   "else llamafactory)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_output_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    inputs = resolve_inputs(args)
    result = plan_result(args, inputs)
    from vramledger.report.plan_view import render_plan, to_json

    print(to_json(result) if args.json else render_plan(result, top=args.top))
    _write_figures(args, inputs, result)
    if args.write_config is not None:
        from vramledger.plan.write import write_plan_config

        if result.best is None:
            raise VramledgerError("--write-config: no plan fits, so there is nothing to write", exit_code=1)
        fmt = args.write_format or _format_of(args)
        note = write_plan_config(result.best.model.name, result.best.train, args.write_config, fmt=fmt)
        print(f"\nwrote plan 1 to {args.write_config} ({note})", flush=True)
    return 0 if result.best is not None else 3


def plan_result(args: argparse.Namespace, inputs: Any) -> Any:
    """What ``plan`` prints (a ``plan.planner.Plan``), for the flags in ``args`` (the config's warnings first)."""
    from vramledger.plan.planner import plan

    if inputs.gpu is None:
        raise VramledgerError("plan needs a GPU: pass --gpu NAME (see `vramledger gpus`) or a size like --gpu 24GiB")
    result = plan(inputs.model, inputs.train, inputs.gpu, inputs.headroom, global_batch=args.global_batch,
                  batch_given="micro_batch" in inputs.provenance, granularity=args.granularity)
    if inputs.warnings:
        from dataclasses import replace

        result = replace(result, warnings=tuple(inputs.warnings) + result.warnings)
    return result


def _format_of(args: argparse.Namespace) -> str:
    """The format the user came with: --format, or what the adapters detect in --config; else llamafactory."""
    if args.format:
        return str(args.format)
    if args.config is not None:
        try:
            import yaml

            from vramledger.adapters.detect import detect

            raw = yaml.safe_load(Path(args.config).read_text())
            return str(detect(raw, str(args.config)))
        except Exception:  # noqa: BLE001 - any failure falls back to the default writer
            return "llamafactory"
    return "llamafactory"


def _write_figures(args: argparse.Namespace, inputs: Any, result: Any) -> None:
    """--html/--png: the user's setup's bill and cliff, plus memory against step time for each remedy."""
    import sys

    from vramledger.analytic import estimate
    from vramledger.cli.common import write_outputs

    if not (getattr(args, "html", None) or getattr(args, "png", None)):
        return
    ledger = estimate(inputs.model, inputs.train, gpu=inputs.gpu, headroom=inputs.headroom)
    remedies = [("your setup", result.baseline.device_total, result.baseline.time.step_s)]
    remedies += [(f"{r.title}: {r.change.after}", r.device_total, r.step_s) for r in result.remedies]
    remedies += [(f"plan {i}", c.device_total, c.time.step_s) for i, c in enumerate(result.candidates[:3], 1)]
    for path in write_outputs(args, ledger, inputs=inputs, remedies=remedies):
        print(f"wrote {path}", file=sys.stderr)
