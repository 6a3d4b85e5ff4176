"""`vramledger convert --to llamafactory|trl|axolotl`: write an equivalent config from flags or another format."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    from vramledger.cli.args import name, out_path
    from vramledger.cli.common import add_force_option, add_model_options, add_train_options

    p = sub.add_parser("convert", help="write the setup as a LLaMA-Factory, TRL or axolotl config")
    add_model_options(p)
    add_train_options(p)
    p.add_argument("--to", required=True, type=name, help="llamafactory | trl | axolotl")
    p.add_argument("--out", type=out_path, help="write to this file (default: standard output)")
    add_force_option(p)
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from vramledger.adapters.detect import normalise_format
    from vramledger.adapters.writers import TARGETS, dump, write_config
    from vramledger.cli.common import resolve_inputs
    from vramledger.errors import VramledgerError
    from vramledger.userfiles import write_atomic

    fmt = normalise_format(args.to, option="--to", choices=TARGETS)
    if fmt not in TARGETS:
        raise VramledgerError(f"--to: cannot write {fmt}; choose one of {', '.join(TARGETS)}")
    inputs = resolve_inputs(args)
    config, notes = write_config(inputs.model_name, inputs.train, fmt)
    header = [f"{fmt} config written by vramledger convert (memory-relevant keys only; add your dataset etc.)"]
    header += [f"note: {n}" for n in notes]
    text = dump(config, header)
    for w in inputs.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if args.out is None:
        sys.stdout.write(text)
    else:
        write_atomic(args.out, text, "--out")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0
