"""`vramledger models` and `vramledger gpus`: what the bundled catalog holds."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the bundled model catalog")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=_models)
    g = sub.add_parser("gpus", help="list the bundled GPU catalog")
    g.add_argument("--json", action="store_true", help="machine-readable output")
    g.set_defaults(run=_gpus)


def _models(args: argparse.Namespace) -> int:
    from vramledger.report.catalog import print_models

    print_models(as_json=args.json)
    return 0


def _gpus(args: argparse.Namespace) -> int:
    from vramledger.report.catalog import print_gpus

    print_gpus(as_json=args.json)
    return 0
