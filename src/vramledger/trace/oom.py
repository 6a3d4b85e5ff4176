"""From traced tensor events to device memory: the caching allocator's reserve, the CUDA context, the BLAS
workspaces, and where a step would run out of memory on a given GPU.

The trace sees only op outputs. Three things a CUDA run adds are put in here:

- cuBLAS and cuBLASLt workspaces, allocated *through* the caching allocator by the first matmul on each
  thread's handle (torch ``CublasHandlePool.cpp`` ``getCurrentCUDABlasHandle`` / ``getCUDABlasLtWorkspace``;
  sizes and sources in ``catalog/device_overhead.json``). They are inserted into the replay before the first
  ``mm``-like op of the forward (the Python thread's handle) and of the backward (the autograd engine's device
  thread has its own handle), and never freed (the handle pool keeps them until exit).
- The caching allocator's reserve: the events replayed through ``CachingAllocatorModel`` (a port of
  ``CUDACachingAllocator.cpp``) with unlimited capacity; at each phase's peak moment, reserved − allocated.
- The CUDA context, outside PyTorch (``analytic/overhead.py``: a stated assumption until measured).

With a GPU, the events are replayed again with the capacity torch can obtain (the GPU's memory less the CUDA
context): the first allocation that fails there, after the allocator has freed its cache and retried, is the
OOM point.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from vramledger.allocator.conf import DEFAULT_CONF, AllocatorConf
from vramledger.allocator.model import CachingAllocatorModel
from vramledger.allocator.replay import AllocEvent, EventKind, OomReport, replay
from vramledger.analytic.overhead import CONTEXT_SOURCE, cuda_context_bytes, obtainable_bytes
from vramledger.catalog.device_overhead import DeviceOverhead, device_overhead
from vramledger.errors import VramledgerError
from vramledger.ledger import Basis, Category, LineItem, Phase
from vramledger.specs import GPUSpec
from vramledger.trace.ledger_build import PhasePeak
from vramledger.trace.recorder import Event

RESERVE_SOURCE = "allocator replay of the traced events (allocator/model.py, ported from CUDACachingAllocator.cpp)"
WORKSPACE_SOURCE = (
    "torch CublasHandlePool.cpp getChosenWorkspaceSize / getCUDABlasLtWorkspaceSize: one cuBLAS and one cuBLASLt "
    "workspace per thread's handle (forward thread, autograd backward thread), allocated by the first matmul; "
    "catalog/device_overhead.json"
)
# aten ops that call cuBLAS (at::cuda::blas gemm / bgemm / gemm_and_bias / scaled_gemm).
_BLAS_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_scaled_mm", "addmv", "mv"})
_WORKSPACE_ID_BASE = -(1 << 40)  # ids no traced storage uses


@dataclass(frozen=True, kw_only=True, slots=True)
class OomPoint:
    """The first allocation that fails, in the trace's own words: where (op, module, phase, step) and the
    allocator's account of it (``report``: sizes, live and reserved bytes, free but unusable memory)."""

    op: str
    module: str
    phase: Phase
    step: int
    category: str
    report: OomReport

    def to_dict(self) -> dict[str, Any]:
        r = self.report
        return {
            "op": self.op,
            "module": self.module,
            "phase": self.phase.value,
            "step": self.step,
            "category": self.category,
            "requested_bytes": r.requested_bytes,
            "allocated_bytes": r.allocated_bytes,
            "reserved_bytes": r.reserved_bytes,
            "capacity_bytes": r.capacity_bytes,
            "free_cached_bytes": r.free_cached_bytes,
            "free_device_bytes": r.free_device_bytes,
            "largest_free_block_bytes": r.largest_free_block_bytes,
            "unusable_free_bytes": r.unusable_free_bytes,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplayOutcome:
    """One replay of a trace through the caching-allocator model."""

    conf: str
    """The ``PYTORCH_CUDA_ALLOC_CONF`` text replayed (empty: torch's defaults)."""
    capacity_bytes: int | None
    """What torch could obtain from the driver (``None``: unlimited)."""
    outside_bytes: int
    """Device memory other libraries hold besides the CUDA context, taken off the capacity (NCCL's communicators)."""
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    reserve_at_peak_bytes: int
    """Reserved − allocated when reserved peaked."""
    largest_free_block_at_peak_bytes: int
    segments_at_peak: int
    num_alloc_retries: int
    """Allocations that needed the cache freed and a retry (slow, and a sign of pressure)."""
    oom: OomPoint | None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in self.__slots__ if k != "oom"}
        out["oom"] = None if self.oom is None else self.oom.to_dict()
        return out


def _overhead(gpu: GPUSpec | None) -> DeviceOverhead:
    # Same choice as analytic/overhead.py cublas_workspace_bytes: Hopper's figures without a GPU or for an
    # architecture without figures (the largest NVIDIA workspaces).
    try:
        return device_overhead(gpu.arch if gpu is not None and gpu.arch else "hopper")
    except VramledgerError:
        return device_overhead("hopper")


def _workspace_positions(events: Sequence[Event]) -> list[int]:
    """Original event indices before which each thread's handle allocates its workspaces."""
    positions: list[int] = []
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        first = next((i for i, e in enumerate(events) if e.phase is phase and e.kind == "alloc"), None)
        blas = next(
            (i for i, e in enumerate(events) if e.phase is phase and e.kind == "alloc" and e.op in _BLAS_OPS), first
        )
        if blas is not None:
            positions.append(blas)
    return positions


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceEvents:
    """The trace's device allocations as allocator events, with the BLAS workspaces inserted."""

    events: tuple[AllocEvent, ...]
    origin: tuple[int, ...]
    """For each event, the index of the trace event it came from (-1: an inserted workspace)."""
    workspace_at: tuple[int, ...]
    """Trace event indices before which each handle's workspaces are allocated."""
    workspace_sizes: tuple[int, ...]
    """Block sizes of one handle's workspaces (cuBLAS, cuBLASLt)."""
    streams: dict[int, str] = field(default_factory=dict)
    """Storage id → the non-default CUDA stream it was allocated on (FSDP's collectives: trace/distributed.py)."""

    def workspace_live(self, index: int) -> int:
        """Workspace bytes live after trace event ``index``."""
        return sum(sum(self.workspace_sizes) for pos in self.workspace_at if pos <= index)


def device_events(events: Sequence[Event], gpu: GPUSpec | None) -> DeviceEvents:
    """Convert trace events (``host`` ones dropped) to ``AllocEvent``s and insert the BLAS workspaces."""
    ov = _overhead(gpu)
    sizes = (ov.cublas_workspace.bytes, ov.cublaslt_workspace.bytes)
    positions = _workspace_positions(events)
    out: list[AllocEvent] = []
    origin: list[int] = []
    next_ws = _WORKSPACE_ID_BASE
    for i, e in enumerate(events):
        if i in positions:
            for size in sizes:
                out.append(
                    AllocEvent.alloc(
                        next_ws,
                        size,
                        op=f"cuBLAS workspace (first {e.op})",
                        module=e.module,
                        phase=e.phase,
                        category=Category.WORKSPACE,
                    )
                )
                origin.append(-1)
                next_ws += 1
        if e.category == "host":
            continue
        cat = Category(e.category) if e.category else None
        if e.kind == "alloc":
            out.append(AllocEvent.alloc(e.storage, e.bytes, op=e.op, module=e.module, phase=e.phase, category=cat))
        else:
            out.append(AllocEvent.free(e.storage, op=e.op, module=e.module, phase=e.phase, category=cat))
        origin.append(i)
    return DeviceEvents(
        events=tuple(out),
        origin=tuple(origin),
        workspace_at=tuple(positions),
        workspace_sizes=sizes,
        streams={e.storage: e.stream for e in events if e.stream},
    )


def stream_pools(dev: DeviceEvents, conf: AllocatorConf = DEFAULT_CONF) -> Iterator[dict[str, CachingAllocatorModel]]:
    """Replay ``dev`` with one caching-allocator pool per stream (``""`` the default stream), on a device without a
    capacity limit: yields the pools after each event, in the order of ``dev.events``.

    One pool per stream: CUDACachingAllocator.cpp never serves a request from a block cached for another stream
    (get_free_block searches BlockPool keys that include the stream); a block returns to its own stream's pool.
    """
    models: dict[str, CachingAllocatorModel] = {}
    live: dict[int, Any] = {}
    for ev in dev.events:
        stream = dev.streams.get(ev.id, "")
        if stream not in models:
            models[stream] = CachingAllocatorModel(conf)
        model = models[stream]
        if ev.kind is EventKind.ALLOC:
            live[ev.id] = model.malloc(ev.size) if ev.size else None
        elif ev.kind is EventKind.FREE:
            blk = live.pop(ev.id)
            if blk is not None:
                model.free(blk)
        yield models


def reserved_at(dev: DeviceEvents, indices: set[int], conf: AllocatorConf = DEFAULT_CONF) -> dict[int, int]:
    """Reserved memory (every stream's pool) right after each trace event in ``indices``.

    The same rules as :func:`vramledger.allocator.replay.replay` (``malloc``/``free`` of
    ``CachingAllocatorModel``), with reserved read after the events asked for.
    """
    return {
        src: sum(m.reserved for m in models.values())
        for src, models in zip(dev.origin, stream_pools(dev, conf), strict=True)
        if src in indices
    }


def replay_outcome(
    dev: DeviceEvents,
    trace: Sequence[Event],
    *,
    conf: AllocatorConf = DEFAULT_CONF,
    gpu: GPUSpec | None = None,
    outside_bytes: int = 0,
) -> ReplayOutcome:
    """Replay on ``gpu`` (capacity = its memory − the CUDA context − ``outside_bytes``, what other libraries such as
    NCCL hold outside torch's allocator) or on an unlimited device."""
    capacity = obtainable_bytes(gpu)
    if capacity is not None:
        capacity = max(capacity - outside_bytes, 0)
    r = replay(
        dev.events, capacity_bytes=capacity, conf=conf, device_total_bytes=None if gpu is None else gpu.memory_bytes
    )
    oom = None
    if r.oom is not None:
        o = r.oom
        src = dev.origin[o.event_index]
        t = trace[src] if src >= 0 else None
        oom = OomPoint(
            op=o.event.op,
            module=o.event.module,
            phase=o.event.phase or Phase.FORWARD,
            step=t.step if t is not None else 1,
            category=o.event.category.value if o.event.category is not None else "",
            report=o,
        )
    return ReplayOutcome(
        conf=conf.text,
        capacity_bytes=capacity,
        outside_bytes=outside_bytes if capacity is not None else 0,
        peak_allocated_bytes=r.peak_allocated_bytes,
        peak_reserved_bytes=r.peak_reserved_bytes,
        reserve_at_peak_bytes=r.reserve_at_peak_bytes,
        largest_free_block_at_peak_bytes=r.largest_free_block_at_peak_bytes,
        segments_at_peak=r.segments_at_peak,
        num_alloc_retries=r.num_alloc_retries,
        oom=oom,
    )


def device_lines(
    peaks: dict[Phase, PhasePeak],
    allocated: dict[Phase, int],
    dev: DeviceEvents,
    gpu: GPUSpec | None,
    conf: AllocatorConf = DEFAULT_CONF,
) -> list[LineItem]:
    """WORKSPACE, ALLOCATOR_RESERVE and CUDA_CONTEXT lines for every traced phase.

    ``allocated``: the traced tensors' bytes at each phase peak (without workspaces). The reserve line is
    reserved − allocated at the phase's peak moment, so the phase's reserved figure is the replay's reserved
    memory at that moment. (torch's ``max_memory_reserved`` can be a little higher: a small-pool segment made
    later, when less is allocated; the replay's own maximum is in ``ReplayOutcome.peak_reserved_bytes``.)
    """
    reserved = reserved_at(dev, {pk.index for pk in peaks.values()}, conf)
    context = cuda_context_bytes(gpu)
    label = "cached, not allocated (" + (conf.text or "default allocator settings") + ")"
    items: list[LineItem] = []
    for phase in Phase:
        if phase not in peaks:
            continue
        ws = dev.workspace_live(peaks[phase].index)
        if ws:
            items.append(
                LineItem(
                    category=Category.WORKSPACE,
                    phase=phase,
                    bytes=ws,
                    label="cuBLAS + cuBLASLt workspaces (not visible to the trace)",
                    source=WORKSPACE_SOURCE,
                    basis=Basis.FORMULA,
                )
            )
        reserve = max(reserved[peaks[phase].index] - allocated[phase] - ws, 0)
        items.append(
            LineItem(
                category=Category.ALLOCATOR_RESERVE,
                phase=phase,
                bytes=reserve,
                label=label,
                source=RESERVE_SOURCE,
                basis=Basis.FORMULA,
            )
        )
        items.append(
            LineItem(
                category=Category.CUDA_CONTEXT,
                phase=phase,
                bytes=context,
                label="CUDA context",
                source=CONTEXT_SOURCE,
                basis=Basis.ASSUMPTION,
            )
        )
    return items
