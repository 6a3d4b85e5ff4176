"""What the server refuses: big bodies, non-JSON posts, foreign Host headers, paths in requests, flags that would
write files or trace; and the static page: served from the package, with no URL to anywhere but this server."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from vramledger.ui.server import MAX_BODY


def _raw_post(server, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    host, port = urlsplit(server.url).hostname, urlsplit(server.url).port
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.putrequest("POST", path, skip_host="Host" in headers)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders()
        # the server may answer and close before reading it all: what a refusal looks like
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.send(body)
        res = conn.getresponse()
        return res.status, res.read()
    finally:
        conn.close()


def test_a_body_over_the_limit_is_refused_unread(server):
    body = json.dumps({"model": "gpt2", "pad": "x" * MAX_BODY}).encode()
    status, raw = _raw_post(
        server, "/api/estimate", body, {"Content-Type": "application/json", "Content-Length": str(len(body))}
    )
    assert status == 413
    assert f"over the limit of {MAX_BODY} bytes" in json.loads(raw)["error"]


def test_a_body_just_under_the_limit_is_read(client):
    pad = MAX_BODY - 200
    status, raw = client.post("estimate", {"model": "gpt2", "overrides": [], "model_config_name": "x" * pad})
    assert status == 200, raw[:300]


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", ""])
def test_only_json_posts(server, ctype):
    """A cross-site form or text/plain post (no CORS preflight) is refused before it is read."""
    body = b'{"model": "gpt2"}'
    headers = {"Content-Length": str(len(body))} | ({"Content-Type": ctype} if ctype else {})
    status, _ = _raw_post(server, "/api/estimate", body, headers)
    assert status == 415


def test_a_foreign_host_is_refused(server):
    """DNS rebinding: a page served from evil.example that resolves to 127.0.0.1 sends its own Host."""
    body = b'{"model": "gpt2"}'
    status, _ = _raw_post(
        server,
        "/api/estimate",
        body,
        {"Host": "evil.example:80", "Content-Type": "application/json", "Content-Length": str(len(body))},
    )
    assert status == 403


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"model": "/etc/hostname"}, "model"),
        ({"model": "../../config.json"}, "model"),
        ({"model": "gpt2", "config": "/etc/hostname"}, "--config"),
        ({"model": "gpt2", "deepspeed": "ds.json"}, "--deepspeed"),
        ({"model": "gpt2", "accelerate_config": "fsdp.yaml"}, "--accelerate-config"),
        ({"model": "gpt2", "exact": True}, "--exact"),
        ({"model": "gpt2", "help": True}, "--help"),
        ({"model": "--help"}, "model"),
        ({"model": "gpt2", "overrides": ["--help"]}, "overrides"),
        (
            {"config_text": "model_name_or_path: gpt2\ndeepspeed: /etc/ds_z3.json\n", "config_name": "a.yaml"},
            "deepspeed",
        ),
        ({"config_text": "model_name_or_path: /home/me/llama\n", "config_name": "a.yaml"}, "model_name_or_path"),
    ],
)
def test_requests_never_name_a_path(client, body, named):
    status, raw = client.post("estimate", body)
    message = json.loads(raw)["error"]
    print(message)
    assert status == 400
    assert named in message


@pytest.mark.parametrize("command", ["fit", "plan"])
def test_output_flags_are_refused_and_nothing_is_written(client, tmp_path, command):
    target = tmp_path / "report.html"
    status, raw = client.post(
        command,
        {
            "model": "gpt2",
            "gpu": "rtx-4090",
            "html": str(target),
            "png": str(tmp_path),
            "write_config": str(tmp_path / "plan.yaml"),
        },
    )
    assert status == 400
    assert "not accepted over HTTP" in json.loads(raw)["error"]
    assert list(tmp_path.iterdir()) == []


def test_a_value_cannot_smuggle_a_flag(client):
    """``--method=--help`` is one token: argparse sees a bad method, not a request for help."""
    status, raw = client.post("estimate", {"model": "gpt2", "method": "--help"})
    assert status == 400
    assert "--method: unknown value '--help'" in json.loads(raw)["error"]


def test_unknown_endpoints_and_methods(client):
    assert client.post("shell", {})[0] == 404
    assert client.get("/api/estimate")[0] == 405
    assert client.get("/static/../request.py")[0] == 404
    assert client.get("/etc/passwd")[0] == 404


# -- the static page -----------------------------------------------------------------------------------------------
PAGE = ["/", "/static/app.js", "/static/app.css"]
_URL = re.compile(r"(https?:)?//[\w.-]+", re.I)


@pytest.mark.parametrize("path", PAGE)
def test_the_page_names_no_other_origin(client, path):
    status, headers, raw = client.get(path)
    text = raw.decode("utf-8")
    assert status == 200
    found = [m.group(0) for m in re.finditer(r"https?://[^\s\"'<>)]+", text)]
    assert [u for u in found if urlsplit(u).hostname not in ("localhost", "127.0.0.1")] == []
    # every src/href/url() names this server (a path), never a host
    refs = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)""", text) + re.findall(r"url\(([^)]+)\)", text)
    assert all(r.startswith("/") and not r.startswith("//") for r in refs), refs
    assert "@import" not in text
    csp = headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "http" not in csp


def test_the_page_is_the_packaged_files(client):
    """What is served is the package's static folder, byte for byte (pyproject ships it as package data)."""
    static = Path(__file__).resolve().parents[2] / "src" / "vramledger" / "ui" / "static"
    for path, name in (("/", "index.html"), ("/static/app.js", "app.js"), ("/static/app.css", "app.css")):
        assert client.get(path)[2] == (static / name).read_bytes()
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '"ui/static/*"' in pyproject
