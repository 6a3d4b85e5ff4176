"""`vramledger estimate --html/--png/--bars`: files written, exit codes, stdout kept clean for --json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vramledger.cli import main

ARGS = [
    "estimate",
    "llama-3-8b",
    "--method",
    "lora",
    "--batch",
    "4",
    "--seq",
    "2048",
    "--grad-ckpt",
    "--gpu",
    "rtx-4090",
]


@pytest.mark.slow
def test_html_and_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    page, pngs = tmp_path / "r.html", tmp_path / "figs"
    rc = main([*ARGS, "--json", "--html", str(page), "--png", str(pngs)])
    assert rc == 3  # does not fit a 4090: the exit code says so, with or without reports
    out, err = capsys.readouterr()
    assert json.loads(out)["device_total_bytes"] > 0  # stdout stays pure JSON
    assert f"wrote {page}" in err
    assert page.read_text().startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in pngs.iterdir()) == ["bill.png", "cliff_curves.png", "cliff_grid.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in pngs.iterdir())


def test_bars_flag(capsys):
    assert main([*ARGS, "--bars"]) == 3
    out = capsys.readouterr().out
    assert "the bill: device memory at each phase's peak on NVIDIA GeForce RTX 4090" in out
    assert main(ARGS) == 3
    assert "the bill:" not in capsys.readouterr().out  # not a terminal (pytest captures): no bars by default


def test_missing_matplotlib_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main([*ARGS, "--png", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install 'vramledger[report]'" in err


def test_json_does_not_import_matplotlib():
    src = str(Path(__file__).resolve().parents[2] / "src")
    argv = [*ARGS, "--json"]
    code = f"import sys; from vramledger.cli import main; main({argv!r}); print('MPL', 'matplotlib' in sys.modules)"
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": src}
    )
    assert res.stdout.strip().endswith("MPL False"), res.stderr
