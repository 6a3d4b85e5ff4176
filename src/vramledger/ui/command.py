"""`vramledger ui`: a local page where batch, length and every remedy move the bill live."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vramledger.errors import VramledgerError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ui",
        help="a local page: sliders and toggles that move the bill, the cliff and the remedies live",
        description="Start a local server and open the page (works offline; the standard library only). "
        "The JSON API it serves is documented in docs/ui.md.",
    )
    p.add_argument(
        "--config",
        type=Path,
        help="a training config to open the page with (LLaMA-Factory, HF, TRL, "
        "axolotl, torchtune); its settings and their sources are shown",
    )
    p.add_argument("--format", help="the config's kind, when it cannot be detected from its content")
    p.add_argument("--port", type=int, default=8765, help="port to listen on (default 8765; 0 picks a free one)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 shares it on your network)",
    )
    p.add_argument("--no-browser", action="store_true", help="do not open a browser; print the address only")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from vramledger.ui.request import resolve
    from vramledger.ui.server import make_server

    if args.config is not None:  # a bad config is reported now, as every command does, not on the page
        body = {"startup_config": True, "format": args.format}
        resolve("estimate", body, startup_config=args.config)
    if not 0 <= args.port < 65536:
        raise VramledgerError(f"--port must be in 0-65535 (got {args.port}); e.g. --port 8765")
    try:
        server = make_server(args.host, args.port, config=args.config)
    except OSError as exc:
        raise VramledgerError(
            f"--port {args.port}: cannot listen on {args.host} ({exc.strerror}); "
            "pick another port (--port 0 picks a free one)"
        ) from None
    print(f"vramledger ui: {server.url}  (Ctrl-C stops it)", flush=True)
    if not args.no_browser:
        import webbrowser

        webbrowser.open(server.url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    finally:
        server.server_close()
    return 0
