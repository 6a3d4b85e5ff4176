"""Read a PyTorch memory snapshot safely and say where its bytes are.

Formats read (the first bytes decide, not the file name):
- ``torch.cuda.memory._dump_snapshot`` output: ``pickle.dump(torch.cuda.memory._snapshot())`` (torch/cuda/memory.py);
- the same gzipped, or as JSON (gzipped or not) — what ``bench/ground_truth/oom_fixtures.py`` writes
  (``oom_<case>.snapshot.pickle.gz`` / ``.snapshot.json.gz``).

Pickles are read by an unpickler that refuses every class: a snapshot is plain dicts, lists, strings and numbers,
so nothing in the file can run code.

The snapshot's structure (``torch.cuda.memory._snapshot`` docstring): ``segments`` (one per cudaMalloc, with
``address``, ``total_size``, ``segment_type`` small|large and ``blocks``: ``address``, ``size``,
``requested_size``, ``state`` active_allocated|active_awaiting_free|inactive, ``frames``: the Python stack of the
allocation, innermost first, when history was recorded) and ``device_traces`` (the recorded alloc/free/segment/oom
actions; an ``oom`` entry carries the failed ``size`` and the driver's ``device_free``).
"""

from __future__ import annotations

import gzip
import io
import json
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramledger.errors import VramledgerError

SMALL_SIZE = 1 << 20
"""``kSmallSize``: requests up to 1 MiB come from the small pool, larger ones from the large pool
(c10/cuda/CUDACachingAllocator.cpp)."""


class _NoClasses(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing {module}.{name}: a memory snapshot holds no objects")


def decode(data: bytes, source: str) -> Any:
    """Bytes of a snapshot (or of any JSON/pickle file we read) → Python data; gzip is undone first."""
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise VramledgerError(f"{source}: a broken gzip file ({exc}); copy it again") from None
    if data[:1] == b"\x80":
        try:
            return _NoClasses(io.BytesIO(data)).load()
        except (pickle.UnpicklingError, EOFError, ValueError) as exc:
            raise VramledgerError(f"{source}: not a memory snapshot pickle ({exc})") from None
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise VramledgerError(
            f"{source}: neither a pickle nor JSON; pass a snapshot from torch.cuda.memory._dump_snapshot"
        ) from None


def is_snapshot(data: Any) -> bool:
    return isinstance(data, Mapping) and isinstance(data.get("segments"), list)


@dataclass(frozen=True, kw_only=True, slots=True)
class Block:
    """One block of a segment, as the snapshot lists it."""

    address: int
    size: int
    requested_size: int
    state: str
    frames: tuple[Mapping[str, Any], ...]
    segment_type: str

    @property
    def live(self) -> bool:
        return self.state in ("active_allocated", "active_awaiting_free")


@dataclass(frozen=True, kw_only=True, slots=True)
class SnapshotFacts:
    """What the allocator held when the snapshot was taken."""

    segments: int
    reserved_bytes: int
    allocated_bytes: int
    """Blocks in use (``active_allocated`` and ``active_awaiting_free``)."""
    cached_free_bytes: int
    """Inactive blocks: reserved but unallocated."""
    largest_free_block_bytes: int
    """The largest inactive block of the large pool (what a request over 1 MiB can use)."""
    largest_free_small_bytes: int
    oom_request_bytes: int | None
    """``size`` of the last ``oom`` trace entry (the rounded request), when history was recorded."""
    oom_device_free_bytes: int | None
    blocks: tuple[Block, ...]
    frames_recorded: bool
    """Whether any live block carries a stack (history was on when it was allocated)."""


def _int(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def device_trace(snapshot: Mapping[str, Any], device: int) -> Sequence[Any]:
    """The recorded actions of one device (``device_traces`` is indexed by device)."""
    traces: Sequence[Any] = snapshot.get("device_traces") or []
    return traces[device] if 0 <= device < len(traces) and isinstance(traces[device], list) else []


def failed_device(snapshot: Mapping[str, Any]) -> int:
    """The device whose trace holds an ``oom`` entry (the last such), else the first device with segments, else 0."""
    traces = snapshot.get("device_traces") or []
    for device in reversed(range(len(traces))):
        if any(isinstance(e, Mapping) and e.get("action") == "oom" for e in device_trace(snapshot, device)):
            return device
    for seg in snapshot.get("segments") or []:
        if isinstance(seg, Mapping) and isinstance(seg.get("device"), int):
            return int(seg["device"])
    return 0


def facts(snapshot: Mapping[str, Any], device: int = 0) -> SnapshotFacts:
    """Sum the segments and blocks of ``snapshot``; find the last OOM in ``device``'s trace."""
    blocks: list[Block] = []
    reserved = 0
    segments = snapshot.get("segments") or []
    for seg in segments:
        if not isinstance(seg, Mapping):
            continue
        if "device" in seg and _int(seg.get("device")) != device:
            continue
        reserved += _int(seg.get("total_size"))
        kind = str(seg.get("segment_type", "large"))
        for b in seg.get("blocks") or []:
            if isinstance(b, Mapping):
                frames = tuple(f for f in (b.get("frames") or []) if isinstance(f, Mapping))
                blocks.append(
                    Block(
                        address=_int(b.get("address")),
                        size=_int(b.get("size")),
                        requested_size=_int(b.get("requested_size")),
                        state=str(b.get("state", "")),
                        frames=frames,
                        segment_type=kind,
                    )
                )
    live = [b for b in blocks if b.live]
    free = [b for b in blocks if not b.live]
    oom_size = oom_free = None
    for entry in reversed(device_trace(snapshot, device)):
        if isinstance(entry, Mapping) and entry.get("action") == "oom":
            oom_size, oom_free = _int(entry.get("size")), _int(entry.get("device_free"))
            break
    return SnapshotFacts(
        segments=len(segments),
        reserved_bytes=reserved,
        allocated_bytes=sum(b.size for b in live),
        cached_free_bytes=sum(b.size for b in free),
        largest_free_block_bytes=max((b.size for b in free if b.segment_type != "small"), default=0),
        largest_free_small_bytes=max((b.size for b in free if b.segment_type == "small"), default=0),
        oom_request_bytes=oom_size,
        oom_device_free_bytes=oom_free,
        blocks=tuple(blocks),
        frames_recorded=any(b.frames for b in live),
    )


def read_snapshot(path: Path) -> dict[str, Any]:
    """A snapshot file (pickle or JSON, gzipped or not) as its dictionary."""
    try:
        data = decode(path.read_bytes(), str(path))
    except OSError as exc:
        raise VramledgerError(f"{path}: cannot read it ({exc.strerror}); check the path") from None
    if not is_snapshot(data):
        raise VramledgerError(
            f"{path}: not a memory snapshot (no 'segments'); pass a torch.cuda.memory._dump_snapshot file"
        )
    return dict(data)
