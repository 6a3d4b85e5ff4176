"""The allocator model's bookkeeping: blocks of a segment and the free-block pools (one stream).

Ports ``struct Block`` and ``struct BlockPool`` of ``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.13); see
:mod:`vramledger.allocator.model` for the rules that use them.
"""

from __future__ import annotations

from bisect import bisect_left, insort

ADDR_BITS = 64
"""Addresses stay below ``2**ADDR_BITS`` (synthetic, from ``1 << 40`` up: ``CachingAllocatorModel._new_addr``)."""
ADDR_MASK = (1 << ADDR_BITS) - 1


class Block:
    """``struct Block``: a contiguous range of a segment, free or handed out."""

    __slots__ = (
        "size",
        "addr",
        "allocated",
        "prev",
        "next",
        "small",
        "mapped",
        "seg",
        "gc_base",
        "requested",
    )

    def __init__(self, size: int, addr: int, *, small: bool, seg: int, mapped: bool = True) -> None:
        self.size = size
        self.addr = addr
        self.allocated = False
        self.prev: Block | None = None
        self.next: Block | None = None
        self.small = small
        self.mapped = mapped
        self.seg = seg  # segment id; negative ids are expandable segments
        self.gc_base = 0
        self.requested = 0

    @property
    def expandable(self) -> bool:
        return self.seg < 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


def splice(block: Block, before: Block | None, after: Block | None) -> None:
    """``Block::splice``: insert ``block`` between two neighbours."""
    if before is not None:
        before.next = block
    block.prev = before
    if after is not None:
        after.prev = block
    block.next = after


class BlockPool:
    """``struct BlockPool``: free mapped blocks ordered by (size, address), unmapped ones by address.

    The order is kept as one integer per block, ``size << ADDR_BITS | addr``: ints sort as the (size, address)
    pairs do and compare several times faster than tuples in ``bisect`` (the replay's hottest call).
    """

    __slots__ = ("small", "order", "blocks", "unmapped_addrs", "unmapped", "gc_calls")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.order: list[int] = []  # sorted size << ADDR_BITS | addr: BlockComparatorSize for one stream
        self.blocks: dict[int, Block] = {}
        self.unmapped_addrs: list[int] = []  # sorted: BlockComparatorAddress
        self.unmapped: dict[int, Block] = {}
        self.gc_calls = 0  # get_free_blocks_call_count

    @property
    def keys(self) -> list[tuple[int, int]]:
        """The free mapped blocks as sorted (size, address) pairs."""
        return [(k >> ADDR_BITS, k & ADDR_MASK) for k in self.order]

    def insert(self, b: Block) -> None:
        """``insert_into_blocks``: also stamps the block's age base for garbage collection."""
        b.gc_base = self.gc_calls
        insort(self.order, b.size << ADDR_BITS | b.addr)
        self.blocks[b.addr] = b

    def remove(self, b: Block) -> None:
        order = self.order
        del order[bisect_left(order, b.size << ADDR_BITS | b.addr)]
        del self.blocks[b.addr]

    def add_unmapped(self, b: Block) -> None:
        insort(self.unmapped_addrs, b.addr)
        self.unmapped[b.addr] = b

    def remove_unmapped(self, b: Block) -> None:
        del self.unmapped_addrs[bisect_left(self.unmapped_addrs, b.addr)]
        del self.unmapped[b.addr]
