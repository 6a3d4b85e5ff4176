"""Join the evidence of an out-of-memory failure into one post-mortem: where the memory went, why the request
failed, how it compares with the prediction, and the cheapest fixes, priced.

Evidence comes from an OOM message (``explain.oom_message``), a snapshot (``explain.snapshot``), the OOM
observer's arguments (the callback) or a record written by either; ``diagnose`` takes whichever figures are
there, the most direct first (a snapshot's blocks over the message's rounded figures).

Causes, in the order they are tested:
- ``request_exceeds_gpu``: one allocation larger than the GPU (or its memory-fraction cap); nothing but a smaller
  tensor helps;
- ``fragmentation``: the allocator held at least the request in free cached blocks, but no block was large enough.
  Before raising, ``DeviceCachingAllocator::malloc`` has already released every wholly free cached segment
  (``release_cached_blocks``), so what stays cached is free space inside segments that also hold live blocks
  (c10/cuda/CUDACachingAllocator.cpp, the comment above the OOM message). ``expandable_segments:True`` lets
  a segment grow and unmap its free pages instead (``Note [Expandable Segments]``);
- ``other_processes``: other processes on the GPU hold at least the request and the device has less than it free;
- ``memory_fraction_cap``: ``set_per_process_memory_fraction`` capped the allocator below the GPU, and the
  request would have fitted under the GPU's capacity;
- ``driver_refused``: the driver reported at least the request free (``cudaMemGetInfo``, read after the failure),
  yet ``cudaMalloc`` failed: the device's free memory is not contiguous (other allocations outside PyTorch, the
  display driver on Windows/WDDM), or something freed memory between the failure and the reading;
- ``capacity``: the live tensors plus the request exceed what the GPU gives this process: shrink the step;
- ``unknown``: only the request is known.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vramledger.explain.attribute import Share
from vramledger.explain.oom_message import OomMessage
from vramledger.explain.snapshot import SMALL_SIZE, SnapshotFacts
from vramledger.ledger import Ledger, Phase


class Diagnosis(str, enum.Enum):
    REQUEST_EXCEEDS_GPU = "request_exceeds_gpu"
    FRAGMENTATION = "fragmentation"
    OTHER_PROCESSES = "other_processes"
    MEMORY_FRACTION_CAP = "memory_fraction_cap"
    DRIVER_REFUSED = "driver_refused"
    CAPACITY = "capacity"
    UNKNOWN = "unknown"


EXPANDABLE_FIX = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
EXPANDABLE_PRICE = "slightly slower first allocations while segments grow (Note [Expandable Segments])"


@dataclass(frozen=True, kw_only=True, slots=True)
class Evidence:
    """Everything known about one OOM; None where nothing says."""

    source: str
    """What was read (file names, or ``the OOM observer``)."""
    message: OomMessage | None = None
    snapshot: SnapshotFacts | None = None
    shares: tuple[Share, ...] = ()
    requested_bytes: int | None = None
    capacity_bytes: int | None = None
    free_bytes: int | None = None
    allowed_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    phase: str | None = None
    """The phase that was running (the callback's, or the ground-truth record's)."""
    step: int | None = None
    batch: Mapping[str, Any] | None = None
    """The batch that was running: shape, tokens, the longest so far."""
    recorded_setup: Mapping[str, Any] | None = None
    """The setup a callback predicted for (``explain.setup_to_record``), the format of its fixes, its device."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Fix:
    """One remedy, priced, in the user's own keys where the adapters can write them."""

    title: str
    change: str
    keys: Mapping[str, object] = field(default_factory=dict)
    """Framework keys that change (``per_device_train_batch_size: 4``); empty when none express it."""
    memory_saved_bytes: int | None = None
    time_cost_s: float | None = None
    """Seconds per optimizer step added (negative: faster); None when not priced."""
    fits: bool | None = None
    price: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class Comparison:
    """The prediction beside what the run needed."""

    ledger: Ledger
    phase: Phase
    """The phase compared: the one that failed when known, else the predicted peak."""
    predicted_allocated_bytes: int
    predicted_reserved_bytes: int
    needed_allocated_bytes: int | None
    """Allocated at the failure plus the request: a lower bound on what the step needed."""
    predicted_fits: bool | None


@dataclass(frozen=True, kw_only=True, slots=True)
class PostMortem:
    evidence: Evidence
    requested_bytes: int | None
    capacity_bytes: int | None
    free_bytes: int | None
    process_bytes: int | None
    allowed_bytes: int | None
    allocated_bytes: int | None
    reserved_bytes: int | None
    cached_free_bytes: int | None
    """Reserved − allocated."""
    largest_free_block_bytes: int | None
    """The largest free cached block of the pool the request comes from (snapshot only)."""
    other_processes_bytes: int | None
    own_pid_inferred: int | None = None
    """The ``Process p has P`` line taken for this process (``own_process_line``): the message had no
    ``this process`` line, and the figures say one of the listed processes is this one."""
    diagnosis: Diagnosis
    reason: str
    comparison: Comparison | None = None
    fixes: tuple[Fix, ...] = ()
    notes: tuple[str, ...] = ()


# ``format_size`` prints two decimals of the unit: a figure in GiB is exact to ±5.12 MiB.
_PRINTED = 6 * 2**20


def own_process_line(lines: tuple[tuple[int, int], ...], reserved: int, used: int) -> int | None:
    """The pid of the ``Process p has P memory in use`` line that is this process, where the message has no
    ``this process`` line; None where the figures do not say.

    ``reportProcessMemoryInfo`` (c10/cuda/CUDACachingAllocator.cpp) lists NVML's processes on the device and words
    the one whose pid equals ``getpid()`` as ``Including non-PyTorch memory, this process has P``. NVML reports the
    host's pids, so in a container with a pid namespace of its own (Docker's default) no pid matches and this
    process is listed as another one (nvidia-docker#179, "the driver is not aware of the PID namespace"). Every
    process's NVML figure is part of the device's used memory (capacity − free), and this process's is at least
    what PyTorch reserves; so when the listed figures plus the reserve exceed the used memory (beyond the message's
    rounding), one of the lines is this process: the smallest that holds the reserve."""
    if not lines:
        return None
    slack = _PRINTED * (len(lines) + 3)
    if sum(b for _, b in lines) + reserved <= used + slack:
        return None
    holding = [(b, pid) for pid, b in lines if b + _PRINTED >= reserved]
    return min(holding)[1] if holding else None


def _first(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)


def diagnose(ev: Evidence, *, comparison: Comparison | None = None, fixes: tuple[Fix, ...] = ()) -> PostMortem:
    """The cause of the OOM in ``ev`` (see the module docstring) with the figures it rests on."""
    msg, snap = ev.message, ev.snapshot
    requested = _first(
        ev.requested_bytes, snap.oom_request_bytes if snap else None, msg.requested_bytes if msg else None
    )
    allocated = _first(snap.allocated_bytes if snap else None, ev.allocated_bytes, msg.allocated_bytes if msg else None)
    reserved = _first(snap.reserved_bytes if snap else None, ev.reserved_bytes, msg.reserved_bytes if msg else None)
    capacity = _first(ev.capacity_bytes, msg.capacity_bytes if msg else None)
    allowed = _first(ev.allowed_bytes, msg.allowed_bytes if msg else None)
    free = _first(ev.free_bytes, snap.oom_device_free_bytes if snap else None, msg.free_bytes if msg else None)
    lines = msg.other_processes if msg else ()
    process = msg.process_bytes if msg else None
    own_pid = None
    if process is None and reserved is not None and capacity is not None and free is not None:
        own_pid = own_process_line(lines, reserved, capacity - free)
        if own_pid is not None:
            process = next(b for pid, b in lines if pid == own_pid)
            lines = tuple(line for line in lines if line[0] != own_pid)
    others = sum(b for _, b in lines) if lines else None
    cached_free = None if reserved is None or allocated is None else reserved - allocated
    largest = None
    if snap is not None:
        small = requested is not None and requested <= SMALL_SIZE
        largest = snap.largest_free_small_bytes if small else snap.largest_free_block_bytes
    cause, reason = _cause(requested, capacity, allowed, free, allocated, cached_free, largest, others)
    notes = []
    if process is not None and reserved is not None:
        notes.append(f"non_pytorch_bytes={process - reserved}")
    return PostMortem(
        evidence=ev,
        requested_bytes=requested,
        capacity_bytes=capacity,
        free_bytes=free,
        process_bytes=process,
        own_pid_inferred=own_pid,
        allowed_bytes=allowed,
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        cached_free_bytes=cached_free,
        largest_free_block_bytes=largest,
        other_processes_bytes=others,
        diagnosis=cause,
        reason=reason,
        comparison=comparison,
        fixes=fixes,
        notes=tuple(notes),
    )


def _cause(
    requested: int | None,
    capacity: int | None,
    allowed: int | None,
    free: int | None,
    allocated: int | None,
    cached_free: int | None,
    largest: int | None,
    others: int | None,
) -> tuple[Diagnosis, str]:
    """Reason codes for the renderer; the figures go with them (see ``report.postmortem``)."""
    if requested is None:
        return Diagnosis.UNKNOWN, "no_request"
    limit = min(v for v in (capacity, allowed) if v is not None) if (capacity or allowed) else None
    if limit is not None and requested > limit:
        return Diagnosis.REQUEST_EXCEEDS_GPU, "request_over_limit"
    if cached_free is not None and cached_free >= requested and (largest is None or largest < requested):
        return Diagnosis.FRAGMENTATION, "cached_but_split" if largest is not None else "cached_at_least_request"
    if others is not None and others >= requested and free is not None and free < requested:
        return Diagnosis.OTHER_PROCESSES, "others_hold_it"
    if (
        allowed is not None
        and capacity is not None
        and allowed < capacity
        and allocated is not None
        and allocated + requested <= capacity
    ):
        return Diagnosis.MEMORY_FRACTION_CAP, "under_capacity_over_cap"
    if free is not None and free >= requested:
        return Diagnosis.DRIVER_REFUSED, "device_free_but_cudamalloc_failed"
    if allocated is None and free is None:
        return Diagnosis.UNKNOWN, "only_request"
    return Diagnosis.CAPACITY, "live_plus_request_over_limit"


def shortfall(pm: PostMortem) -> int:
    """Bytes the failed step lacked, as far as the evidence says: live + request over the limit (the cap, else the
    capacity less what is outside PyTorch's allocator); the request alone when that is all we know."""
    req = pm.requested_bytes or 0
    limit = pm.allowed_bytes or pm.capacity_bytes
    if pm.allocated_bytes is None or limit is None:
        return req
    outside = 0 if pm.process_bytes is None or pm.reserved_bytes is None else pm.process_bytes - pm.reserved_bytes
    return max(req if pm.diagnosis is Diagnosis.FRAGMENTATION else 0, pm.allocated_bytes + req + outside - limit)


def compare(ledger: Ledger, ev: Evidence, requested: int | None, allocated: int | None) -> Comparison:
    """The predicted ledger at the failing phase (or its peak) beside what the run needed."""
    phase = ledger.peak_phase
    if ev.phase in {p.value for p in ledger.phases}:
        phase = Phase(ev.phase)
    needed = None if allocated is None or requested is None else allocated + requested
    return Comparison(
        ledger=ledger,
        phase=phase,
        predicted_allocated_bytes=ledger.allocated(phase),
        predicted_reserved_bytes=ledger.reserved(phase),
        needed_allocated_bytes=needed,
        predicted_fits=None if ledger.verdict is None else ledger.verdict.fits,
    )
