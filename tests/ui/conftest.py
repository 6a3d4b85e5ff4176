"""A real server on a free port in a thread, started with the docs' LLaMA-Factory example as its --config, and
helpers that make real HTTP requests with urllib (no test client: the bytes on the wire are what is checked)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vramledger.cli import main
from vramledger.ui.server import UIServer, make_server, serve_in_thread

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama3_lora_sft.yaml"


@pytest.fixture(scope="session")
def server() -> Iterator[UIServer]:
    srv = make_server("127.0.0.1", 0, config=EXAMPLE)
    serve_in_thread(srv)
    yield srv
    srv.shutdown()
    srv.server_close()


class Client:
    def __init__(self, url: str) -> None:
        self.url = url

    def request(
        self, method: str, path: str, data: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        req = urllib.request.Request(self.url.rstrip("/") + path, data=data, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=60) as res:
                return res.status, dict(res.headers), res.read()
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), err.read()

    def post(self, endpoint: str, body: Any) -> tuple[int, bytes]:
        status, _, raw = self.request(
            "POST", f"/api/{endpoint}", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        return status, raw

    def get(self, path: str) -> tuple[int, dict[str, str], bytes]:
        return self.request("GET", path)


@pytest.fixture(scope="session")
def client(server: UIServer) -> Client:
    return Client(server.url)


def run_cli(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    """The CLI in-process, as a user runs it: exit code, stdout, stderr."""
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err
