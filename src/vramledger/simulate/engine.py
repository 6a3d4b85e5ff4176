"""Replay a whole run, step after step, through one caching-allocator model whose state carries over.

A run is a list of ``Unit``s: the model's load, each optimizer step (its micro-steps' forward and backward at
their padded lengths, then the optimizer step), each evaluation (its batches), with ``empty_cache`` calls where
the schedule has them. One :class:`~vramledger.allocator.model.CachingAllocatorModel` sees them all, so the
blocks a long batch or an evaluation leaves cached are there for every later step: reserved memory creeps up
when a later request finds no cached block to fit it, and a step fails when that request also finds no room.

Cost stays bounded whatever the number of steps. Between optimizer steps only the persistent tensors
(weights, optimizer state, cuBLAS workspaces) are allocated, always at the same addresses, and every cached
block of a segment has merged back into one free block per gap (``free_block`` → ``try_merge_blocks``). A
step that creates no segment and releases none therefore leaves the allocator exactly as it found it, and
what it does depends only on that state and its lengths. Such steps are memoised on (where the persistent
tensors sit, the allocator's free layout, the step's lengths): the next step of the same lengths from the
same state is not replayed. A step that changes the state (a new segment: creep; a release) is always
replayed, and there are few: reserved memory only grows until something frees the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vramledger.allocator.conf import DEFAULT_CONF, AllocatorConf
from vramledger.allocator.model import CachingAllocatorModel
from vramledger.simulate.templates import Segment, SizeRule, StepTemplates


@dataclass(frozen=True, kw_only=True, slots=True)
class Unit:
    """One piece of the schedule: ``load``, a ``train`` optimizer step (its micro-batches' padded lengths) or an
    ``eval`` (its batches' padded lengths)."""

    kind: str
    step: int
    """The optimizer step it belongs to (an evaluation: the step after which it runs; the load: 0)."""
    lengths: tuple[int, ...] = ()
    empty_cache_before: bool = False
    empty_cache_after: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class OomAt:
    """The allocation a run fails on: where, and the allocator's state after it freed its cache and retried."""

    step: int
    kind: str
    length: int
    """The padded length of the batch being run."""
    op: str
    module: str
    phase: str
    requested_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    capacity_bytes: int
    largest_free_block_bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitStats:
    """What the allocator did during one unit."""

    unit: Unit
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    reserved_end_bytes: int
    segments_end: int
    retries: int
    """Allocations that needed the whole cache freed and a retry (``num_alloc_retries``)."""
    replayed: bool
    """False when memoised (the same lengths from the same allocator state)."""
    oom: OomAt | None = None


class Replayer:
    """Runs lists of units through fresh allocator models, sharing one memo across runs (Monte Carlo)."""

    def __init__(
        self,
        templates: StepTemplates,
        *,
        conf: AllocatorConf = DEFAULT_CONF,
        capacity_bytes: int | None = None,
        device_total_bytes: int | None = None,
    ) -> None:
        self.t = templates
        self.conf = conf
        self.capacity = capacity_bytes
        self.device_total = device_total_bytes
        self._sizes: dict[tuple[str, int], tuple[int, ...]] = {}
        self._size_plans: dict[str, tuple[list[SizeRule | None], list[int]]] = {}
        self._memo: dict[tuple[Any, ...], UnitStats] = {}
        # The parts of a memo key that are long tuples, each as a small id: keys then hash fast.
        self._roots: dict[tuple[tuple[int, int], ...], int] = {}
        self._layouts: dict[tuple[object, ...], int] = {}
        # Garbage collection reads the blocks' ages, which the free layout does not hold: no memo then.
        self._memo_on = conf.garbage_collection_threshold == 0.0
        self.replays = 0
        self.memo_hits = 0

    def _sizes_at(self, seg: Segment, length: int) -> tuple[int, ...]:
        """``seg.sizes(length)``, each distinct rule of the segment evaluated once (the layers repeat them)."""
        key = (seg.name, length)
        sizes = self._sizes.get(key)
        if sizes is None:
            plan = self._size_plans.get(seg.name)
            if plan is None:
                distinct: dict[SizeRule | None, int] = {}
                index = [distinct.setdefault(r, len(distinct)) for r in seg.rules]
                plan = self._size_plans[seg.name] = (list(distinct), index)
            values = [r.at(length) if r is not None else 0 for r in plan[0]]
            sizes = self._sizes[key] = tuple(map(values.__getitem__, plan[1]))
        return sizes

    def _layout_id(self, model: CachingAllocatorModel) -> int:
        return self._layouts.setdefault(model.free_layout(), len(self._layouts))

    def _parts(self, unit: Unit) -> list[tuple[Segment, int]]:
        t, ref = self.t, self.t.reference_len
        if unit.kind == "load":
            return [(t.load, ref)]
        if unit.kind == "eval":
            if t.eval is None:
                raise AssertionError("an eval unit needs templates traced with an eval batch")
            return [(t.eval, n) for n in unit.lengths]
        first = unit.step == 1
        parts = [(t.first_fb if first else t.fb, unit.lengths[0])]
        parts += [(t.fb_acc, n) for n in unit.lengths[1:]]
        parts.append((t.first_opt if first else t.opt, ref))
        return parts

    def run(self, units: list[Unit]) -> list[UnitStats]:
        """Replay ``units`` in order on a fresh allocator; stops after the unit that runs out of memory."""
        model = CachingAllocatorModel(self.conf, capacity_bytes=self.capacity, device_total_bytes=self.device_total)
        live: dict[int, Any] = {}
        out: list[UnitStats] = []
        root = self._roots.setdefault((), len(self._roots))  # where the persistent tensors sit (its id): none yet
        layout: int | None = None  # the model's free layout (its id); unchanged by a memoised unit
        for unit in units:
            key = None
            if self._memo_on and unit.kind != "load" and unit.step > 1:
                if layout is None:
                    layout = self._layout_id(model)
                key = (root, unit.kind, unit.lengths, unit.empty_cache_before, unit.empty_cache_after, layout)
                hit = self._memo.get(key)
                if hit is not None:
                    self.memo_hits += 1
                    out.append(
                        UnitStats(
                            unit=unit,
                            peak_allocated_bytes=hit.peak_allocated_bytes,
                            peak_reserved_bytes=hit.peak_reserved_bytes,
                            reserved_end_bytes=hit.reserved_end_bytes,
                            segments_end=hit.segments_end,
                            retries=hit.retries,
                            replayed=False,
                        )
                    )
                    continue
            stats = self._replay(model, live, unit)
            layout = None
            out.append(stats)
            if stats.oom is not None:
                break
            if unit.kind == "train" and unit.step == 1:
                # Where the persistent tensors (weights, workspaces, optimizer state) sit: fixed from here on.
                placed = tuple(sorted((b.addr, b.size) for b in live.values() if b is not None))
                root = self._roots.setdefault(placed, len(self._roots))
            if key is not None:
                layout = self._layout_id(model)
                if layout == key[-1]:
                    self._memo[key] = stats
        return out

    def _replay(self, model: CachingAllocatorModel, live: dict[int, Any], unit: Unit) -> UnitStats:
        self.replays += 1
        retries0 = model.num_alloc_retries
        if unit.empty_cache_before:
            model.empty_cache()
        model.peak_allocated, model.peak_reserved = model.allocated, model.reserved
        oom = None
        for seg, length in self._parts(unit):
            failed = self._replay_segment(model, live, seg, self._sizes_at(seg, length))
            if failed is not None:
                ev, st = seg.events[failed], model.last_oom
                assert st is not None
                oom = OomAt(
                    step=unit.step,
                    kind=unit.kind,
                    length=length,
                    op=ev.op,
                    module=ev.module,
                    phase=ev.phase.value if ev.phase is not None else "",
                    requested_bytes=st.rounded_bytes,
                    allocated_bytes=st.allocated_bytes,
                    reserved_bytes=st.reserved_bytes,
                    capacity_bytes=self.capacity or 0,
                    largest_free_block_bytes=st.largest_free_block_bytes,
                )
                break
        peak_alloc, peak_res = model.peak_allocated, model.peak_reserved
        if unit.empty_cache_after and oom is None:
            model.empty_cache()
        return UnitStats(
            unit=unit,
            peak_allocated_bytes=peak_alloc,
            peak_reserved_bytes=peak_res,
            reserved_end_bytes=model.reserved,
            segments_end=model.num_segments(),
            retries=model.num_alloc_retries - retries0,
            replayed=True,
            oom=oom,
        )

    @staticmethod
    def _replay_segment(
        model: CachingAllocatorModel, live: dict[int, Any], seg: Segment, sizes: tuple[int, ...]
    ) -> int | None:
        """The events of ``seg`` at ``sizes``; the index of the allocation that fails, if one does."""
        malloc, free = model.malloc, model.free
        for i, (is_alloc, sid, size) in enumerate(zip(seg.kinds, seg.ids, sizes)):  # noqa: B905 - hot loop
            if is_alloc:
                if size == 0:
                    live[sid] = None
                    continue
                block = malloc(size)
                if block is None:
                    return i
                live[sid] = block
            else:
                block = live.pop(sid)
                if block is not None:
                    free(block)
        return None
