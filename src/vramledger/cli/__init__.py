"""The command line: parses arguments, calls the library, hands the result to ``report``.

Each command lives in its own module under ``vramledger.cli`` with ``register(subparsers)``; the module
imports nothing heavy at import time, so ``vramledger estimate`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from vramledger._version import __version__
from vramledger.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_UNEXPECTED, VramledgerError

# Command modules, in the order `vramledger --help` lists them: a module of this package, or a dotted path for a
# front end that sits above the CLI and reuses its parser (the ui package imports cli; cli never imports it).
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
    "vramledger.ui.command",
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
        importlib.import_module(name if "." in name else f"vramledger.cli.{name}").register(sub)
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, a mistyped flag answered with the command's closest one and its own ``--help``."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        raise VramledgerError(_unrecognized(extra, _command_parser(parser, args.command)))
    return args


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The subcommand's own parser (its options are what a mistyped flag is compared with)."""
    for action in parser._actions:  # noqa: SLF001 - argparse keeps its subparsers only here
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return action.choices[command]
    return parser


def _unrecognized(extra: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """argparse's "unrecognized arguments" line, with the closest flag of the command for each mistyped one."""
    import difflib

    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]  # noqa: SLF001
    hints = []
    for arg in extra:
        flag = arg.split("=", 1)[0]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.7) if flag.startswith("--") else []
        if close:
            hints.append(f"{flag}: did you mean {close[0]}?")
    hint = f"; {'; '.join(hints)}" if hints else ""
    return f"unrecognized arguments: {' '.join(extra)}{hint} (see `{parser.prog} --help`)"


def _one_line(message: str) -> str:
    """The message with every control character escaped: what the user typed may hold newlines or \\x1e."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return its exit code (``vramledger.errors``: 0 yes, 3 no, 2 bad input, 1 unexpected).

    Every error is one ``error:`` line on stderr; a bug (any other exception) too, with its type, unless
    ``VRAMLEDGER_DEBUG=1`` asks for the traceback.
    """
    import os

    from vramledger.cli.common import check_outputs

    try:
        args = parse(build_parser(), argv)
        check_outputs(args)
        code = int(args.run(args) or EXIT_OK)
        if getattr(args, "notes", ()):  # set by resolve_inputs: printed once the command has answered
            from vramledger.report.terminal import wrap

            for note in args.notes:
                print(wrap(f"note: {note}"), file=sys.stderr)
        return code
    except VramledgerError as exc:
        print(f"error: {_one_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except RecursionError:
        print("error: the input is nested too deeply to process; simplify it", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:  # noqa: BLE001 - a bug: one line, exit 1, the traceback on request
        if os.environ.get("VRAMLEDGER_DEBUG"):
            raise
        print(
            f"error: unexpected {type(exc).__name__}: {_one_line(str(exc))[:200]} (a bug in vramledger {__version__}; "
            "please report it with the command; VRAMLEDGER_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return EXIT_UNEXPECTED
