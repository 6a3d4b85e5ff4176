"""`explain`: what a user has after a crash — an OOM message, a log, a memory snapshot, the callback's JSONL —
read into one post-mortem (``explain.postmortem``), with the prediction beside it when the setup is known.

No GPU and no torch needed: snapshots are read as plain data.

>>> pm = explain(read_evidence_text("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB. "
...     "GPU 0 has a total capacty of 23.65 GiB of which 1.66 GiB is free. Including non-PyTorch memory, this "
...     "process has 20.81 GiB memory in use. Of the allocated memory 12.09 GiB is allocated by PyTorch, and "
...     "4.84 GiB is reserved by PyTorch but unallocated.", source="kerrj/lerf#73"))
>>> pm.diagnosis.value
'fragmentation'
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.explain.attribute import attribute, recorded_categories, traced_allocs
from vramledger.explain.oom_message import parse_message
from vramledger.explain.postmortem import Diagnosis, Evidence, PostMortem, compare, diagnose, shortfall
from vramledger.explain.snapshot import decode, facts, failed_device, is_snapshot
from vramledger.specs import GPUSpec, ModelSpec, TrainSpec

__all__ = ["Evidence", "PostMortem", "evidence_from_snapshot", "explain", "read_evidence", "read_evidence_text"]


def read_evidence_text(text: str, *, source: str) -> Evidence:
    """An OOM message pasted or a log's text; the last OOM message in it counts."""
    msg = parse_message(text)
    if msg is None:
        raise VramledgerError(
            f"{source}: no CUDA out-of-memory message found (looked for 'out of memory. Tried to allocate'); pass "
            "the error text, a log holding it, a memory snapshot or the callback's JSONL"
        )
    return Evidence(source=source, message=msg)


def evidence_from_snapshot(
    snapshot: Mapping[str, Any],
    *,
    source: str,
    device: int | None = None,
    known: Mapping[int, Any] | None = None,
    **extra: Any,
) -> Evidence:
    """Evidence from a snapshot dictionary (``known``: data pointer → bucket, for exact attribution)."""
    device = failed_device(snapshot) if device is None else device
    snap = facts(snapshot, device)
    shares = attribute(
        snap,
        traced_addresses=traced_allocs(snapshot, device),
        known=known,
        recorded=recorded_categories(snapshot, device),
    )
    return Evidence(source=source, snapshot=snap, shares=shares, **extra)


def read_evidence(path: Path) -> Evidence:
    """Whatever ``path`` holds: a snapshot (pickle or JSON, gzipped or not), the callback's JSONL, a
    ground-truth OOM record (``bench/ground_truth/oom_fixtures.py``'s ``oom_<case>.json``), or text."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise VramledgerError(
            f"explain: no file at {path}; pass a snapshot, a log, the callback's JSONL or the error text in quotes"
        ) from None
    except OSError as exc:
        raise VramledgerError(f"explain: cannot read {path} ({exc.strerror})") from None
    source = str(path)
    binary = raw[:2] == b"\x1f\x8b" or raw[:1] == b"\x80"
    data: Any = None
    if binary or raw.lstrip()[:1] == b"{":
        try:
            data = decode(raw, source)
        except VramledgerError:
            if binary:
                raise
    if is_snapshot(data):
        return evidence_from_snapshot(data, source=source)
    if isinstance(data, Mapping) and ("at_oom" in data or "snapshot_files" in data):
        return _from_record(data, path)
    if binary:
        raise VramledgerError(f"{source}: neither a memory snapshot nor an OOM record")
    text = raw.decode("utf-8", "replace")
    if _is_jsonl(text):
        return _from_jsonl(text, path)
    return read_evidence_text(raw.decode("utf-8", "replace"), source=source)


def _is_jsonl(text: str) -> bool:
    """The callback's JSONL: its first line is a JSON object with an ``event``."""
    first = text.lstrip().split("\n", 1)[0]
    try:
        return isinstance(json.loads(first), dict) and "event" in json.loads(first)
    except json.JSONDecodeError:
        return False


def _from_record(rec: Mapping[str, Any], path: Path) -> Evidence:
    """``oom_<case>.json`` of the ground-truth script: the message, the observer's figures, the snapshot beside it."""
    at = rec.get("at_oom") or {}
    msg = parse_message(str(rec.get("message", "")))
    files = rec.get("snapshot_files") or {}
    ev = Evidence(source=str(path), message=msg)
    for key in ("pickle", "json"):
        name = files.get(key)
        if isinstance(name, str) and (path.parent / name).is_file():
            snap_path = path.parent / name
            snapshot = decode(snap_path.read_bytes(), str(snap_path))
            if is_snapshot(snapshot):
                ev = evidence_from_snapshot(snapshot, source=f"{path} + {name}", message=msg)
                break
    capped = msg is not None and msg.allowed_bytes is not None  # the observer passes the cap when one is set
    limit = at.get("observer_limit_or_total")
    return replace(
        ev,
        requested_bytes=at.get("requested"),
        capacity_bytes=None if capped else limit,
        allowed_bytes=limit if capped else None,
        free_bytes=at.get("observer_device_free"),
        allocated_bytes=at.get("allocated"),
        reserved_bytes=at.get("reserved"),
        phase=rec.get("phase") or at.get("phase"),
    )


def _from_jsonl(text: str, path: Path) -> Evidence:
    """The callback's JSONL: its last ``oom`` record (and the snapshot it names), else its last step."""
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise VramledgerError(f"{path}: line {n} is not JSON; pass the callback's JSONL unchanged") from None
    ooms = [r for r in records if r.get("event") == "oom"]
    if not ooms:
        raise VramledgerError(f"{path}: the run recorded no OOM (no 'oom' event); nothing to explain")
    oom = ooms[-1]
    ev = Evidence(source=str(path))
    snap_name = oom.get("snapshot")
    if isinstance(snap_name, str):
        snap_path = Path(snap_name) if Path(snap_name).is_absolute() else path.parent / snap_name
        if snap_path.is_file():
            snapshot = decode(snap_path.read_bytes(), str(snap_path))
            if is_snapshot(snapshot):
                ev = evidence_from_snapshot(snapshot, source=f"{path} + {snap_path.name}")
    return replace(
        ev,
        requested_bytes=oom.get("requested_bytes"),
        capacity_bytes=oom.get("capacity_bytes"),
        allowed_bytes=oom.get("allowed_bytes"),
        free_bytes=oom.get("free_bytes"),
        allocated_bytes=oom.get("allocated_bytes"),
        reserved_bytes=oom.get("reserved_bytes"),
        phase=oom.get("phase"),
        step=oom.get("step"),
        batch=oom.get("batch"),
        recorded_setup=_recorded_setup(records),
    )


_FORMATS = {"transformers": "hf"}
"""The framework a callback names → the format its fixes are written in (Lightning, plain loops: none)."""


def _recorded_setup(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The setup of the last prediction before the OOM, with the framework and the GPU the run reported."""
    begin = next((r for r in records if r.get("event") == "begin"), {})
    predicted = [r for r in records if r.get("event") == "predict" and isinstance(r.get("setup"), dict)]
    if not predicted:
        return None
    return {
        "specs": predicted[-1]["setup"],
        "fmt": _FORMATS.get(str(begin.get("framework")), ""),
        "capacity_bytes": begin.get("capacity_bytes"),
        "device": begin.get("device"),
    }


def setup_to_record(model: ModelSpec, train: TrainSpec) -> dict[str, Any]:
    """The specs a callback predicted for, as JSON data (``measure.serial`` for the TrainSpec)."""
    import dataclasses

    from vramledger.measure.serial import train_to_dict

    return {"model": dataclasses.asdict(model), "train": train_to_dict(train)}


def setup_from_record(data: Mapping[str, Any], source: str) -> tuple[ModelSpec, TrainSpec]:
    """The inverse of ``setup_to_record``; a record that does not fit these specs raises one clear line."""
    from vramledger.measure.serial import train_from_dict

    try:
        return ModelSpec(**data["model"]), train_from_dict(dict(data["train"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise VramledgerError(f"{source}: the recorded setup cannot be read ({exc}); pass --config instead") from None


def gpu_of(name: str, capacity: int) -> GPUSpec:
    """The catalog GPU called ``name`` when its memory is ``capacity``, else a GPU of that capacity."""
    from vramledger.catalog import resolve_gpu

    try:
        gpu = resolve_gpu(name)
        if gpu.memory_bytes == capacity:
            return gpu
    except VramledgerError:
        pass
    return resolve_gpu(f"{name}:{capacity}B")


def explain(
    ev: Evidence,
    *,
    model: ModelSpec | None = None,
    train: TrainSpec | None = None,
    gpu: GPUSpec | None = None,
    headroom: float = 0.08,
    fmt: str = "llamafactory",
    model_name: str | None = None,
) -> PostMortem:
    """Diagnose ``ev``; with the setup (``model``, ``train``), compare with the prediction and price the fixes on
    ``gpu`` (else a GPU of the capacity the evidence reports)."""
    pm = diagnose(ev)
    if (model is None or train is None) and ev.recorded_setup is not None:
        model, train = setup_from_record(ev.recorded_setup["specs"], ev.source)
        fmt = ev.recorded_setup.get("fmt") or ""
    from vramledger.explain.fixes import expandable_fix, priced_fixes

    if model is None or train is None:  # no setup to price remedies on; fragmentation's fix needs none
        return replace(pm, fixes=(expandable_fix(),)) if pm.diagnosis is Diagnosis.FRAGMENTATION else pm
    from vramledger.analytic import estimate

    if gpu is None and pm.capacity_bytes:
        name = str((ev.recorded_setup or {}).get("device") or "GPU of the evidence")
        gpu = gpu_of(name, pm.capacity_bytes)
    ledger = estimate(model, train, gpu=gpu, headroom=headroom)
    comparison = compare(ledger, ev, pm.requested_bytes, pm.allocated_bytes)
    fixes = (
        ()
        if gpu is None
        else priced_fixes(
            model,
            train,
            gpu,
            headroom,
            diagnosis=pm.diagnosis,
            fmt=fmt,
            model_name=model_name,
            need_bytes=shortfall(pm),
        )
    )
    return replace(pm, comparison=comparison, fixes=fixes)
