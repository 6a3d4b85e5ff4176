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

from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.specs import Method, ModelSpec, Precision, Sharding, TrainSpec

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


def mid_fsdp2(method: Method) -> tuple[ModelSpec, TrainSpec]:
    """The grid's mid model under FSDP2 FULL_SHARD on 8 ranks, bf16-mixed, one 1024-token sequence."""
    m = model_spec_from_config(runner().MID, name="mid", source="test")
    t = TrainSpec(
        method=method,
        precision=Precision.BF16_MIXED,
        micro_batch=1,
        seq_len=1024,
        world_size=8,
        fsdp=Sharding.FULL_SHARD,
        fsdp_version=2,
    )
    return m, t
