"""The committed distributed grid (bench/distributed/grid.jsonl) and the runner that wrote it, for the tests that
hold the estimate to it (test_distributed_grid.py, test_stream_pools.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

from vramledger.specs import ModelSpec, TrainSpec

ROOT = Path(__file__).resolve().parents[2]
GRID = ROOT / "bench" / "distributed" / "grid.jsonl"


@cache
def runner() -> ModuleType:
    """bench/distributed/run_grid.py, loaded under its own name (bench/reserve has a run_grid.py too)."""
    path = ROOT / "bench" / "distributed" / "run_grid.py"
    spec = importlib.util.spec_from_file_location("distributed_run_grid", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["distributed_run_grid"] = mod
    spec.loader.exec_module(mod)
    return mod


def records() -> list[dict[str, Any]]:
    """Every committed row."""
    return [json.loads(line) for line in GRID.read_text().splitlines() if line.strip()]


def specs(rec: dict[str, Any]) -> tuple[ModelSpec, TrainSpec]:
    """The model and training specs a row was traced with."""
    run = runner()
    row = next(r for r in run.GRID if run._id(r) == rec["id"])
    m, t, _ = run._specs(row)
    return m, t
