"""What the callbacks do at an out-of-memory failure: keep the evidence and write the post-mortem.

Called from PyTorch's OOM observer (``DeviceCachingAllocator::malloc`` calls it after its retries failed and its
lock was released, before raising), so the snapshot shows the allocator exactly as it failed. The live tensors
the callback knows (parameters, their gradients, the optimizer's state) are attributed by address, exactly; the
rest by their allocation stacks (``explain.attribute``). Files go beside the JSONL, never over an existing one.
"""

from __future__ import annotations

import pickle
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vramledger.errors import VramledgerError

if TYPE_CHECKING:
    from vramledger.integrations.watcher import MemoryWatcher


def write_postmortem(w: MemoryWatcher, *, device: int, requested: int, limit: int, free: int) -> dict[str, Any]:
    from vramledger.explain import evidence_from_snapshot
    from vramledger.explain.postmortem import Evidence, compare, diagnose, shortfall
    from vramledger.integrations.watcher import unique_path
    from vramledger.report.postmortem import postmortem_to_dict, render_postmortem
    from vramledger.report.postmortem_html import render_postmortem_html

    base = w.out.parent if w.out is not None else Path.cwd()
    stem = f"oom_step{w.step.step}"
    current = w.stats.current()
    capacity = w.stats.capacity()
    batch = {
        "shape": list(w.step.batches[-1]) if w.step.batches else None,
        "longest": list(w.longest) if w.longest else None,
    }
    extra: dict[str, Any] = {
        "requested_bytes": requested,
        # the observer passes the memory-fraction cap when one is set, else the device total
        "capacity_bytes": capacity if capacity is not None else limit,
        "allowed_bytes": limit if capacity is not None and limit < capacity else None,
        "free_bytes": free,
        "allocated_bytes": None if current is None else current[0],
        "reserved_bytes": None if current is None else current[1],
        "phase": w.phase,
        "step": w.step.step,
        "batch": batch,
    }
    record: dict[str, Any] = {k: v for k, v in extra.items()}
    snapshot = w.stats.snapshot()
    if snapshot is not None:
        snap_path = unique_path(base / f"{stem}.snapshot.pickle")
        with snap_path.open("xb") as f:
            pickle.dump(snapshot, f)  # what torch.cuda.memory._dump_snapshot writes: opens in pytorch.org/memory_viz
        record["snapshot"] = snap_path.name
        known = w._known() if w._known is not None else None
        ev = evidence_from_snapshot(snapshot, source="the OOM observer", device=device, known=known, **extra)
    else:
        ev = Evidence(source="the OOM observer", **extra)
    pm = diagnose(ev)
    if w.prediction is not None and w.setup is not None:
        comparison = compare(w.prediction, ev, pm.requested_bytes, pm.allocated_bytes)
        fixes: tuple[Any, ...] = ()
        gpu = w.prediction.verdict and w._gpu()
        if gpu:
            from vramledger.explain.fixes import priced_fixes

            try:
                fixes = priced_fixes(
                    w.setup.model,
                    w.setup.train,
                    gpu,
                    w.headroom,
                    diagnosis=pm.diagnosis,
                    fmt=w.fmt,
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


def known_tensors(model: Any, optimizer: Any) -> dict[int, Any]:
    """Data pointers of the tensors whose role is certain: parameters, their gradients, the optimizer's state."""
    from vramledger.explain.attribute import Bucket

    out: dict[int, Any] = {}
    for p in model.parameters() if model is not None else ():
        if p.is_cuda:
            out[p.data_ptr()] = Bucket.WEIGHTS
            if p.grad is not None:
                out[p.grad.data_ptr()] = Bucket.GRADIENTS
    inner = getattr(optimizer, "optimizer", optimizer)
    for state in getattr(inner, "state", {}).values():
        for t in state.values() if isinstance(state, dict) else ():
            if getattr(t, "is_cuda", False):
                out[t.data_ptr()] = Bucket.OPTIMIZER_STATE
    return out
