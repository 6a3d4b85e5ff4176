"""GPU check of the allocator model: replay torch's own alloc/free trace, compare with memory_stats.

Run on a CUDA machine: ``python -m pytest tests/trace/test_allocator_gpu.py -m gpu -s``; set
``VRAMLEDGER_ALLOC_CSV=path.csv`` to keep the per-configuration results (commit them as data). Skipped without
a GPU. The CPU test below checks how a snapshot's trace becomes events.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vramledger.allocator.gpucheck import CONFIGS, events_from_snapshot
from vramledger.allocator.replay import EventKind


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def test_events_from_snapshot_pairs_allocs_and_completed_frees() -> None:
    # The snapshot's device trace: alloc/free_completed carry the address and requested size; segment_* and
    # free_requested entries are skipped; an address is reused after its free completes.
    snap = {
        "device_traces": [
            [
                {"action": "segment_alloc", "addr": 100, "size": 2097152},
                {"action": "alloc", "addr": 100, "size": 1000},
                {"action": "alloc", "addr": 612, "size": 10},
                {"action": "free_requested", "addr": 100, "size": 1000},
                {"action": "free_completed", "addr": 100, "size": 1000},
                {"action": "alloc", "addr": 100, "size": 20},
                {"action": "free_completed", "addr": 9999, "size": 5},
            ]
        ]
    }
    events, unmatched = events_from_snapshot(snap)
    assert [(e.kind, e.id, e.size) for e in events] == [
        (EventKind.ALLOC, 0, 1000),
        (EventKind.ALLOC, 1, 10),
        (EventKind.FREE, 0, 0),
        (EventKind.ALLOC, 3, 20),
    ]
    assert unmatched == 1


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_replayed_peak_reserved_matches_torch(tmp_path: Path) -> None:
    rows = []
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for name in CONFIGS:
        out = tmp_path / f"{name}.json"
        proc = subprocess.run(
            [sys.executable, "-m", "vramledger.allocator.gpucheck", name, str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        r = json.loads(out.read_text())
        row = {k: v for k, v in r.items() if k != "config"} | {
            "name": name,
            "alloc_conf": r["config"]["alloc_conf"],
        }
        rows.append(row)
        print(
            f"{name}: torch {r['torch_peak_reserved']} model {r['model_peak_reserved']} "
            f"err {r['reserved_error_pct']:+.3f}% retries {r['torch_num_alloc_retries']}/"
            f"{r['model_num_alloc_retries']} match={abs(r['reserved_error_pct']) <= 2}"
        )
    if path := os.environ.get("VRAMLEDGER_ALLOC_CSV"):
        with open(path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    for row in rows:
        assert not row["trace_truncated"] and row["unmatched_frees"] == 0, row["name"]
        assert abs(row["reserved_error_pct"]) <= 2.0, row  # the target: within 2% of reserved
