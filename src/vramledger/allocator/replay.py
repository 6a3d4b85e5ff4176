"""Replay a trace's allocation/free events through the caching-allocator model, and a cheap reserve estimate.

``replay`` answers: peak allocated and reserved (what ``torch.cuda.max_memory_allocated`` / ``_reserved``
report), fragmentation at the peak (reserved − allocated, the largest cached block), segments, retries, and
for a given capacity the first allocation that fails, with the memory that was free but could not serve it.

``reserve_for_blocks`` serves the analytic path, which knows only the tensors live at a peak.
"""

from __future__ import annotations

import enum
from bisect import bisect_left, insort
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vramledger.allocator.conf import (
    DEFAULT_CONF,
    K_MIN_LARGE_ALLOC,
    K_ROUND_LARGE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    AllocatorConf,
    round_size,
)
from vramledger.allocator.model import Block, CachingAllocatorModel
from vramledger.errors import VramledgerError
from vramledger.ledger import Category, Phase


class EventKind(str, enum.Enum):
    ALLOC = "alloc"
    FREE = "free"
    EMPTY_CACHE = "empty_cache"
    """``torch.cuda.empty_cache()`` called by the training loop."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AllocEvent:
    """One storage allocation or free, in program order, with where it came from."""

    kind: EventKind
    id: int = 0
    """Identifies the storage: a free names the id of an earlier alloc."""
    size: int = 0
    """Requested bytes (allocs only); torch rounds it, the trace need not."""
    op: str = ""
    module: str = ""
    phase: Phase | None = None
    category: Category | None = None

    @classmethod
    def alloc(cls, id: int, size: int, **meta: object) -> AllocEvent:
        return cls(kind=EventKind.ALLOC, id=id, size=size, **meta)  # type: ignore[arg-type]

    @classmethod
    def free(cls, id: int, **meta: object) -> AllocEvent:
        return cls(kind=EventKind.FREE, id=id, **meta)  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True, slots=True)
class OomReport:
    """The first allocation that fails on a device of the given capacity."""

    event_index: int
    event: AllocEvent
    """The failing alloc, with its op, module, phase and category."""
    requested_bytes: int
    rounded_bytes: int
    alloc_bytes: int
    """The cudaMalloc (or page mapping) that could not be satisfied."""
    allocated_bytes: int
    reserved_bytes: int
    """After ``release_cached_blocks``: only segments with a live block remain."""
    capacity_bytes: int
    free_cached_bytes: int
    """Reserved but unallocated: free pieces of partly used segments (torch's "reserved but unallocated")."""
    free_device_bytes: int
    """Capacity − reserved: what the driver could still hand out, but not as one block this large."""
    largest_free_block_bytes: int

    @property
    def unusable_free_bytes(self) -> int:
        """Memory that was free yet could not serve the request: cached pieces plus the device's remainder."""
        return self.free_cached_bytes + self.free_device_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class AllocatorResult:
    """What the caching allocator would have done with a trace."""

    conf: AllocatorConf
    capacity_bytes: int | None
    num_events: int
    """Events replayed (up to and including a failing one)."""
    peak_allocated_bytes: int
    """``max_memory_allocated``: block sizes, i.e. requests after rounding (and unsplit tails)."""
    peak_reserved_bytes: int
    """``max_memory_reserved``."""
    peak_event_index: int | None
    """The event after which reserved memory first reached its peak (``None`` for an empty trace)."""
    reserve_at_peak_bytes: int
    """Reserved − allocated right after ``peak_event_index``."""
    largest_free_block_at_peak_bytes: int
    segments_at_peak: int
    """cudaMalloc segments (plus expandable segments with mapped pages) live at the peak."""
    num_device_alloc: int
    """cudaMalloc and page-mapping calls (``memory_stats()['num_device_alloc']``)."""
    num_device_free: int
    num_alloc_retries: int
    """Allocations that needed ``release_cached_blocks`` and a retry
    (``memory_stats()['num_alloc_retries']``)."""
    final_allocated_bytes: int
    final_reserved_bytes: int
    oom: OomReport | None
    """The first failing allocation, when a capacity was given and one fails; replay stops there."""


def replay(
    events: Iterable[AllocEvent],
    *,
    capacity_bytes: int | None,
    conf: AllocatorConf = DEFAULT_CONF,
    device_total_bytes: int | None = None,
) -> AllocatorResult:
    """Run ``events`` through :class:`CachingAllocatorModel`.

    ``capacity_bytes`` is what the allocator can obtain from the driver: the GPU's memory less the CUDA
    context and anything else outside PyTorch (``None``: unlimited). ``device_total_bytes`` (default: the
    capacity) is only used for ``per_process_memory_fraction`` and ``garbage_collection_threshold``, which
    torch applies to the device total.
    """
    if capacity_bytes is not None and capacity_bytes <= 0:
        raise VramledgerError("replay: capacity_bytes must be positive; pass None for an unlimited device")
    model = CachingAllocatorModel(conf, capacity_bytes=capacity_bytes, device_total_bytes=device_total_bytes)
    live: dict[int, Block | None] = {}  # None: a zero-byte storage (torch allocates nothing)
    peak = _Peak()
    oom: OomReport | None = None
    n = 0
    for n, ev in enumerate(events, start=1):
        i = n - 1
        if ev.kind is EventKind.ALLOC:
            _check_alloc(ev, i, live)
            if ev.size == 0:
                live[ev.id] = None
                continue
            block = model.malloc(ev.size)
            if block is None:
                oom = _oom_report(i, ev, model, capacity_bytes)
                break
            live[ev.id] = block
        elif ev.kind is EventKind.FREE:
            if ev.id not in live:
                raise VramledgerError(f"replay: event {i} frees id {ev.id}, which is not live")
            blk = live.pop(ev.id)
            if blk is not None:
                model.free(blk)
        else:
            model.empty_cache()
        peak.update(model, i)
    return AllocatorResult(
        conf=conf,
        capacity_bytes=capacity_bytes,
        num_events=n,
        peak_allocated_bytes=model.peak_allocated,
        peak_reserved_bytes=model.peak_reserved,
        peak_event_index=peak.index,
        reserve_at_peak_bytes=peak.reserve,
        largest_free_block_at_peak_bytes=peak.largest_free_block,
        segments_at_peak=peak.segments,
        num_device_alloc=model.num_device_alloc,
        num_device_free=model.num_device_free,
        num_alloc_retries=model.num_alloc_retries,
        final_allocated_bytes=model.allocated,
        final_reserved_bytes=model.reserved,
        oom=oom,
    )


def _check_alloc(ev: AllocEvent, i: int, live: dict[int, Block | None]) -> None:
    if ev.id in live:
        raise VramledgerError(f"replay: event {i} allocates id {ev.id} which is still live; free it first")
    if ev.size < 0:
        raise VramledgerError(f"replay: event {i} has negative size {ev.size}")


@dataclass(slots=True)
class _Peak:
    """The event after which reserved memory first reached its peak, and the allocator's state right then."""

    reserved: int = -1
    index: int | None = None
    reserve: int = 0
    """Reserved − allocated."""
    largest_free_block: int = 0
    segments: int = 0

    def update(self, model: CachingAllocatorModel, i: int) -> None:
        if model.peak_reserved > self.reserved:
            self.reserved = model.peak_reserved
            self.index = i
            self.reserve = model.reserved - model.allocated
            self.largest_free_block = model.largest_free_block()
            self.segments = model.num_segments()


def _oom_report(i: int, ev: AllocEvent, model: CachingAllocatorModel, capacity_bytes: int | None) -> OomReport:
    """The failed allocation ``ev`` (event ``i``), with the allocator's state after its failed retry."""
    st = model.last_oom
    assert st is not None
    # Without a capacity only the memory-fraction cap (allowed_memory_maximum) can fail.
    cap = capacity_bytes if capacity_bytes is not None else (model.allowed or st.reserved_bytes)
    return OomReport(
        event_index=i,
        event=ev,
        requested_bytes=ev.size,
        rounded_bytes=st.rounded_bytes,
        alloc_bytes=st.alloc_bytes,
        allocated_bytes=st.allocated_bytes,
        reserved_bytes=st.reserved_bytes,
        capacity_bytes=cap,
        free_cached_bytes=st.reserved_bytes - st.allocated_bytes,
        free_device_bytes=max(cap - st.reserved_bytes, 0),
        largest_free_block_bytes=st.largest_free_block_bytes,
    )


def reserve_for_blocks(sizes: Sequence[int], conf: AllocatorConf = DEFAULT_CONF) -> int:
    """Estimate reserved − live bytes for tensors of ``sizes`` live together, from rounding and segments
    alone.

    Assumption (stated, not measured): the live set is allocated in one pass, largest first, with no frees in
    between, so every cached block is reused best-fit and nothing fragments by churn. It counts what the
    allocator's granularity costs (512 B rounding, 2 MiB small segments, 20 MiB segments for 1-10 MiB
    requests, 2 MiB rounding of larger ones, unsplit tails ≤ 1 MiB) and tends to *under*-estimate a real step,
    where frees and re-allocations of different sizes leave cached pieces that the trace replay sees and this
    does not. Identical to :func:`replay` of the same alloc-only sequence (tested), but a few hundred times
    cheaper: ~1000 sizes in well under a millisecond.
    """
    if any(s < 0 for s in sizes):
        raise VramledgerError("reserve_for_blocks: sizes must be non-negative byte counts")
    total = sum(sizes)
    if any(conf.roundup_power2_divisions):
        rounded = [round_size(s, conf) for s in sizes if s]
    else:  # round_size without power-of-two divisions, inlined: 512-byte multiples
        rounded = [-(-s // 512) * 512 for s in sizes if s]
    small = [r for r in rounded if r <= K_SMALL_SIZE]
    large = [r for r in rounded if r > K_SMALL_SIZE]
    small.sort(reverse=True)
    large.sort(reverse=True)
    if conf.expandable_segments:
        # One segment per pool; blocks tile it (split at any remainder ≥ 512 B), pages mapped as it grows.
        page_l = conf.large_segment_size_bytes
        reserved = -(-sum(large) // page_l) * page_l + -(-sum(small) // K_SMALL_BUFFER) * K_SMALL_BUFFER
        return reserved - total
    reserved = 0
    mss = conf.max_split_size
    free: list[int] = []  # cached free block sizes of the large pool (addresses do not change the total)
    for r in large:
        i = bisect_left(free, r)
        if i < len(free) and not (r < mss <= free[i]) and not (r >= mss and free[i] >= r + conf.max_non_split_rounding):
            block = free.pop(i)
        else:
            block = conf.large_segment_size_bytes if r < K_MIN_LARGE_ALLOC else -(-r // K_ROUND_LARGE) * K_ROUND_LARGE
            reserved += block
        if r < mss and block - r > K_SMALL_SIZE:  # should_split (large pool)
            insort(free, block - r)
    free = []
    for r in small:
        i = bisect_left(free, r)
        if i < len(free):
            block = free.pop(i)
        else:
            block = K_SMALL_BUFFER
            reserved += block
        if block - r >= 512:  # should_split (small pool)
            insort(free, block - r)
    return reserved - total
