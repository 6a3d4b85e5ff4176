"""The traced step as a PyTorch memory snapshot: what ``torch.cuda.memory._dump_snapshot`` would have written.

The trace's device events (``oom.device_events``: the traced tensors plus the cuBLAS workspaces) are replayed
through the caching-allocator model (``vramledger.allocator``), so segments, blocks and addresses are the model's.
The structure is ``torch.cuda.memory._snapshot``'s (torch/cuda/memory.py, its docstring), as read by
``torch/cuda/_memory_viz.py`` and pytorch.org/memory_viz:

- ``device_traces[0]``: ``segment_alloc`` / ``segment_free`` (``addr``, ``size`` of a cudaMalloc), ``alloc`` /
  ``free_requested`` / ``free_completed`` (``addr``, the requested ``size``), and ``oom`` (``size`` after
  ``round_size``, ``device_free``), each with ``stream`` 0 and ``frames``;
- ``segments``: one per cudaMalloc live when the snapshot is taken, with its ``blocks`` (``address``, ``size``,
  ``requested_size``, ``state`` active_allocated|inactive, ``frames``).

A real snapshot's frames are the Python stack; here each allocation has one frame: ``filename`` the module path
(``(top level)`` outside any module), ``name`` the op in the user's words (``trace/opnames.py``), ``line`` the
training step. The snapshot is taken where a real one is most useful: at the first OOM on the given capacity (an
``oom`` entry ends the trace), else at the step's peak allocated memory, so its live blocks are the peak.

Simplifications: one stream (FSDP's collective streams are merged into stream 0); expandable segments are listed
by their mapped blocks, without ``segment_map`` / ``segment_unmap`` entries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vramledger.allocator.conf import DEFAULT_CONF, AllocatorConf
from vramledger.allocator.model import Block, CachingAllocatorModel
from vramledger.allocator.replay import AllocEvent, EventKind
from vramledger.trace.oom import DeviceEvents
from vramledger.trace.opnames import op_label


def _frames(ev: AllocEvent, step: int) -> list[dict[str, Any]]:
    category = ev.category.value if ev.category is not None else ""
    phase = ev.phase.value if ev.phase is not None else ""
    return [{"filename": ev.module or "(top level)", "line": step, "name": op_label(ev.op, category, phase, ev.module)}]


def _segments(model: CachingAllocatorModel, live: dict[int, Block]) -> dict[int, list[Block]]:
    """Every mapped block of the model, live or cached, grouped by segment and sorted by address."""
    by_seg: dict[int, list[Block]] = {}
    blocks = [*live.values(), *model._small.blocks.values(), *model._large.blocks.values()]
    for b in blocks:
        by_seg.setdefault(b.seg, []).append(b)
    for seg in by_seg.values():
        seg.sort(key=lambda b: b.addr)
    return by_seg


def _stop_index(dev: DeviceEvents, model: CachingAllocatorModel) -> int:
    """Index of the event at which allocated memory first peaks (the whole replay on an unlimited device)."""
    live: dict[int, Block] = {}
    best, at = -1, 0
    for i, ev in enumerate(dev.events):
        if ev.kind is EventKind.ALLOC and ev.size:
            blk = model.malloc(ev.size)
            if blk is None:
                return i
            live[ev.id] = blk
            if model.allocated > best:
                best, at = model.allocated, i
        elif ev.kind is EventKind.FREE and ev.id in live:
            model.free(live.pop(ev.id))
        elif ev.kind is EventKind.EMPTY_CACHE:
            model.empty_cache()
    return at


def build_snapshot(
    dev: DeviceEvents,
    steps: tuple[int, ...],
    *,
    conf: AllocatorConf = DEFAULT_CONF,
    capacity_bytes: int | None = None,
    device_total_bytes: int | None = None,
) -> dict[str, Any]:
    """The snapshot dictionary (pickle it for ``_dump_snapshot``'s format). ``steps[i]``: the training step of
    ``dev.events[i]``."""

    def new_model() -> CachingAllocatorModel:
        return CachingAllocatorModel(conf, capacity_bytes=capacity_bytes, device_total_bytes=device_total_bytes)

    stop = _stop_index(dev, new_model())
    writer = _TraceWriter(new_model())
    for i, ev in enumerate(dev.events[: stop + 1]):
        if ev.kind is EventKind.ALLOC and ev.size:
            if not writer.alloc(ev, _frames(ev, steps[i])):
                break
        elif ev.kind is EventKind.FREE and ev.id in writer.live:
            writer.free(ev.id)
        elif ev.kind is EventKind.EMPTY_CACHE:
            writer.empty_cache()
    return {"segments": _segment_entries(writer), "device_traces": [writer.trace]}


@dataclass(slots=True)
class _TraceWriter:
    """The replay up to the snapshot, writing ``device_traces[0]`` as it goes: the model, its live blocks with
    their frames, and the segments the trace has announced."""

    model: CachingAllocatorModel
    live: dict[int, Block] = field(default_factory=dict)
    frames: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    trace: list[dict[str, Any]] = field(default_factory=list)
    known: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Segment id -> (address, size) of each ``segment_alloc`` not yet freed."""

    def alloc(self, ev: AllocEvent, f: list[dict[str, Any]]) -> bool:
        """An ``alloc`` entry, after the segments it maps; on failure an ``oom`` entry, and False."""
        model = self.model
        segments_before = (model.segments, model.num_device_free)
        blk = model.malloc(ev.size)
        if blk is None:
            self.trace.append(
                {
                    "action": "oom",
                    "addr": 0,
                    "size": model.last_oom.rounded_bytes if model.last_oom else ev.size,
                    "stream": 0,
                    "device_free": max(model.capacity - model.reserved, 0),
                    "frames": f,
                }
            )
            self.sync_segments()
            return False
        self.live[ev.id], self.frames[ev.id] = blk, f
        if (model.segments, model.num_device_free) != segments_before or blk.seg not in self.known:
            self.sync_segments()
        # "category": as torch's own _memory_viz._profile_to_snapshot writes on its alloc entries
        category = ev.category.value if ev.category is not None else "unknown"
        self.trace.append(
            {"action": "alloc", "addr": blk.addr, "size": ev.size, "stream": 0, "frames": f, "category": category}
        )
        return True

    def free(self, sid: int) -> None:
        """``free_requested`` and ``free_completed`` (one stream: nothing waits on an event)."""
        blk = self.live.pop(sid)
        f = self.frames.pop(sid)
        for action in ("free_requested", "free_completed"):
            self.trace.append({"action": action, "addr": blk.addr, "size": blk.requested, "stream": 0, "frames": f})
        self.model.free(blk)

    def empty_cache(self) -> None:
        self.model.empty_cache()
        self.sync_segments()

    def sync_segments(self) -> None:
        """``segment_free`` for each announced segment now gone, ``segment_alloc`` for each new one."""
        now = {s: (bs[0].addr, sum(b.size for b in bs)) for s, bs in _segments(self.model, self.live).items()}
        for s in [s for s in self.known if s not in now]:
            addr, size = self.known.pop(s)
            self.trace.append({"action": "segment_free", "addr": addr, "size": size, "stream": 0, "frames": []})
        for s, (addr, size) in now.items():
            if s not in self.known:
                self.known[s] = (addr, size)
                self.trace.append({"action": "segment_alloc", "addr": addr, "size": size, "stream": 0, "frames": []})


def _segment_entries(writer: _TraceWriter) -> list[dict[str, Any]]:
    """``segments``: every segment mapped when the snapshot is taken, by address, with its blocks."""
    by_block = {id(b): writer.frames[sid] for sid, b in writer.live.items()}
    segments = []
    for bs in sorted(_segments(writer.model, writer.live).values(), key=lambda bs: bs[0].addr):
        blocks = [
            {
                "address": b.addr,
                "size": b.size,
                "requested_size": b.requested if b.allocated else 0,
                "state": "active_allocated" if b.allocated else "inactive",
                "frames": by_block.get(id(b), []),
            }
            for b in bs
        ]
        allocated = sum(b.size for b in bs if b.allocated)
        segments.append(
            {
                "device": 0,
                "address": bs[0].addr,
                "total_size": sum(b.size for b in bs),
                "allocated_size": allocated,
                "active_size": allocated,
                "requested_size": sum(b.requested for b in bs if b.allocated),
                "stream": 0,
                "segment_type": "small" if bs[0].small else "large",
                "segment_pool_id": (0, 0),
                "is_expandable": bs[0].expandable,
                "frames": [],
                "blocks": blocks,
            }
        )
    return segments
