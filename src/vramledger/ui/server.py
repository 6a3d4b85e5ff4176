"""The local server: the standard library's ``http.server``, one thread per request, nothing else to install.

What it guards against, since any web page the user visits can send requests to a port on localhost:
- it binds 127.0.0.1 unless told otherwise, and on a loopback address it answers only requests whose ``Host`` is
  a loopback name (a DNS-rebinding page arrives with its own host name);
- a POST must be ``application/json`` (a cross-site form or ``text/plain`` post is refused: a browser sends JSON
  to another origin only after a CORS preflight, which this server never grants);
- a body over ``MAX_BODY`` bytes is refused before it is read;
- the only files it serves are the three in ``ui/static`` (by name, from a fixed list); requests never name a
  path (see ``ui.request``), and it writes nothing: exports go back to the browser as text;
- every response carries a Content-Security-Policy that allows this origin only, so the page cannot load or
  send anything elsewhere.
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any

from vramledger.ui.api import Answer, Api

MAX_BODY = 256 * 1024
"""Largest request body, in bytes: a dropped training config and config.json are a few KiB."""

STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/app.css": ("app.css", "text/css; charset=utf-8"),
}
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def _static(name: str) -> bytes:
    return resources.files("vramledger.ui").joinpath("static").joinpath(name).read_bytes()


class UIServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` holding the API and whether to check the Host header."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], api: Api, *, quiet: bool = True) -> None:
        super().__init__(address, Handler)
        self.api = api
        self.quiet = quiet
        self.check_host = address[0] in LOOPBACK

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A browser that closed its connection mid-answer (a tab closed, a request superseded) is no error."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else str(host)
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/"


class Handler(BaseHTTPRequestHandler):
    server: UIServer
    server_version = "vramledger-ui"
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    """Headers and body leave in two writes; with Nagle on, a kept-alive connection waits for the browser's delayed
    ACK (40 ms on Linux) before the body goes out (socketserver.StreamRequestHandler sets TCP_NODELAY)."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the signature of the base class
        if not self.server.quiet:
            sys.stderr.write(f"{self.address_string()} {format % args}\n")

    def _send(self, answer: Answer, *, cache: bool = False) -> None:
        self.send_response(answer.status)
        self.send_header("Content-Type", answer.media_type)
        self.send_header("Content-Length", str(len(answer.body)))
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Cache-Control", "max-age=60" if cache else "no-store")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(answer.body)

    def _refuse(self, status: int, message: str) -> None:
        body = (json.dumps({"error": f"error: {message}"}) + "\n").encode()
        self._send(Answer(status=status, body=body))

    def _host_ok(self) -> bool:
        if not self.server.check_host:
            return True
        host = (self.headers.get("Host") or "").strip().lower()
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        return name in LOOPBACK

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if not self._host_ok():
            return self._refuse(403, "this server answers only on localhost (Host header refused)")
        path = self.path.split("?", 1)[0]
        if path == "/api/meta":
            return self._send(self.server.api.meta())
        if path in STATIC:
            name, media = STATIC[path]
            return self._send(Answer(status=200, body=_static(name), media_type=media))
        if path == "/favicon.ico":
            return self._send(Answer(status=204, body=b""), cache=True)
        if path.startswith("/api/"):
            return self._refuse(405, f"{path} takes POST with a JSON body; see docs/ui.md")
        return self._refuse(404, f"nothing at {path}")

    do_HEAD = do_GET

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        if not self._host_ok():
            return self._refuse(403, "this server answers only on localhost (Host header refused)")
        path = self.path.split("?", 1)[0]
        if not path.startswith("/api/"):
            return self._refuse(404, f"nothing at {path}")
        if (self.headers.get("Content-Type") or "").split(";")[0].strip().lower() != "application/json":
            return self._refuse(415, "send the request as JSON (Content-Type: application/json)")
        try:
            length = int(self.headers.get("Content-Length") or "-1")
        except ValueError:
            length = -1
        if length < 0:
            return self._refuse(411, "the request needs a Content-Length")
        if length > MAX_BODY:
            self.close_connection = True  # the body is left unread
            return self._refuse(413, f"request body of {length} bytes is over the limit of {MAX_BODY} bytes")
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return self._refuse(400, f"request: not valid JSON ({exc}); send a JSON object")
        try:
            answer = self.server.api.handle(path[len("/api/") :], body)
        except Exception as exc:  # noqa: BLE001 - one bad request must not take the server down
            return self._refuse(500, f"unexpected failure: {exc.__class__.__name__}: {exc}")
        self._send(answer)


def make_server(host: str = "127.0.0.1", port: int = 0, *, config: Path | None = None, quiet: bool = True) -> UIServer:
    """A server bound to ``host:port`` (0: a free port), not yet serving: call ``serve_forever``."""
    return UIServer((host, port), Api(startup_config=config), quiet=quiet)


def serve_in_thread(server: UIServer) -> threading.Thread:
    """Serve from a daemon thread (tests and the benchmark); stop with ``server.shutdown()``."""
    thread = threading.Thread(target=server.serve_forever, name="vramledger-ui", daemon=True)
    thread.start()
    return thread
