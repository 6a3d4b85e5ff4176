"""`vramledger trace` on a config.json: exit code, the table's peak line, and the JSON keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.trace._trace_tiny import TINY
from vramledger.cli import main


def test_trace_cli_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY["qwen2"]))
    assert main(["trace", str(cfg), "--method", "lora", "--batch", "2", "--seq", "40", "--gpu", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert "peak:" in out and "top allocating modules" in out and "no OOM" in out
    assert main(["trace", str(cfg), "--method", "full", "--seq", "40", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["engine"] == "trace"
    assert {"items", "phases", "peak_allocated_bytes", "allocator", "top_modules", "warnings", "settings"} <= set(data)
    assert data["peak_allocated_bytes"] == max(p["allocated_bytes"] for p in data["phases"].values())


def test_trace_cli_rejects_bnb_optimizer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "gpt2", "--optimizer", "adamw_8bit", "--seq", "40"]) == 2
    assert "bitsandbytes" in capsys.readouterr().err
