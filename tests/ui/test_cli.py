"""`vramledger ui` as a user starts it: the address on stdout, the page there; bad input is one line, exit 2."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

from tests.ui.conftest import EXAMPLE, run_cli

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_ui_serves_the_page_until_stopped():
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vramledger", "ui", "--no-browser", "--port", "0", "--config", str(EXAMPLE)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        print(line)
        assert line.startswith("vramledger ui: http://127.0.0.1:")
        url = line.split()[2]
        with urllib.request.urlopen(url, timeout=30) as res:
            assert res.status == 200
            assert b"<title>vramledger</title>" in res.read()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_bad_config_is_reported_before_serving(capsys, tmp_path):
    bad = tmp_path / "train.yaml"
    bad.write_text("per_device_train_batch_size: [1, 2\n")
    code, out, err = run_cli(capsys, ["ui", "--no-browser", "--config", str(bad)])
    assert code == 2 and out == ""
    assert err.startswith("error: config: ") and "not valid YAML" in err and len(err.strip().splitlines()) == 1


def test_a_busy_port_names_the_fix(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, _, err = run_cli(capsys, ["ui", "--no-browser", "--port", str(port)])
    assert code == 2
    assert f"--port {port}: cannot listen" in err and "--port 0" in err
