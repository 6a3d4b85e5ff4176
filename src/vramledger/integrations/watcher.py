"""The framework-free core of the callbacks: predict from the live setup, measure each phase, write JSONL, warn,
and write a post-mortem when the allocator runs out of memory.

The callbacks (``integrations.hf``, ``integrations.lightning``, ``integrations.loop``) translate their framework's
events into four calls: ``batch`` (a micro-batch's shape, before its forward), ``enter`` (a phase begins: forward,
backward, optimizer; ``None`` ends the current one), ``end_step`` and ``close``. Per phase the allocator's peak
counters are reset at its start and read at its end (``MemoryStats``: host-side counters, no synchronisation).

JSONL records (one per line, flushed as written, so a crash leaves them): ``begin``, ``predict`` (each time the
longest batch grows: the prediction is for the longest batch so far), ``step`` (per phase ``max_allocated`` and
``max_reserved``, the batch, the longest so far), ``warning`` and ``oom``.

Warnings (Python's ``warnings``, category ``MemoryWarning``): the prediction does not fit (before the batch's
forward runs), a phase measured more than ``tolerance`` above its prediction, reserved above
``reserved_fraction`` of the capacity. Each kind is given once per phase, not every step.
"""

from __future__ import annotations

import json
import pickle
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.integrations.predict import LiveSetup
from vramledger.integrations.stats import MemoryStats
from vramledger.ledger import Ledger, Phase
from vramledger.userfiles import unique_path


class MemoryWarning(UserWarning):
    """A memory warning from a vramledger callback."""


PHASES = ("forward", "backward", "optimizer")


@dataclass(kw_only=True, slots=True)
class StepRecord:
    step: int
    phases: dict[str, dict[str, int]] = field(default_factory=dict)
    batches: list[tuple[int, ...]] = field(default_factory=list)


class MemoryWatcher:
    """Measure, compare and record one run (see the module docstring)."""

    def __init__(
        self,
        stats: MemoryStats,
        *,
        out: Path | None,
        tolerance: float = 0.10,
        reserved_fraction: float = 0.92,
        headroom: float = 0.08,
        record_history: bool = False,
        history_max_entries: int = 100_000,
        fmt: str = "hf",
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.stats = stats
        self.out = None if out is None else unique_path(Path(out))
        self.tolerance, self.reserved_fraction, self.headroom = tolerance, reserved_fraction, headroom
        self.record_history, self.history_max_entries, self.fmt = record_history, history_max_entries, fmt
        self._warn = warn or (lambda msg: warnings.warn(msg, MemoryWarning, stacklevel=3))
        self._file: Any = None
        self._predictor: Callable[[int, int], LiveSetup] | None = None
        self._predictions: dict[tuple[int, int], Ledger] = {}
        self.setup: LiveSetup | None = None
        self.prediction: Ledger | None = None
        self.longest: tuple[int, int] | None = None
        self.phase: str | None = None
        self.step = StepRecord(step=0)
        self.last: StepRecord | None = None
        self._warned: set[str] = set()
        self._history_on = False
        self._known: Callable[[], Mapping[int, Any]] | None = None
        self.ooms = 0
        self.max_oom_reports = 1

    # -- lifecycle -------------------------------------------------------------------------------------------
    def begin(
        self,
        predictor: Callable[[int, int], LiveSetup] | None,
        *,
        context: Mapping[str, Any],
        known_tensors: Callable[[], Mapping[int, Any]] | None = None,
    ) -> None:
        """Open the JSONL, start the history recording (opt-in), attach the OOM observer."""
        self._predictor, self._known = predictor, known_tensors
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.out.open("x", encoding="utf-8")
        self._write(
            {
                "event": "begin",
                "time": time.time(),
                "device": self.stats.device_name(),
                "capacity_bytes": self.stats.capacity(),
                "measuring": self.stats.available(),
                **context,
            }
        )
        if self.record_history and self.stats.available():
            self._history_on = self.stats.start_history(self.history_max_entries)
            ref = weakref.ref(self)

            def observer(device: int, requested: int, limit: int, free: int) -> None:
                watcher = ref()
                if watcher is not None:
                    watcher.on_oom(device, requested, limit, free)

            self.stats.attach_oom_observer(observer)

    def close(self) -> None:
        self.enter(None)
        if self._history_on:
            self.stats.stop_history()
            self._history_on = False
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- events ----------------------------------------------------------------------------------------------
    def batch(self, shape: tuple[int, ...]) -> None:
        """A training micro-batch of ``shape`` (batch, length, …) is about to run its forward."""
        self.step.batches.append(tuple(int(x) for x in shape))
        if len(shape) < 2:
            return
        b, length = int(shape[0]), int(shape[1])
        if self.longest is None or (length, b) > (self.longest[1], self.longest[0]):
            self.longest = (b, length)
            self._predict(b, length)

    def enter(self, phase: str | None) -> None:
        """End the current phase (reading its peaks) and begin ``phase`` (resetting them)."""
        if self.phase is not None:
            peaks = self.stats.peaks()
            if peaks is not None:
                rec = self.step.phases.setdefault(self.phase, {"max_allocated": 0, "max_reserved": 0})
                rec["max_allocated"] = max(rec["max_allocated"], peaks[0])
                rec["max_reserved"] = max(rec["max_reserved"], peaks[1])
        self.phase = phase
        if phase is not None:
            self.stats.reset_peaks()

    def end_step(self, step: int) -> dict[str, float]:
        """Close the step: write its record, warn, and return the scalars to log (GiB, for the trackers)."""
        self.enter(None)
        rec, self.step = self.step, StepRecord(step=step + 1)
        rec.step = step
        self.last = rec
        self._write(
            {
                "event": "step",
                "step": step,
                "batch": list(rec.batches[-1]) if rec.batches else None,
                "micro_batches": len(rec.batches),
                "longest": list(self.longest) if self.longest else None,
                "phases": rec.phases,
            }
        )
        self._check(rec)
        return self.scalars()

    def scalars(self) -> dict[str, float]:
        rec = self.last
        out: dict[str, float] = {}
        if rec is not None and rec.phases:
            out["vram/max_allocated_gib"] = max(p["max_allocated"] for p in rec.phases.values()) / 2**30
            out["vram/max_reserved_gib"] = max(p["max_reserved"] for p in rec.phases.values()) / 2**30
        if self.prediction is not None:
            out["vram/predicted_reserved_gib"] = self.prediction.peak_reserved / 2**30
        if self.longest is not None:
            out["vram/longest_seq"] = float(self.longest[1])
        return out

    # -- prediction and checks -------------------------------------------------------------------------------
    def _gpu(self) -> Any:
        from vramledger.explain import gpu_of

        cap = self.stats.capacity()
        return None if cap is None else gpu_of(self.stats.device_name(), cap)

    def _predict(self, b: int, length: int) -> None:
        if self._predictor is None:
            return
        from vramledger.analytic import estimate
        from vramledger.explain import setup_to_record

        try:
            self.setup = self._predictor(b, length)
            ledger = estimate(self.setup.model, self.setup.train, gpu=self._gpu(), headroom=self.headroom)
        except Exception as exc:  # noqa: BLE001 - a callback must never stop the user's training run: a setup we
            # cannot read (VramledgerError, or an unexpected object) ends the predictions with one warning
            self._note(f"no prediction: {exc}", key="predict-error")
            self._predictor = None
            return
        self.prediction = ledger
        v = ledger.verdict
        self._write(
            {
                "event": "predict",
                "batch": [b, length],
                "model": ledger.model,
                "params": ledger.params,
                "peak_phase": ledger.peak_phase.value,
                "peak_allocated_bytes": ledger.peak_allocated,
                "peak_reserved_bytes": ledger.peak_reserved,
                "device_total_bytes": ledger.device_total,
                "fits": None if v is None else v.fits,
                "usable_bytes": None if v is None else v.usable_bytes,
                "phases": {
                    p.value: {"allocated": ledger.allocated(p), "reserved": ledger.reserved(p)} for p in ledger.phases
                },
                "settings": {k: _plain(x) for k, x in ledger.settings.items()},
                "provenance": self.setup.provenance,
                "setup": setup_to_record(self.setup.model, self.setup.train),
                "warnings": list(self.setup.warnings),
            }
        )
        if v is not None and not v.fits:
            from vramledger.units import fmt_bytes

            self._note(
                f"predicted NOT to fit: batch {b} x {length} needs {fmt_bytes(v.device_total_bytes)} on the device "
                f"({ledger.peak_phase.value}), {fmt_bytes(v.usable_bytes)} usable of {fmt_bytes(v.capacity_bytes)}. "
                f"{ledger.advice}",
                key=f"fit-{b}x{length}",
            )

    def _check(self, rec: StepRecord) -> None:
        from vramledger.units import fmt_bytes

        cap = self.stats.capacity()
        for name, got in rec.phases.items():
            if cap and got["max_reserved"] > self.reserved_fraction * cap:
                self._note(
                    f"{name}: reserved {fmt_bytes(got['max_reserved'])} is above "
                    f"{self.reserved_fraction:.0%} of the {fmt_bytes(cap)} GPU (step {rec.step})",
                    key=f"reserved-{name}",
                )
            led = self.prediction
            if led is None or name not in {p.value for p in led.phases}:
                continue
            want = led.allocated(Phase(name))
            if want and got["max_allocated"] > (1 + self.tolerance) * want:
                self._note(
                    f"{name}: measured {fmt_bytes(got['max_allocated'])} allocated, "
                    f"{got['max_allocated'] / want - 1:+.0%} over the predicted {fmt_bytes(want)} "
                    f"(step {rec.step}, tolerance {self.tolerance:.0%})",
                    key=f"over-{name}",
                )

    def _note(self, message: str, *, key: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        self._write({"event": "warning", "key": key, "message": message})
        self._warn(message)

    def _write(self, record: Mapping[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, default=str) + "\n")
            self._file.flush()

    # -- out of memory ---------------------------------------------------------------------------------------
    def on_oom(self, device: int, requested: int, limit: int, free: int) -> None:
        """The allocator's OOM observer: snapshot, post-mortem (text and HTML beside the JSONL), an ``oom`` record."""
        self.ooms += 1
        if self.ooms > self.max_oom_reports:
            self._write({"event": "oom", "count": self.ooms, "requested_bytes": requested})
            return

        try:
            record = self._write_postmortem(device=device, requested=requested, limit=limit, free=free)
        except Exception as exc:  # noqa: BLE001 - the observer runs inside the allocator's failure: our own
            # error must never replace the user's OutOfMemoryError, so it is recorded and the OOM goes on
            self._write({"event": "oom", "requested_bytes": requested, "postmortem_error": repr(exc)})
            self._warn(f"CUDA out of memory; the post-mortem failed ({exc!r})")
            return
        self._write({"event": "oom", **record})
        self._warn(f"CUDA out of memory: {record.get('diagnosis')}; post-mortem in {record.get('postmortem_text')}")

    def _write_postmortem(self, *, device: int, requested: int, limit: int, free: int) -> dict[str, Any]:
        """The snapshot, the diagnosis, the comparison with the prediction and the fixes, written beside the JSONL."""
        from vramledger.explain import evidence_from_snapshot
        from vramledger.explain.postmortem import Evidence, compare, diagnose, shortfall
        from vramledger.report.postmortem import postmortem_to_dict, render_postmortem
        from vramledger.report.postmortem_html import render_postmortem_html

        base = self.out.parent if self.out is not None else Path.cwd()
        stem = f"oom_step{self.step.step}"
        current = self.stats.current()
        capacity = self.stats.capacity()
        batch = {
            "shape": list(self.step.batches[-1]) if self.step.batches else None,
            "longest": list(self.longest) if self.longest else None,
        }
        extra: dict[str, Any] = {
            "requested_bytes": requested,
            # the observer passes the memory-fraction cap when one is set, else the device total
            "capacity_bytes": capacity if capacity is not None else limit,
            "allowed_bytes": limit if capacity is not None and limit < capacity else None,
            "free_bytes": free,
            "allocated_bytes": None if current is None else current[0],
            "reserved_bytes": None if current is None else current[1],
            "phase": self.phase,
            "step": self.step.step,
            "batch": batch,
        }
        record: dict[str, Any] = {k: v for k, v in extra.items()}
        snapshot = self.stats.snapshot()
        if snapshot is not None:
            snap_path = unique_path(base / f"{stem}.snapshot.pickle")
            with snap_path.open("xb") as f:
                pickle.dump(snapshot, f)  # _dump_snapshot's format: opens in pytorch.org/memory_viz
            record["snapshot"] = snap_path.name
            known = self._known() if self._known is not None else None
            ev = evidence_from_snapshot(snapshot, source="the OOM observer", device=device, known=known, **extra)
        else:
            ev = Evidence(source="the OOM observer", **extra)
        pm = diagnose(ev)
        if self.prediction is not None and self.setup is not None:
            comparison = compare(self.prediction, ev, pm.requested_bytes, pm.allocated_bytes)
            fixes: tuple[Any, ...] = ()
            gpu = self.prediction.verdict and self._gpu()
            if gpu:
                from vramledger.explain.fixes import priced_fixes

                try:
                    fixes = priced_fixes(
                        self.setup.model,
                        self.setup.train,
                        gpu,
                        self.headroom,
                        diagnosis=pm.diagnosis,
                        fmt=self.fmt,
                        need_bytes=shortfall(pm),
                    )
                except VramledgerError:
                    fixes = ()
            pm = replace(pm, comparison=comparison, fixes=fixes)
        text_path = unique_path(base / f"{stem}.postmortem.txt")
        text_path.write_text(render_postmortem(pm) + "\n", encoding="utf-8")
        html_path = unique_path(base / f"{stem}.postmortem.html")
        html_path.write_text(render_postmortem_html(pm), encoding="utf-8")
        summary = postmortem_to_dict(pm)
        record.update(
            {
                "diagnosis": summary["diagnosis"],
                "reason": summary["reason"],
                "largest_free_block_bytes": summary["largest_free_block_bytes"],
                "by_category": summary["by_category"],
                "fixes": summary["fixes"],
                "postmortem_text": text_path.name,
                "postmortem_html": html_path.name,
            }
        )
        return record


def _plain(x: Any) -> Any:
    return x if isinstance(x, (str, int, float, bool, type(None), list, dict)) else str(x)
