"""Allocation sequences and their replay through the caching-allocator model (``allocator/model.py``, a port of
``CUDACachingAllocator.cpp``): what the closed forms of this package are checked against, and what the chains
that are too irregular for a closed form (TRL's chunks) are computed with."""

from __future__ import annotations

from functools import lru_cache

from vramledger.allocator.blocks import Block

Seq = tuple[tuple[int, int], ...]
"""(id, size): size > 0 allocates ``id``, size 0 frees it."""


@lru_cache(maxsize=4096)
def replay_excess(seq: Seq) -> tuple[int, int]:
    """(peak reserved, peak allocated) of ``seq`` replayed through the caching-allocator model (default settings,
    unlimited device). Cached: the planner asks for the same shapes again and again."""
    from vramledger.allocator.model import CachingAllocatorModel

    model = CachingAllocatorModel()
    live: dict[int, Block] = {}
    for i, size in seq:
        if size > 0:
            blk = model.malloc(size)
            assert blk is not None, "an unlimited device never runs out"
            live[i] = blk
        else:
            freed = live.pop(i, None)
            if freed is not None:
                model.free(freed)
    return model.peak_reserved, model.peak_allocated


class Events:
    """The sequence ``step_sequence`` builds: ``alloc`` numbers a block (a size of 0 is numbered, not recorded)."""

    def __init__(self) -> None:
        self.events: list[tuple[int, int]] = []
        self._ids = iter(range(1, 1 << 30))

    def alloc(self, size: int) -> int:
        i = next(self._ids)
        if size > 0:
            self.events.append((i, int(size)))
        return i

    def free(self, i: int) -> None:
        self.events.append((i, 0))

    def transients(self, sizes: list[int], times: int) -> None:
        """``times`` rounds of the blocks ``sizes``, all allocated, then all freed."""
        for _ in range(times):
            for t in [self.alloc(x) for x in sizes]:
                self.free(t)
