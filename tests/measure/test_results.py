"""Suite records: JSONL round trip, error statistics, and table.py on a hand-made results file."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from vramledger.errors import VramledgerError
from vramledger.measure.results import error_stats, read_jsonl, relative_error, write_jsonl

GIB = 2**30
ROOT = Path(__file__).resolve().parents[2]


def _load(path: Path):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def _rec(i: str, measured: int, est: int | None, status: str = "ok") -> dict:
    return {
        "schema": 1,
        "id": i,
        "status": status,
        "date": "2026-11-20T10:00:00+00:00",
        "environment": {
            "gpu": "NVIDIA H100 80GB HBM3",
            "driver": "580.159.04",
            "versions": {"torch": "2.11.0"},
        },
        "measured": {"allocated": measured, "reserved": measured + GIB, "device": None},
        "estimate": None if est is None else {"allocated": est, "reserved": est + GIB, "device": est + 2 * GIB},
        "trace": None,
    }


# Hand-made: allocated errors of the estimate are +1%, −2%, +4%, −0.5% (and one record without an estimate,
# one OOM which never counts). |errors| sorted: 0.5, 1, 2, 4 → median 1.5%; worst +4% (c); most under −2% (b).
RECORDS = [
    _rec("a", 100 * GIB, 101 * GIB),
    _rec("b", 50 * GIB, 49 * GIB),
    _rec("c", 25 * GIB, 26 * GIB),
    _rec("d", 200 * GIB, 199 * GIB),
    _rec("e", 10 * GIB, None),
    _rec("f", 0, 1, status="oom"),
]


def test_jsonl_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    assert write_jsonl(path, RECORDS[:3]) == 3
    write_jsonl(path, RECORDS[3:])  # appends
    assert read_jsonl(path) == RECORDS
    write_jsonl(path, RECORDS[:1], append=False)
    assert read_jsonl(path) == RECORDS[:1]


def test_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n{not json\n")
    with pytest.raises(VramledgerError, match=r"bad.jsonl:2 is not valid JSON"):
        read_jsonl(path)
    path.write_text('{"no_id": 1}\n')
    with pytest.raises(VramledgerError, match=r"bad.jsonl:1 is not a suite record"):
        read_jsonl(path)


def test_relative_error_sign_convention() -> None:
    assert relative_error(98, 100) == pytest.approx(-0.02)  # predicted too low: negative
    assert relative_error(None, 100) is None and relative_error(5, 0) is None


def test_error_stats_by_hand() -> None:
    s = error_stats(RECORDS, "estimate", "allocated")
    print("expected n=4 median 1.5% worst +4% (c) under -2%; got", s)
    assert s.n == 4
    assert s.median_abs == pytest.approx(0.015)
    assert s.worst == pytest.approx(0.04) and s.worst_id == "c"
    assert s.worst_under == pytest.approx(-0.02)
    assert s.within_2pct == 3
    # Reserved = allocated + 1 GiB on both sides: errors 1/101, −1/51, 1/26, −1/201.
    r = error_stats(RECORDS, "estimate", "reserved")
    assert r.median_abs == pytest.approx((1 / 101 + 1 / 51) / 2)
    assert r.worst_id == "c"
    # Device was not measured (no NVML): nothing to compare.
    assert error_stats(RECORDS, "estimate", "device").n == 0
    assert error_stats(RECORDS, "trace", "allocated").median_abs is None


def test_table_prints_the_hand_computed_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = _load(ROOT / "bench" / "accuracy" / "table.py")
    path = tmp_path / "r.jsonl"
    write_jsonl(path, RECORDS)
    assert table.main([str(path)]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "NVIDIA H100 80GB HBM3, driver 580.159.04, torch 2.11.0" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("estimate") and " allocated " in f" {ln} ")
    assert "1.5%" in line and "+4.0% (c)" in line and "-2.0%" in line and "3/4" in line
    row_b = next(ln for ln in out.splitlines() if ln.startswith("b "))
    assert "50.00" in row_b and "-2.0%" in row_b
    assert table.main([str(path), "--markdown"]) == 0
    assert "| estimate | allocated | 4 | 1.5% |" in capsys.readouterr().out
