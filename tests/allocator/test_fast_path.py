"""The inlined common path of ``malloc``/``free`` against the port's general path, decision for decision.

Without expandable segments and garbage collection, ``CachingAllocatorModel.malloc`` and ``free`` inline
``get_free_block``, ``should_split``, ``alloc_found_block``, ``free_block`` and ``try_merge_blocks`` (the replay's
hot path); the general methods, ported line for line from CUDACachingAllocator.cpp, still serve every other
setting and can be forced with ``_plain = False``. The same stream through both must hand out the same blocks
and leave the same allocator behind: cached blocks, counters, peaks and the OOM state.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramledger.allocator.blocks import Block
from vramledger.allocator.conf import parse_alloc_conf
from vramledger.allocator.model import CachingAllocatorModel

MiB = 2**20

# The rules' edges: 512 B blocks, the 1 MiB small/large cut, 10 MiB for a 20 MiB segment, a remainder of exactly
# 1 MiB (19 from 20) or 512 B, max_split_size 32/40 MiB and its rounding limit (+20/+64 MiB).
EDGES = [1, 512, 513, 1024, MiB - 512, MiB, MiB + 1, 2 * MiB, 3 * MiB, 10 * MiB, 10 * MiB + 1, 18 * MiB] + [
    19 * MiB,
    20 * MiB,
    21 * MiB,
    31 * MiB,
    32 * MiB,
    40 * MiB,
    52 * MiB,
    60 * MiB,
    96 * MiB,
    104 * MiB,
]
_sizes = st.one_of(
    st.integers(0, 4096),
    st.integers(1, 2 * MiB),
    st.integers(MiB, 12 * MiB),
    st.integers(10 * MiB, 96 * MiB),
    st.sampled_from(EDGES),
)
# (op, size, pick): op 0 malloc, 1 free the pick-th live block, 2 empty_cache.
_ops = st.lists(st.tuples(st.sampled_from([0, 0, 0, 1, 1, 2]), _sizes, st.integers(0, 1000)), max_size=80)
CONFS = [
    "",
    "max_split_size_mb:32",
    "max_split_size_mb:40,max_non_split_rounding_mb:64",
    "roundup_power2_divisions:4",
    "per_process_memory_fraction:0.6",
]


def _state(m: CachingAllocatorModel) -> tuple[object, ...]:
    return (
        m.allocated,
        m.reserved,
        m.peak_allocated,
        m.peak_reserved,
        m.segments,
        m.num_segments(),
        m.num_alloc_retries,
        m.num_device_alloc,
        m.num_device_free,
        m.last_oom,
        m.largest_free_block(),
        m.free_layout(),
    )


def _where(b: Block | None) -> tuple[int, int, int, int] | None:
    return None if b is None else (b.addr, b.size, b.requested, b.seg)


def _pair(conf: str, capacity: int | None) -> tuple[CachingAllocatorModel, CachingAllocatorModel]:
    c = parse_alloc_conf(conf)
    fast = CachingAllocatorModel(c, capacity_bytes=capacity, device_total_bytes=capacity or 256 * MiB)
    port = CachingAllocatorModel(c, capacity_bytes=capacity, device_total_bytes=capacity or 256 * MiB)
    assert fast._plain
    port._plain = False
    return fast, port


@pytest.mark.parametrize("conf", CONFS)
def test_every_pair_of_edge_sizes(conf: str) -> None:
    # Each edge size a, then b: while a is held (a split), and after a is freed (a cached block reused or not).
    for a, b in itertools.product(EDGES, repeat=2):
        for free_first in (False, True):
            fast, port = _pair(conf, None)
            blocks = [m.malloc(a) for m in (fast, port)]
            if free_first:
                for m, blk in zip((fast, port), blocks, strict=True):
                    m.free(blk)  # type: ignore[arg-type]
            x, y = fast.malloc(b), port.malloc(b)
            assert _where(x) == _where(y), (a, b, free_first)
            assert _state(fast) == _state(port), (a, b, free_first)


@settings(max_examples=200, deadline=None)
@given(ops=_ops, conf=st.sampled_from(CONFS), capacity=st.sampled_from([None, 64 * MiB, 160 * MiB]))
def test_inlined_path_makes_the_ports_decisions(
    ops: list[tuple[int, int, int]], conf: str, capacity: int | None
) -> None:
    fast, port = _pair(conf, capacity)
    live: list[tuple[object, object]] = []
    for op, size, pick in ops:
        if op == 1 and live:
            a, b = live.pop(pick % len(live))
            fast.free(a)  # type: ignore[arg-type]
            port.free(b)  # type: ignore[arg-type]
        elif op == 2:
            fast.empty_cache()
            port.empty_cache()
        else:
            a, b = fast.malloc(size), port.malloc(size)
            assert _where(a) == _where(b)
            if a is not None and b is not None:
                live.append((a, b))
        assert _state(fast) == _state(port)
