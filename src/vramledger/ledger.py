"""The one result type: line items (category, phase, bytes, source) and the peaks derived from them.

Semantics. A line item says: *at the moment this phase reaches its highest allocation, this many bytes of
this category are live.* The lines of one phase therefore add up to that phase's peak allocated bytes, and
the step's peak is the largest phase. Reserve and CUDA context are lines too, but outside "allocated":
reserved = allocated + allocator reserve; device total = reserved + CUDA context (what nvidia-smi shows)
+ NCCL's communicators (with several GPUs: cuMemCreate outside PyTorch's allocator, ``analytic/distributed/nccl.py``)
+ CUDA managed memory (paged optimizer states, allocated by bitsandbytes outside PyTorch's allocator: in neither
``max_memory_allocated`` nor ``max_memory_reserved``, resident on the device until the driver pages it out).

Every engine (analytic, trace, measure) produces this type, so that predicted and measured breakdowns line up
column by column.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple


class Category(str, enum.Enum):
    """The closed set of memory categories, shared by analytic, trace, measure and report."""

    WEIGHTS = "weights"
    MASTER_WEIGHTS = "master_weights"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATIONS = "activations"
    ATTENTION_SCORES = "attention_scores"
    LOGITS_LOSS = "logits_loss"
    KV_CACHE = "kv_cache"
    TEMPORARIES = "temporaries"
    WORKSPACE = "workspace"
    ALLOCATOR_RESERVE = "allocator_reserve"
    CUDA_CONTEXT = "cuda_context"
    MANAGED_MEMORY = "managed_memory"
    """CUDA unified memory outside PyTorch's allocator: bitsandbytes paged optimizer states
    (``optim/optimizer.py`` ``get_state_buffer`` → ``F.get_paged``, ``cudaMallocManaged``)."""
    NCCL = "nccl"
    """NCCL's own device memory with several GPUs: channel structures and protocol buffers of each communicator,
    allocated with ``cuMemCreate`` outside PyTorch's allocator (``analytic/distributed/nccl.py``)."""

    @property
    def allocated(self) -> bool:
        """Counted by ``torch.cuda.memory_allocated`` (live tensors handed out by the caching allocator)."""
        return self not in OUTSIDE_ALLOCATED

    @property
    def display(self) -> str:
        return _TITLES[self]


OUTSIDE_ALLOCATED = (Category.ALLOCATOR_RESERVE, Category.CUDA_CONTEXT, Category.MANAGED_MEMORY, Category.NCCL)
"""The categories ``Category.allocated`` is false for; hot loops test ``c not in OUTSIDE_ALLOCATED`` themselves (the
property's call costs more than the test)."""

_TITLES = {
    Category.WEIGHTS: "weights",
    Category.MASTER_WEIGHTS: "fp32 master weights",
    Category.GRADIENTS: "gradients",
    Category.OPTIMIZER_STATE: "optimizer state",
    Category.ACTIVATIONS: "activations (saved)",
    Category.ATTENTION_SCORES: "attention scores",
    Category.LOGITS_LOSS: "logits and loss",
    Category.KV_CACHE: "KV cache",
    Category.TEMPORARIES: "temporaries",
    Category.WORKSPACE: "library workspaces",
    Category.ALLOCATOR_RESERVE: "allocator reserve",
    Category.CUDA_CONTEXT: "CUDA context",
    Category.MANAGED_MEMORY: "paged (CUDA managed)",
    Category.NCCL: "NCCL communicators",
}


class Phase(str, enum.Enum):
    """Phases of a training step (and of evaluation / generation), in time order."""

    LOAD = "load"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    EVAL = "eval"
    GENERATE = "generate"


class Basis(str, enum.Enum):
    """Where a number comes from. We always say which."""

    FORMULA = "formula"  # an analytic formula with a cited source
    TRACE = "trace"  # counted from the real model code run on fake tensors
    MEASUREMENT = "measurement"  # measured on a real GPU (committed data)
    ASSUMPTION = "assumption"  # a stated assumption with its evidence, awaiting measurement


@dataclass(frozen=True, kw_only=True, slots=True)
class LineItem:
    """Bytes of one category live at the peak moment of one phase."""

    category: Category
    """Which line of the bill."""
    phase: Phase
    """The phase whose peak moment this describes."""
    bytes: int
    """Size in bytes (never negative)."""
    label: str
    """Short human description, e.g. ``"AdamW exp_avg + exp_avg_sq (bf16)"``."""
    source: str
    """The formula and its citation (upstream file and function, or paper and equation)."""
    basis: Basis = Basis.FORMULA
    """Whether this is a formula, a trace, a measurement or a stated assumption."""

    def __post_init__(self) -> None:
        assert self.bytes >= 0, f"negative line item {self.label}: {self.bytes}"


@dataclass(frozen=True, kw_only=True, slots=True)
class TimelineSample:
    """Live allocated bytes after one event of a traced step (kept as data for the report to plot)."""

    index: int
    """Event number within the trace."""
    phase: Phase
    live_bytes: int
    by_category: Mapping[Category, int]
    op: str = ""
    module: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    """Whether the step fits on a GPU, with the headroom made explicit."""

    gpu: str
    capacity_bytes: int
    headroom_fraction: float
    usable_bytes: int
    device_total_bytes: int
    fits: bool
    margin_bytes: int
    """usable − device total: positive when it fits, negative by how much it misses."""
    without_cache_bytes: int = 0
    """The device total less the allocator's cache (reserved − allocated) at each phase's peak, the largest over the
    phases: what must fit once the caching allocator has freed its cache. Before it raises out of memory it does
    (torch c10/cuda/CUDACachingAllocator.cpp ``malloc``: ``release_cached_blocks`` then a retry, counted in
    ``num_alloc_retries``), so a step whose device total is over but whose figure here is under may still run, more
    slowly, and fragmentation inside live segments can still fail it. 0 when not computed."""


_PHASE_INDEX = {p: n for n, p in enumerate(Phase)}
_DEVICE_ONLY = (Category.CUDA_CONTEXT, Category.MANAGED_MEMORY, Category.NCCL)
"""On the device outside PyTorch's allocator: in the device total, not in reserved."""


class _PhaseSums(NamedTuple):
    """A phase's lines summed: the allocated ones, the allocator's reserve and those outside the allocator."""

    allocated: int
    reserve: int
    outside: int

    @property
    def reserved(self) -> int:
        return self.allocated + self.reserve

    @property
    def device(self) -> int:
        return self.allocated + self.reserve + self.outside


_NO_BYTES = _PhaseSums(0, 0, 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Ledger:
    """An itemised bill of GPU memory for one training step (and evaluation, when modelled)."""

    model: str
    params: int
    trainable_params: int
    items: tuple[LineItem, ...]
    engine: str
    """``analytic``, ``trace`` or ``measure``."""
    moments: Mapping[Phase, str] = field(default_factory=lambda: MappingProxyType({}))
    """For each phase, the moment within it that holds its peak (op and module, in words)."""
    verdict: Verdict | None = None
    advice: str = ""
    """One sentence naming the biggest line and what would shrink it."""
    warnings: tuple[str, ...] = ()
    settings: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    """The resolved settings that produced this ledger (for display and JSON)."""
    timeline: tuple[TimelineSample, ...] = ()
    """Live bytes over the step, from a trace (empty for the analytic engine)."""

    # -- derived -------------------------------------------------------------------------------------------
    @property
    def phases(self) -> tuple[Phase, ...]:
        seen = {i.phase for i in self.items}
        return tuple(p for p in Phase if p in seen)

    def bytes_of(self, category: Category, phase: Phase) -> int:
        return sum(i.bytes for i in self.items if i.category is category and i.phase is phase)

    def allocated(self, phase: Phase) -> int:
        """Peak allocated bytes within ``phase``: the sum of its allocated lines."""
        return sum(i.bytes for i in self.items if i.phase is phase and i.category.allocated)

    def reserved(self, phase: Phase) -> int:
        return self._sums().get(phase, _NO_BYTES).reserved

    def device(self, phase: Phase) -> int:
        return self._sums().get(phase, _NO_BYTES).device

    def by_category(self, phase: Phase) -> dict[Category, int]:
        """The bytes of each category within ``phase``, in ``Category`` order, those with none left out."""
        sums = dict.fromkeys(Category, 0)
        for i in self.items:
            if i.phase is phase:
                sums[i.category] += i.bytes
        return {c: n for c, n in sums.items() if n}

    @property
    def peak_phase(self) -> Phase:
        """The phase holding the peak device total (ties go to the earlier phase)."""
        sums = self._sums()
        return max(sums, key=lambda p: (sums[p].device, sums[p].allocated, -_PHASE_INDEX[p]))

    @property
    def peak_allocated(self) -> int:
        return max((s.allocated for s in self._sums().values()), default=0)

    @property
    def peak_reserved(self) -> int:
        return max((s.reserved for s in self._sums().values()), default=0)

    @property
    def device_total(self) -> int:
        return max((s.device for s in self._sums().values()), default=0)

    @property
    def device_total_without_cache(self) -> int:
        """The device total with no allocator cache at any phase (``Verdict.without_cache_bytes``)."""
        return max((s.device - s.reserve for s in self._sums().values()), default=0)

    def _sums(self) -> dict[Phase, _PhaseSums]:
        """Each phase's sums, in ``Phase`` order, from one pass over the lines: the peaks compare every phase's, and
        an estimate asks for them several times (a pass per phase and per term cost it a third of its time)."""
        sums: dict[Phase, list[int]] = {}
        for i in self.items:
            s = sums.setdefault(i.phase, [0, 0, 0])
            if i.category not in OUTSIDE_ALLOCATED:
                s[0] += i.bytes
            elif i.category is Category.ALLOCATOR_RESERVE:
                s[1] += i.bytes
            elif i.category in _DEVICE_ONLY:
                s[2] += i.bytes
        return {p: _PhaseSums(*sums[p]) for p in Phase if p in sums}

    def categories(self) -> tuple[Category, ...]:
        seen = {i.category for i in self.items}
        return tuple(c for c in Category if c in seen)

    def with_items(self, items: Iterable[LineItem]) -> Ledger:
        from dataclasses import replace

        return replace(self, items=tuple(items))


def make_verdict(
    device_total: int, gpu_name: str, capacity: int, headroom_fraction: float, *, without_cache: int = 0
) -> Verdict:
    """Compare a device total with a GPU's capacity less the headroom (``without_cache``: the same total with no
    allocator cache, ``Ledger.device_total_without_cache``)."""
    usable = int(capacity * (1.0 - headroom_fraction))
    return Verdict(
        gpu=gpu_name,
        capacity_bytes=capacity,
        headroom_fraction=headroom_fraction,
        usable_bytes=usable,
        device_total_bytes=device_total,
        fits=device_total <= usable,
        margin_bytes=usable - device_total,
        without_cache_bytes=without_cache,
    )


def ledger_verdict(ledger: Ledger, gpu_name: str, capacity: int, headroom_fraction: float) -> Verdict:
    """The verdict of a ledger on a GPU: its device total, and the same without the allocator's cache."""
    return make_verdict(
        ledger.device_total,
        gpu_name,
        capacity,
        headroom_fraction,
        without_cache=ledger.device_total_without_cache,
    )
