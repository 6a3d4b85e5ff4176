"""`vramledger convert --to llamafactory|trl|axolotl`: write an equivalent config from flags or another format."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from vramledger.cli.common import add_model_options, add_train_options

    p = sub.add_parser("convert", help="write the setup as a LLaMA-Factory, TRL or axolotl config")
    add_model_options(p)
    add_train_options(p)
    p.add_argument("--to", required=True, help="llamafactory | trl | axolotl")
    p.add_argument("--out", type=Path, help="write to this file (default: standard output)")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from vramledger.adapters.detect import normalise_format
    from vramledger.adapters.writers import TARGETS, dump, write_config
    from vramledger.cli.common import resolve_inputs
    from vramledger.errors import VramledgerError

    fmt = normalise_format(args.to)
    if fmt not in TARGETS:
        raise VramledgerError(f"--to: cannot write {fmt}; choose one of {', '.join(TARGETS)}")
    inputs = resolve_inputs(args)
    model = _model_name(args, inputs.model.name)
    config, notes = write_config(model, inputs.train, fmt)
    header = [f"{fmt} config written by vramledger convert (memory-relevant keys only; add your dataset etc.)"]
    header += [f"note: {n}" for n in notes]
    text = dump(config, header)
    for w in inputs.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if args.out is None:
        sys.stdout.write(text)
    else:
        try:
            args.out.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise VramledgerError(f"--out: cannot write {args.out} ({exc.strerror}); pick another path") from None
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _model_name(args: argparse.Namespace, resolved_name: str) -> str:
    """The model as the user named it (positional argument, else the config's), so that the written file names
    the same hub id or path."""
    if args.model and "=" not in args.model:
        return str(args.model)
    if args.config is not None:
        from vramledger.adapters import load_config

        overrides = [args.model, *args.overrides] if args.model else list(args.overrides)
        name = load_config(
            args.config, fmt=args.format, overrides=overrides, require_model=False, deepspeed=args.deepspeed
        ).model
        if name:
            return name
    return resolved_name
