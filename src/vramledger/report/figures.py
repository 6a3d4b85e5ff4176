"""The data of each figure, computed from library results: pure functions, no plotting, no printing.

Every renderer (HTML, PNG, terminal bars) draws from these records, so that a test can check that the numbers
plotted are the ledger's numbers. All sizes are bytes; conversion to GiB happens in the renderers.

Figures:
  - the bill: bytes per category stacked per phase, the peak phase marked, the GPU's capacity and usable line;
  - the cliff: device totals over a micro-batch × sequence-length grid, the OOM frontier, and memory against
    batch and against length beside the affine guess (a fixed cost plus a cost per sequence) an engineer
    extrapolates from the two smallest settings;
  - the timeline: live bytes per category across a traced step (only when the ledger carries a timeline);
  - remedies: device memory against step time for each remedy of a plan (only when given).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from vramledger.errors import VramledgerError
from vramledger.ledger import Category, Ledger, Phase
from vramledger.specs import GPUSpec, ModelSpec, TrainSpec
from vramledger.specs.gpu import DEFAULT_HEADROOM

DEFAULT_BATCHES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
DEFAULT_LENGTHS: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384)


# -- the bill ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class BillFigure:
    """Stacked bars: one bar per phase, one segment per category, stacked bottom-up in ``Category`` order."""

    title: str
    phases: tuple[Phase, ...]
    segments: tuple[tuple[Category, tuple[int, ...]], ...]
    """(category, bytes in each phase, aligned with ``phases``); the stack's top is the phase's device total."""
    allocated: tuple[int, ...]
    reserved: tuple[int, ...]
    device: tuple[int, ...]
    """Device total per phase (what nvidia-smi shows): the height of each bar."""
    peak_phase: Phase
    peak_moment: str
    gpu: str | None = None
    capacity_bytes: int | None = None
    usable_bytes: int | None = None
    headroom_fraction: float | None = None

    @property
    def peak_index(self) -> int:
        return self.phases.index(self.peak_phase)


def bill_figure(ledger: Ledger) -> BillFigure:
    """The bill of ``ledger``: every category (allocator reserve and CUDA context included) in every phase."""
    phases = ledger.phases
    segments = tuple(
        (cat, tuple(ledger.bytes_of(cat, p) for p in phases))
        for cat in ledger.categories()
        if any(ledger.bytes_of(cat, p) for p in phases)
    )
    v = ledger.verdict
    return BillFigure(
        title=f"Memory bill: {ledger.model} ({ledger.engine})",
        phases=phases,
        segments=segments,
        allocated=tuple(ledger.allocated(p) for p in phases),
        reserved=tuple(ledger.reserved(p) for p in phases),
        device=tuple(ledger.device(p) for p in phases),
        peak_phase=ledger.peak_phase,
        peak_moment=ledger.moments.get(ledger.peak_phase, ""),
        gpu=None if v is None else v.gpu,
        capacity_bytes=None if v is None else v.capacity_bytes,
        usable_bytes=None if v is None else v.usable_bytes,
        headroom_fraction=None if v is None else v.headroom_fraction,
    )


# -- the cliff ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Curve:
    """Device total against one knob, with the affine guess from the two smallest settings."""

    knob: str
    """``micro_batch`` or ``seq_len``."""
    fixed: int
    """The other knob's value, held fixed along the curve."""
    x: tuple[int, ...]
    device: tuple[int, ...]
    linear_guess: tuple[int, ...]
    """The affine guess people make: a fixed cost plus a cost per sequence (or per token), extrapolated from the
    two smallest settings, ``device[0] + (device[1] − device[0]) × (x − x[0]) / (x[1] − x[0])``. Where the
    curve leaves it (the allocator's reserve, length² attention, the logits) is what the figure shows."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CliffFigure:
    """Device totals over a micro-batch × sequence-length grid (analytic engine) and where they stop fitting."""

    title: str
    batches: tuple[int, ...]
    lengths: tuple[int, ...]
    device: tuple[tuple[int, ...], ...]
    """``device[i][j]``: device total at ``lengths[i]`` and ``batches[j]``."""
    current_batch: int
    current_length: int
    gpu: str | None
    capacity_bytes: int | None
    usable_bytes: int | None
    frontier: tuple[tuple[int, int], ...]
    """(seq_len, largest micro-batch that fits) for each grid length where batch 1 fits, found by bisection
    over whole batches up to the grid's largest; empty without a GPU."""
    by_batch: Curve
    by_length: Curve

    def fits(self, i: int, j: int) -> bool | None:
        """Whether grid cell (length i, batch j) fits the usable memory; None without a GPU."""
        return None if self.usable_bytes is None else self.device[i][j] <= self.usable_bytes


def _device_total(model: ModelSpec, train: TrainSpec, gpu: GPUSpec | None, headroom: float) -> int:
    from vramledger.analytic import estimate

    return estimate(model, train, gpu=gpu, headroom=headroom).device_total


def _largest_batch(
    model: ModelSpec, train: TrainSpec, gpu: GPUSpec | None, headroom: float, usable: int, limit: int
) -> int:
    """Largest micro-batch in [1, limit] whose device total fits ``usable`` (0 when batch 1 does not).

    Bisection is valid because the device total never shrinks as the batch grows (every batch-dependent line,
    activations, logits, attention scores, temporaries, is proportional to the batch in the analytic engine).
    """
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _device_total(model, dataclasses.replace(train, micro_batch=mid), gpu, headroom) <= usable:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _curve(knob: str, fixed: int, xs: Sequence[int], device: Sequence[int]) -> Curve:
    if len(xs) > 1 and xs[1] != xs[0]:
        slope = (device[1] - device[0]) / (xs[1] - xs[0])
        guess = tuple(round(device[0] + slope * (x - xs[0])) for x in xs)
    else:
        guess = tuple(device[0] for _ in xs)
    return Curve(knob=knob, fixed=fixed, x=tuple(xs), device=tuple(device), linear_guess=guess)


def cliff_figure(
    model: ModelSpec,
    train: TrainSpec,
    *,
    gpu: GPUSpec | None = None,
    headroom: float = DEFAULT_HEADROOM,
    batches: Iterable[int] = DEFAULT_BATCHES,
    lengths: Iterable[int] = DEFAULT_LENGTHS,
) -> CliffFigure:
    """Re-estimate ``train`` over a grid of micro-batches and sequence lengths (the current ones included).

    Each cell is ``vramledger.analytic.estimate`` of ``dataclasses.replace(train, micro_batch=b, seq_len=L)``;
    the curves cut the grid at the current length (memory against batch) and the current batch (against length).
    """
    bs = tuple(sorted(set(batches) | {train.micro_batch}))
    ls = tuple(sorted(set(lengths) | {train.seq_len}))
    if not bs or bs[0] < 1 or ls[0] < 1:
        raise VramledgerError("cliff grid: batches and lengths must be positive integers")
    grid = tuple(
        tuple(_device_total(model, dataclasses.replace(train, micro_batch=b, seq_len=L), gpu, headroom) for b in bs)
        for L in ls
    )
    usable = None if gpu is None else int(gpu.memory_bytes * (1.0 - headroom))  # as ledger.make_verdict
    frontier: list[tuple[int, int]] = []
    if usable is not None:
        for L in ls:
            best = _largest_batch(model, dataclasses.replace(train, seq_len=L), gpu, headroom, usable, bs[-1])
            if best:
                frontier.append((L, best))
    i_cur, j_cur = ls.index(train.seq_len), bs.index(train.micro_batch)
    return CliffFigure(
        title=f"OOM cliff: {model.name}, {train.method.value}" + (" + grad ckpt" if train.grad_ckpt else ""),
        batches=bs,
        lengths=ls,
        device=grid,
        current_batch=train.micro_batch,
        current_length=train.seq_len,
        gpu=None if gpu is None else gpu.name,
        capacity_bytes=None if gpu is None else gpu.memory_bytes,
        usable_bytes=usable,
        frontier=tuple(frontier),
        by_batch=_curve("micro_batch", train.seq_len, bs, grid[i_cur]),
        by_length=_curve("seq_len", train.micro_batch, ls, tuple(row[j_cur] for row in grid)),
    )


# -- the timeline ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class TimelineFigure:
    """Live allocated bytes after each traced event, stacked by category, with phase spans and the peak."""

    title: str
    index: tuple[int, ...]
    live: tuple[int, ...]
    layers: tuple[tuple[Category, tuple[int, ...]], ...]
    """(category, live bytes of that category at each sample), in ``Category`` order."""
    spans: tuple[tuple[Phase, int, int], ...]
    """(phase, first event index, last event index) for each run of consecutive samples in one phase."""
    peak_index: int
    """The event index holding the most live bytes (the first such event)."""
    peak_bytes: int
    peak_op: str
    peak_module: str
    gpu: str | None = None
    capacity_bytes: int | None = None
    usable_bytes: int | None = None


def timeline_figure(ledger: Ledger) -> TimelineFigure | None:
    """The traced timeline of ``ledger``, or None when it has none (the analytic engine)."""
    samples = ledger.timeline
    if not samples:
        return None
    cats = tuple(c for c in Category if any(s.by_category.get(c, 0) for s in samples))
    spans: list[tuple[Phase, int, int]] = []
    for s in samples:
        if spans and spans[-1][0] is s.phase:
            spans[-1] = (s.phase, spans[-1][1], s.index)
        else:
            spans.append((s.phase, s.index, s.index))
    peak = max(samples, key=lambda s: (s.live_bytes, -s.index))
    v = ledger.verdict
    return TimelineFigure(
        title=f"Live memory across a step: {ledger.model} ({ledger.engine})",
        index=tuple(s.index for s in samples),
        live=tuple(s.live_bytes for s in samples),
        layers=tuple((c, tuple(s.by_category.get(c, 0) for s in samples)) for c in cats),
        spans=tuple(spans),
        peak_index=peak.index,
        peak_bytes=peak.live_bytes,
        peak_op=peak.op,
        peak_module=peak.module,
        gpu=None if v is None else v.gpu,
        capacity_bytes=None if v is None else v.capacity_bytes,
        usable_bytes=None if v is None else v.usable_bytes,
    )


# -- remedies ----------------------------------------------------------------------------------------------------
@runtime_checkable
class RemedyResult(Protocol):
    """What the report needs of one remedy of a plan (``vramledger.plan`` results satisfy it by duck typing)."""

    @property
    def label(self) -> str: ...

    @property
    def device_bytes(self) -> int: ...

    @property
    def step_seconds(self) -> float: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class RemedyPoint:
    label: str
    device_bytes: int
    step_seconds: float
    fits: bool | None
    """Whether it fits the usable memory; None without a GPU."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RemedyFigure:
    title: str
    points: tuple[RemedyPoint, ...]
    capacity_bytes: int | None = None
    usable_bytes: int | None = None
    gpu: str | None = None


def _as_triple(r: RemedyResult | tuple[str, int, float]) -> tuple[str, int, float]:
    if isinstance(r, tuple):
        label, device, seconds = r
    else:
        label, device, seconds = r.label, r.device_bytes, r.step_seconds
    if device < 0 or seconds < 0:
        raise VramledgerError(f"remedy {label!r}: device bytes and step seconds must be non-negative")
    return str(label), int(device), float(seconds)


def remedies_figure(
    remedies: Iterable[RemedyResult | tuple[str, int, float]] | None, ledger: Ledger | None = None
) -> RemedyFigure | None:
    """Memory against step time for each remedy (``(label, device_bytes, step_seconds)`` or a ``RemedyResult``).

    None when there are no remedies, so that the caller skips the figure. ``ledger`` supplies the GPU lines.
    """
    triples = [_as_triple(r) for r in (remedies or ())]
    if not triples:
        return None
    v = None if ledger is None else ledger.verdict
    usable = None if v is None else v.usable_bytes
    return RemedyFigure(
        title="Remedies: memory against step time" + ("" if ledger is None else f" ({ledger.model})"),
        points=tuple(
            RemedyPoint(label=lab, device_bytes=d, step_seconds=s, fits=None if usable is None else d <= usable)
            for lab, d, s in triples
        ),
        capacity_bytes=None if v is None else v.capacity_bytes,
        usable_bytes=usable,
        gpu=None if v is None else v.gpu,
    )


# -- everything that applies -------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Figures:
    """The figures that apply to one result (absent ones are None)."""

    bill: BillFigure
    cliff: CliffFigure | None = None
    timeline: TimelineFigure | None = None
    remedies: RemedyFigure | None = None

    def present(self) -> tuple[tuple[str, object], ...]:
        """(name, figure) for each figure present, in display order."""
        named = (("bill", self.bill), ("cliff", self.cliff), ("timeline", self.timeline), ("remedies", self.remedies))
        return tuple((n, f) for n, f in named if f is not None)


def all_figures(
    ledger: Ledger,
    *,
    model: ModelSpec | None = None,
    train: TrainSpec | None = None,
    gpu: GPUSpec | None = None,
    headroom: float = DEFAULT_HEADROOM,
    remedies: Iterable[RemedyResult | tuple[str, int, float]] | None = None,
) -> Figures:
    """Every figure that applies: the cliff needs the specs, the timeline a trace, remedies a plan."""
    cliff = None
    if model is not None and train is not None:
        cliff = cliff_figure(model, train, gpu=gpu, headroom=headroom)
    return Figures(
        bill=bill_figure(ledger),
        cliff=cliff,
        timeline=timeline_figure(ledger),
        remedies=remedies_figure(remedies, ledger),
    )
