"""Accuracy-suite records: one JSON object per line (JSONL), and the error statistics over them.

A record holds what one configuration measured on one GPU, with the versions that move the numbers, and the
figures each predictor (``estimate``, ``trace``) gave for the same setup. Predictions can be refilled later on
a CPU machine (``bench/accuracy/run_suite.py predict``) without touching the measured figures.

Record keys: ``schema`` (int), ``id`` (config id), ``date`` (ISO 8601, UTC), ``status`` (trial status),
``config`` (model, train spec mapping, steps), ``environment`` (GPU, driver, versions), ``measured`` and each
predictor's figures: ``{"allocated": int, "reserved": int, "device": int | None, "phases": {...}}``; a missing
predictor is ``null``.

Error convention: ``(predicted − measured) / measured``; negative means the prediction was too low, the
dangerous side (a plan made on it would OOM).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.ledger import Ledger
from vramledger.specs import GPUSpec, ModelSpec, TrainSpec
from vramledger.specs.gpu import DEFAULT_HEADROOM

SCHEMA = 1
FIGURES = ("allocated", "reserved", "device")
"""Peak allocated, peak reserved and device total (what nvidia-smi shows)."""
PREDICTORS = ("estimate", "trace")


def ledger_figures(ledger: Ledger) -> dict[str, Any]:
    """Peak figures of a ledger (any engine), plus per-phase ones, as plain JSON."""
    return {
        "allocated": ledger.peak_allocated,
        "reserved": ledger.peak_reserved,
        "device": ledger.device_total,
        "phases": {
            p.value: {
                "allocated": ledger.allocated(p),
                "reserved": ledger.reserved(p),
                "device": ledger.device(p),
            }
            for p in ledger.phases
        },
    }


def predictions(
    model: ModelSpec, train: TrainSpec, *, gpu: GPUSpec | None = None, headroom: float = DEFAULT_HEADROOM
) -> tuple[dict[str, Ledger], list[str]]:
    """Ledgers of the predictors available in this version for one setup, and a note for each one missing.

    ``estimate``: ``vramledger.analytic.estimate(model, train, gpu=, headroom=)``; ``trace``:
    ``vramledger.trace.trace(model, train)`` (real model code on fake tensors; CPU only, no GPU needed).
    """
    out: dict[str, Ledger] = {}
    notes: list[str] = []
    try:
        from vramledger.analytic import estimate
    except ImportError:
        notes.append("no estimate: vramledger.analytic.estimate is not in this version")
    else:
        out["estimate"] = estimate(model, train, gpu=gpu, headroom=headroom)
    try:
        from vramledger.trace import trace  # type: ignore[attr-defined]
    except ImportError:
        notes.append("no trace: vramledger.trace.trace is not in this version")
    else:
        out["trace"] = trace(model, train)
    return out, notes


def measured_figures(phases: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Peak figures from a worker's per-phase readings (``device`` None when NVML was not read)."""
    devices = [f.get("device") for f in phases.values()]
    return {
        "allocated": max((int(f["allocated"] or 0) for f in phases.values()), default=0),
        "reserved": max((int(f["reserved"] or 0) for f in phases.values()), default=0),
        "device": max(int(d or 0) for d in devices) if devices and all(d is not None for d in devices) else None,
        "phases": {k: dict(v) for k, v in phases.items()},
    }


def write_jsonl(path: Path, records: Iterable[Mapping[str, Any]], *, append: bool = True) -> int:
    """Write records, one per line (sorted keys, so files diff well). Returns how many were written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("a" if append else "w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(rec, sort_keys=True, separators=(",", ":")) + "\n")
            n += 1
    return n


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Read records back; a malformed line is an error naming the file and line."""
    out: list[dict[str, Any]] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise VramledgerError(f"results: cannot read {path} ({exc.strerror}); pass an existing JSONL file") from exc
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise VramledgerError(
                f"results: {path}:{i} is not valid JSON ({exc.msg}); fix or remove that line"
            ) from exc
        if not isinstance(rec, dict) or "id" not in rec:
            raise VramledgerError(f"results: {path}:{i} is not a suite record (no 'id'); fix or remove that line")
        out.append(rec)
    return out


def relative_error(predicted: int | None, measured: int | None) -> float | None:
    """``(predicted − measured) / measured``, or None when either is missing (or nothing was measured)."""
    if predicted is None or measured is None or measured <= 0:
        return None
    return (predicted - measured) / measured


@dataclass(frozen=True, kw_only=True, slots=True)
class ErrorStats:
    """Errors of one predictor on one figure over the records that have both numbers."""

    predictor: str
    figure: str
    n: int
    median_abs: float | None
    """Median of |error|."""
    worst: float | None
    """The signed error of largest magnitude."""
    worst_id: str | None
    worst_under: float | None
    """The most negative error (prediction too low), or None when no prediction was low."""
    within_2pct: int
    """How many records have |error| ≤ 2%."""


def error_stats(records: Sequence[Mapping[str, Any]], predictor: str, figure: str) -> ErrorStats:
    """Median and worst error of ``predictor`` on ``figure`` over the ``ok`` records."""
    errs: list[tuple[float, str]] = []
    for rec in records:
        if rec.get("status") != "ok" or not rec.get(predictor) or not rec.get("measured"):
            continue
        e = relative_error(rec[predictor].get(figure), rec["measured"].get(figure))
        if e is not None:
            errs.append((e, str(rec["id"])))
    if not errs:
        return ErrorStats(
            predictor=predictor,
            figure=figure,
            n=0,
            median_abs=None,
            worst=None,
            worst_id=None,
            worst_under=None,
            within_2pct=0,
        )
    worst, worst_id = max(errs, key=lambda x: abs(x[0]))
    unders = [e for e, _ in errs if e < 0]
    return ErrorStats(
        predictor=predictor,
        figure=figure,
        n=len(errs),
        median_abs=statistics.median(abs(e) for e, _ in errs),
        worst=worst,
        worst_id=worst_id,
        worst_under=min(unders) if unders else None,
        within_2pct=sum(1 for e, _ in errs if abs(e) <= 0.02),
    )
