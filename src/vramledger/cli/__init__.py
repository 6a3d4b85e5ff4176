"""The command line: parses arguments, calls the library, hands the result to ``report``.

Each command lives in its own module under ``vramledger.cli`` with ``register(subparsers)``; the module
imports nothing heavy at import time, so ``vramledger estimate`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from vramledger import __version__
from vramledger.errors import VramledgerError

# Command modules, in the order `vramledger --help` lists them.
COMMANDS: tuple[str, ...] = (
    "estimate",
    "trace",
    "simulate",
    "fit",
    "plan",
    "accum",
    "measure",
    "find_max",
    "catalog_cmds",
    "accum_check",
    "convert",
    "explain",
    "ui",
)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument as one line (exit 2) instead of usage + message."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise VramledgerError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="vramledger",
        description="Where did my GPU memory go? An itemised VRAM ledger for LLM fine-tuning.",
    )
    parser.add_argument("--version", action="version", version=f"vramledger {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"vramledger.cli.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return int(args.run(args) or 0)
    except VramledgerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
