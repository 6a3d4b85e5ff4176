"""Print estimate vs trace vs measured for accuracy-suite results, with median and worst errors.

Works on the JSONL files alone (no GPU, no model code):

  PYTHONPATH=src python bench/accuracy/table.py bench/accuracy/results/*.jsonl [--markdown]

Error = (predicted − measured) / measured: negative means the prediction was too low (the side that OOMs).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.measure.results import FIGURES, PREDICTORS, error_stats, read_jsonl, relative_error

GIB = 2**30


def _gib(n: int | None) -> str:
    return "—" if n is None else f"{n / GIB:.2f}"


def _pct(e: float | None) -> str:
    return "—" if e is None else f"{e * 100:+.1f}%"


def environment_lines(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per distinct (GPU, driver, versions) among the records, with their dates."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for rec in records:
        env = rec.get("environment") or {}
        v = env.get("versions") or {}
        key = tuple(
            str(x)
            for x in (
                env.get("gpu"),
                env.get("driver"),
                v.get("torch"),
                v.get("cuda"),
                v.get("transformers"),
                v.get("peft"),
                v.get("bitsandbytes"),
            )
        )
        groups.setdefault(key, []).append(str(rec.get("date", ""))[:10])
    out = []
    for (gpu, driver, torch, cuda, tf, peft, bnb), dates in groups.items():
        span = min(dates) if min(dates) == max(dates) else f"{min(dates)}…{max(dates)}"
        out.append(
            f"{gpu}, driver {driver}, torch {torch}, CUDA {cuda}, transformers {tf}, peft {peft}, "
            f"bitsandbytes {bnb}; {len(dates)} records, {span}"
        )
    return out


def rows(records: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """Per-record rows: id, status, measured allocated/reserved/device (GiB), then each predictor's errors."""
    out = []
    for rec in records:
        m = rec.get("measured") or {}
        row = [str(rec["id"]), str(rec.get("status")), _gib(m.get("allocated")), _gib(m.get("reserved")),
               _gib(m.get("device"))]  # fmt: skip
        for pred in PREDICTORS:
            p = rec.get(pred) or {}
            row += [_pct(relative_error(p.get(f), m.get(f))) for f in FIGURES]
        out.append(row)
    return out


HEADER = ["config", "status", "alloc GiB", "reserved GiB", "device GiB"] + [
    f"{p} {f}" for p in PREDICTORS for f in ("alloc", "reserved", "device")
]


def summary(records: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    out = []
    for pred in PREDICTORS:
        for fig in FIGURES:
            s = error_stats(records, pred, fig)
            out.append([
                pred, fig, str(s.n),
                "—" if s.median_abs is None else f"{s.median_abs * 100:.1f}%",
                f"{_pct(s.worst)} ({s.worst_id})" if s.worst is not None else "—",
                _pct(s.worst_under) if s.worst_under is not None else "none",
                f"{s.within_2pct}/{s.n}" if s.n else "—",
            ])  # fmt: skip
    return out


SUMMARY_HEADER = ["predictor", "figure", "n", "median |error|", "worst", "most under", "within 2%"]


def _render(header: list[str], body: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*header)] + [fmt.format(*r) for r in body])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("results", type=Path, nargs="+", help="JSONL files written by run_suite.py")
    ap.add_argument("--markdown", action="store_true", help="GitHub tables (for the README)")
    args = ap.parse_args(argv)
    try:
        records = [r for path in args.results for r in read_jsonl(path)]
    except VramledgerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    for line in environment_lines(records):
        print(line)
    print()
    print(_render(HEADER, rows(records), args.markdown))
    print()
    print(_render(SUMMARY_HEADER, summary(records), args.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
