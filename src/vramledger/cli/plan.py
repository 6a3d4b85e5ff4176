"""`vramledger plan`: configurations that fit, ranked by predicted throughput, and what each remedy costs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from vramledger.cli.args import MAX_BATCH, count, name, out_path
from vramledger.cli.common import (
    add_gpu_options,
    add_model_options,
    add_output_options,
    add_train_options,
    resolve_inputs,
)
from vramledger.errors import EXIT_NO, EXIT_OK, VramledgerError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="configurations that fit on a GPU, fastest first, with each remedy's memory saved and time cost",
        description="Search the remedies (precision, accumulation, checkpointing, loss, optimizer, LoRA/QLoRA, "
        "offload, attention; then shorter sequences and smaller models, flagged) for a GPU.",
    )
    add_model_options(p)
    add_train_options(p)
    add_gpu_options(p)
    p.add_argument(
        "--global-batch",
        type=count(hi=MAX_BATCH, what="batch"),
        help="sequences per optimizer step to keep (default batch x accum)",
    )
    p.add_argument(
        "--granularity",
        type=count(hi=MAX_BATCH, what="token count"),
        default=128,
        help="shorter lengths on multiples of this (default 128)",
    )
    p.add_argument("--top", type=count(hi=1000, what="count"), default=8, help="plans to show (default 8)")
    p.add_argument("--write-config", type=out_path, metavar="FILE", help="write the best plan as a training config")
    p.add_argument(
        "--write-format",
        type=name,
        help="llamafactory | trl | axolotl (default: the --config's format, else llamafactory)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_output_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    inputs = resolve_inputs(args)
    result = plan_result(args, inputs)
    from vramledger.report.plan_view import render_plan, to_json

    print(
        to_json(result)
        if args.json
        else render_plan(result, top=args.top, config_keys=_config_keys(args, inputs, result.best))
    )
    _write_figures(args, inputs, result)
    if args.write_config is not None:
        if result.best is None:
            raise VramledgerError("--write-config: no plan fits, so there is nothing to write", exit_code=EXIT_NO)
        _write_config(args, inputs, result.best)
    return EXIT_OK if result.best is not None else EXIT_NO


def plan_result(args: argparse.Namespace, inputs: Any) -> Any:
    """What ``plan`` prints (a ``plan.planner.Plan``), for the flags in ``args`` (the config's warnings first)."""
    from vramledger.plan.planner import plan

    if inputs.gpu is None:
        raise VramledgerError("plan needs a GPU: pass --gpu NAME (see `vramledger gpus`) or a size like --gpu 24GiB")
    result = plan(
        inputs.model,
        inputs.train,
        inputs.gpu,
        inputs.headroom,
        global_batch=args.global_batch,
        batch_given="micro_batch" in inputs.provenance,
        granularity=args.granularity,
    )
    if inputs.warnings:
        from dataclasses import replace

        result = replace(result, warnings=tuple(inputs.warnings) + result.warnings)
    return result


def _write_config(args: argparse.Namespace, inputs: Any, best: Any) -> None:
    """The best plan as a config: a patch of the user's ``--config`` when its format has a writer and the patch
    reads back as the plan; else a config of the memory keys alone. The model stays the one the user named (a
    catalog short name as the hub id it stands for, which a trainer can load), unless the plan is a smaller model."""
    from vramledger.adapters.writers import TARGETS
    from vramledger.userfiles import write_atomic

    fmt = _write_format(args, inputs)
    model = inputs.model_name if best.model == inputs.model else best.model.name
    if model == inputs.model_name and args.config is None and "/" not in model and not Path(model).exists():
        model = inputs.model.name  # `llama-3-8b` -> meta-llama/Meta-Llama-3-8B
    text: str | None = None
    note = ""
    changes: tuple[str, ...] = ()
    if args.config is not None and fmt == inputs.config_format and not args.deepspeed and not args.accelerate_config:
        from vramledger.adapters._base import apply_overrides, read_mapping
        from vramledger.adapters.patch import patch_config

        raw = read_mapping(args.config)
        overrides = [o for o in args.overrides if "." not in o.partition("=")[0]]
        patched_raw, touched = apply_overrides(raw, overrides)
        try:
            patch = patch_config(
                args.config,
                raw,
                fmt=fmt,
                model=inputs.model_name,
                before=inputs.train,
                after=best.train,
                after_model=model,
                overridden={k: patched_raw[k] for k in touched},
            )
            text, changes, note = patch.text, patch.changes, f"your {args.config} with the plan's changes"
        except VramledgerError as exc:
            note = f"{fmt} memory keys only: {exc}"
    if text is None:
        from vramledger.plan.write import plan_config_text

        text = plan_config_text(model, best.train, fmt=fmt if fmt in TARGETS else "llamafactory")
        note = note or f"{fmt} memory keys only"
    write_atomic(args.write_config, text, "--write-config")
    print(f"\nwrote plan 1 to {args.write_config} ({note})", flush=True)
    for line in changes:
        print(f"  {line}")


def _config_keys(args: argparse.Namespace, inputs: Any, best: Any) -> tuple[str, tuple[str, ...]]:
    """Plan 1 in the user's framework: (format, the ``key: value`` lines its config changes), from the config
    writers (``adapters.writers``); empty when nothing fits or the format cannot express the plan."""
    from vramledger.adapters.patch import changed_keys

    if best is None:
        return "", ()
    fmt = _write_format(args, inputs)
    model = inputs.model_name if best.model == inputs.model else best.model.name
    try:
        return fmt, changed_keys(fmt, inputs.model_name, inputs.train, best.train, after_model=model)
    except VramledgerError:
        return fmt, ()


def _format_of(args: argparse.Namespace) -> str:
    """The format the user came with: --format, or what the adapters detect in --config; else llamafactory."""
    if args.format:
        return str(args.format)
    if args.config is not None:
        from vramledger.adapters._base import read_mapping
        from vramledger.adapters.detect import detect

        try:
            return str(detect(read_mapping(args.config), str(args.config)))
        except VramledgerError:  # unreadable or undetectable: the default writer
            return "llamafactory"
    return "llamafactory"


def _write_format(args: argparse.Namespace, inputs: Any) -> str:
    """--write-format, else the --config's format when it has a writer, else llamafactory."""
    from vramledger.adapters.detect import normalise_format
    from vramledger.adapters.writers import TARGETS

    if args.write_format is not None:
        fmt = normalise_format(args.write_format, option="--write-format")
        if fmt not in TARGETS:
            raise VramledgerError(f"--write-format: cannot write {fmt}; choose one of {', '.join(TARGETS)}")
        return fmt
    return inputs.config_format if inputs.config_format in TARGETS else "llamafactory"


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
