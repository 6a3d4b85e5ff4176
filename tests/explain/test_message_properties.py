"""Properties: any message PyTorch could print parses back to its figures within format_size's rounding, and the
diagnosis follows the allocator's rule for every combination of figures."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vramledger.explain.oom_message import parse_message
from vramledger.explain.postmortem import Diagnosis, Evidence, diagnose

GiB = 2**30


def format_size(size: int) -> str:
    """A port of c10/cuda/CUDACachingAllocator.cpp ``format_size`` (two decimals, binary units)."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1048576:
        return f"{size / 1024:.2f} KiB"
    if size <= 1073741824:
        return f"{size / 1048576:.2f} MiB"
    return f"{size / 1073741824:.2f} GiB"


def half_unit(size: int) -> float:
    """The rounding of ``format_size``: half of the last printed digit."""
    return 0.0 if size <= 1024 else 0.005 * (1024 if size <= 2**20 else 2**20 if size <= 2**30 else 2**30)


def message(req: int, total: int, free: int, proc: int, alloc: int, unalloc: int) -> str:
    """The torch >= 2.2 message, assembled as DeviceCachingAllocator::malloc does (stored commit 001074d)."""
    return (
        f"CUDA out of memory. Tried to allocate {format_size(req)}. GPU 0 has a total capacity of "
        f"{format_size(total)} of which {format_size(free)} is free. Including non-PyTorch memory, this process "
        f"has {format_size(proc)} memory in use. Of the allocated memory {format_size(alloc)} is allocated by "
        f"PyTorch, and {format_size(unalloc)} is reserved by PyTorch but unallocated. If reserved but unallocated "
        "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
    )


sizes = st.integers(min_value=0, max_value=200 * GiB)


@settings(max_examples=200, deadline=None)
@given(req=st.integers(1, 200 * GiB), total=sizes, free=sizes, proc=sizes, alloc=sizes, unalloc=sizes)
def test_every_figure_parses_back_within_its_rounding(
    req: int, total: int, free: int, proc: int, alloc: int, unalloc: int
) -> None:
    msg = parse_message(message(req, total, free, proc, alloc, unalloc))
    assert msg is not None
    for got, true in (
        (msg.requested_bytes, req),
        (msg.capacity_bytes, total),
        (msg.free_bytes, free),
        (msg.process_bytes, proc),
        (msg.allocated_bytes, alloc),
    ):
        assert got is not None and abs(got - true) <= half_unit(true) + 1
    assert msg.reserved_bytes is not None and msg.allocated_bytes is not None
    assert abs((msg.reserved_bytes - msg.allocated_bytes) - unalloc) <= half_unit(unalloc) + 1


@settings(max_examples=300, deadline=None)
@given(req=st.integers(1, 80 * GiB), alloc=st.integers(0, 80 * GiB), unalloc=st.integers(0, 80 * GiB))
def test_fragmentation_exactly_when_the_cache_held_the_request(req: int, alloc: int, unalloc: int) -> None:
    """On an 80 GiB GPU with nothing free, the cause is fragmentation iff reserved-but-unallocated >= request
    (the request fits the GPU by construction)."""
    text = message(req, 80 * GiB, 0, alloc + unalloc, alloc, unalloc)
    msg = parse_message(text)
    assert msg is not None
    pm = diagnose(Evidence(source="property", message=msg))
    unalloc_read = msg.reserved_bytes - msg.allocated_bytes  # type: ignore[operator]
    assert (pm.diagnosis is Diagnosis.FRAGMENTATION) == (unalloc_read >= msg.requested_bytes)
