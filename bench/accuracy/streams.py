"""Real allocation streams: a CUDA memory snapshot reduced to what an allocator replay needs.

A snapshot (``torch.cuda.memory._snapshot()`` / ``_dump_snapshot``, PyTorch ``torch/cuda/memory.py``) holds
``segments`` (the cache at the end: each segment's address, size, stream, pool and blocks) and
``device_traces`` (one list per device of the allocator's ``TraceEntry`` events, ``c10/cuda/
CUDACachingAllocator.h``: ``alloc``, ``free_requested``, ``free_completed``, ``segment_alloc``,
``segment_free``, ``segment_map``, ``segment_unmap``, ``oom``, ``snapshot``). Recorded with ``context=None``
the events carry no stacks, and this module keeps exactly their fields: action, address, size, stream.

The reduced file is JSON compressed with xz (``<id>.json.xz``), small enough to commit (a few hundred kB for a
3-step trial of an 8B model):

  {"id": ..., "alloc_conf": ..., "actions": [names], "events": [[action index, addr, size, stream], ...],
   "segments": [{"address", "total_size", "stream", "segment_type", "allocated_size", "active_size",
                 "requested_size", "blocks": [{"address", "size", "requested_size", "state"}]}],
   "overflowed": bool}

``overflowed`` means the history's ring buffer was full: the stream may not start from an empty allocator,
and its replay must not be compared.
"""

from __future__ import annotations

import json
import lzma
import pickle
from pathlib import Path
from typing import Any

ACTIONS = (
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "oom",
    "snapshot",
)
_SEGMENT_KEYS = ("address", "total_size", "stream", "segment_type", "allocated_size", "active_size",
                 "requested_size", "device", "is_expandable")  # fmt: skip
_BLOCK_KEYS = ("address", "size", "requested_size", "state")


def reduce_snapshot(snapshot: dict[str, Any], *, max_entries: int, meta: dict[str, Any]) -> dict[str, Any]:
    """The replayable part of a snapshot mapping (see the module docstring)."""
    traces = snapshot.get("device_traces") or [[]]
    trace = max(traces, key=len)
    index = {a: i for i, a in enumerate(ACTIONS)}
    events = []
    for e in trace:
        action = e["action"]
        if action not in index:
            raise ValueError(f"unknown trace action {action!r}: extend streams.ACTIONS")
        events.append([index[action], int(e["addr"]), int(e["size"]), int(e["stream"])])
    segments = [
        {
            **{k: seg[k] for k in _SEGMENT_KEYS if k in seg},
            "blocks": [{k: b[k] for k in _BLOCK_KEYS if k in b} for b in seg.get("blocks", [])],
        }
        for seg in snapshot.get("segments", [])
    ]
    return {
        **meta,
        "actions": list(ACTIONS),
        "events": events,
        "segments": segments,
        "overflowed": len(trace) >= max_entries,
    }


def compact(pickle_path: Path, out_path: Path, *, max_entries: int, meta: dict[str, Any]) -> dict[str, Any]:
    """Reduce the pickled snapshot at ``pickle_path`` into ``out_path`` (.json.xz); returns the summary."""
    with open(pickle_path, "rb") as f:
        snapshot = pickle.load(f)  # our own worker's file, written moments ago
    reduced = reduce_snapshot(snapshot, max_entries=max_entries, meta=meta)
    with lzma.open(out_path, "wt") as f:
        json.dump(reduced, f, separators=(",", ":"))
    return {"events": len(reduced["events"]), "segments": len(reduced["segments"]),
            "overflowed": reduced["overflowed"], "bytes": out_path.stat().st_size}  # fmt: skip


def load(path: Path) -> dict[str, Any]:
    """A reduced stream written by ``compact``."""
    with lzma.open(path, "rt") as f:
        data: dict[str, Any] = json.load(f)
    return data
