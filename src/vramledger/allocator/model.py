"""A faithful model of PyTorch's CUDA caching allocator (torch 2.13, ``c10/cuda/CUDACachingAllocator.cpp``).

Each method below names the ``DeviceCachingAllocator`` function it ports; the rules are theirs, line for line
where it matters for how much memory is reserved:

- ``malloc``: ``round_size`` → pool (small ≤ 1 MiB, else large) → ``get_free_block`` (best fit by
  (size, address)) → on a miss: ``garbage_collect_cached_blocks`` (only with a memory fraction below 1),
  ``alloc_block`` (a new segment of ``get_allocation_size``), then ``release_available_cached_blocks`` +
  retry, then ``release_cached_blocks`` + retry (counted in ``num_alloc_retries``), else out of memory.
- ``should_split``: small pool or expandable segments: remainder ≥ 512 B; large pool: request below
  ``max_split_size`` and remainder > 1 MiB. ``get_free_block`` refuses oversize blocks (≥ ``max_split_size``)
  for smaller requests and oversize blocks more than ``max_non_split_rounding`` too big.
- ``free_block`` merges a freed block with free neighbours of the same segment (``try_merge_blocks``).
- ``expandable_segments``: one virtual segment per pool, mapped in pages of 2 MiB (small) or the large
  segment size (20 MiB), grown at the lowest address that fits (``find_expandable_block``, ``map_block``)
  and unmapped page by page when cached blocks are released (``unmap_block``).

Simplifications, each harmless for reserved-memory accounting of a training step: one device and one
stream (no cross-stream ``recordStream`` events, so no deferred frees); no CUDA graph private pools or
``MemPool``s; no ``FreeCudaMemoryCallbacks`` (the registered IPC callback frees nothing in a single
process); cudaMalloc segment addresses are synthetic and increasing, so ties between equal-size free blocks
go to the older segment (real addresses are whatever the driver returns).

Speed (a simulated run replays millions of events): without expandable segments and garbage collection,
``malloc`` and ``free`` inline ``get_free_block``, ``should_split``, ``alloc_found_block``, ``free_block`` and
``try_merge_blocks`` (no expandable block can be in the pools, no block age to stamp); every other setting goes
through the methods below. ``tests/allocator/test_fast_path.py`` holds the two paths to the same decisions.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

from vramledger.allocator.blocks import ADDR_BITS, ADDR_MASK, Block, BlockPool, splice
from vramledger.allocator.conf import (
    DEFAULT_CONF,
    K_MIN_BLOCK_SIZE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    AllocatorConf,
    allocation_size,
    round_size,
)

_NO_CAPACITY = 1 << 62
# ExpandableSegment reserves virtual address space for 1 1/8 of the device memory (``max_handles_``).
_VA_UNBOUNDED = 1 << 50


@dataclass(frozen=True, kw_only=True, slots=True)
class OomState:
    """The allocator's state when an allocation failed even after releasing every cached block."""

    rounded_bytes: int
    """The request after ``round_size``."""
    alloc_bytes: int
    """What ``alloc_block`` tried to obtain (``get_allocation_size``; with expandable segments the
    request)."""
    allocated_bytes: int
    reserved_bytes: int
    largest_free_block_bytes: int


class CachingAllocatorModel:
    """One device's ``DeviceCachingAllocator`` with ``capacity_bytes`` obtainable from the driver.

    >>> a = CachingAllocatorModel()
    >>> b = a.malloc(3 * 2**20)
    >>> (a.allocated, a.reserved)  # a 3 MiB request is cut from a new 20 MiB segment
    (3145728, 20971520)
    """

    def __init__(
        self,
        conf: AllocatorConf = DEFAULT_CONF,
        *,
        capacity_bytes: int | None = None,
        device_total_bytes: int | None = None,
    ) -> None:
        self.conf = conf
        self.capacity = capacity_bytes if capacity_bytes is not None else _NO_CAPACITY
        total = device_total_bytes if device_total_bytes is not None else capacity_bytes
        # setMemoryFraction: allowed_memory_maximum is set iff the fraction is below 1.
        self.allowed: int | None = None
        if conf.per_process_memory_fraction < 1.0 and total is not None:
            self.allowed = int(conf.per_process_memory_fraction * total)
        self._va_size = (total + total // 8) if total is not None else _VA_UNBOUNDED
        self._gc_on = self.allowed is not None and conf.garbage_collection_threshold > 0.0
        # The settings read on every call, read once (conf is frozen).
        self._plain_rounding = all(d <= 1 for d in conf.roundup_power2_divisions)
        self._max_split = conf.max_split_size
        self._max_non_split_rounding = conf.max_non_split_rounding
        # Without expandable segments and garbage collection, malloc and free take the inlined common path.
        self._plain = not conf.expandable_segments and not self._gc_on
        self._small = BlockPool(small=True)
        self._large = BlockPool(small=False)
        self._next_addr = 1 << 40
        self._next_seg = 1
        self._es_base: dict[int, int] = {}  # expandable segment id -> base address
        self._es_page: dict[int, int] = {}
        self._es_mapped: dict[int, int] = {}
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.segments = 0  # cudaMalloc segments (stats.segment)
        self.num_alloc_retries = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        self.last_oom: OomState | None = None

    # ---- public --------------------------------------------------------------------------------------------
    def malloc(self, orig_size: int) -> Block | None:
        """``DeviceCachingAllocator::malloc``; ``None`` where torch raises ``OutOfMemoryError``."""
        conf = self.conf
        if orig_size < K_MIN_BLOCK_SIZE:
            size = K_MIN_BLOCK_SIZE
        elif self._plain_rounding:  # round_size without power-of-two divisions: a multiple of 512 B
            size = -(-orig_size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE
        else:
            size = round_size(orig_size, conf)
        pool = self._small if size <= K_SMALL_SIZE else self._large
        block: Block | None
        if self._plain:
            # get_free_block + should_split + alloc_found_block inlined: no expandable block in the pools, no
            # block ages to stamp.
            order = pool.order
            i = bisect_left(order, size << ADDR_BITS)
            if i < len(order):
                key = order[i]
                found = key >> ADDR_BITS
                mss = self._max_split
                if (found < mss or size >= mss) and (size < mss or found < size + self._max_non_split_rounding):
                    del order[i]
                    blocks = pool.blocks
                    block = blocks.pop(key & ADDR_MASK)
                    remaining = found - size
                    if remaining >= K_MIN_BLOCK_SIZE if pool.small else size < mss and remaining > K_SMALL_SIZE:
                        rest = block
                        block = Block(size, rest.addr, small=rest.small, seg=rest.seg)
                        prev = rest.prev
                        block.prev = prev
                        if prev is not None:
                            prev.next = block
                        block.next = rest
                        rest.prev = block
                        rest.addr += size
                        rest.size = remaining
                        insort(order, remaining << ADDR_BITS | rest.addr)
                        blocks[rest.addr] = rest
                    block.allocated = True
                    block.requested = orig_size
                    allocated = self.allocated + block.size
                    self.allocated = allocated
                    if allocated > self.peak_allocated:
                        self.peak_allocated = allocated
                    return block
            block = None
        else:
            block = self._get_free_block(pool, size)
        if block is None:
            alloc = allocation_size(size, conf)
            if self._gc_on:
                self._garbage_collect_cached_blocks()
            block = self._alloc_block(pool, size, alloc, is_retry=False)
            if block is None and self._release_available_cached_blocks(pool, size):
                block = self._alloc_block(pool, size, alloc, is_retry=False)
            if block is None:
                self._release_cached_blocks()
                block = self._alloc_block(pool, size, alloc, is_retry=True)
            if block is None:
                self.last_oom = OomState(
                    rounded_bytes=size,
                    alloc_bytes=size if conf.expandable_segments else alloc,
                    allocated_bytes=self.allocated,
                    reserved_bytes=self.reserved,
                    largest_free_block_bytes=self.largest_free_block(),
                )
                return None
        return self._alloc_found_block(pool, block, size, orig_size)

    def free(self, block: Block) -> None:
        """``DeviceCachingAllocator::free`` (single stream: no events, straight to ``free_block``)."""
        assert block.allocated, "double free"
        block.allocated = False
        self.allocated -= block.size
        if not self._plain:
            self._free_block(block)
            return
        # free_block + try_merge_blocks inlined: every block is mapped, no ages to stamp.
        pool = self._small if block.small else self._large
        order, blocks = pool.order, pool.blocks
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.allocated:
            del order[bisect_left(order, prev.size << ADDR_BITS | prev.addr)]
            del blocks[prev.addr]
            block.addr = prev.addr
            block.size += prev.size
            prev = block.prev = prev.prev
            if prev is not None:
                prev.next = block
        if nxt is not None and not nxt.allocated:
            del order[bisect_left(order, nxt.size << ADDR_BITS | nxt.addr)]
            del blocks[nxt.addr]
            block.size += nxt.size
            nxt = block.next = nxt.next
            if nxt is not None:
                nxt.prev = block
        insort(order, block.size << ADDR_BITS | block.addr)
        blocks[block.addr] = block

    def empty_cache(self) -> None:
        """``emptyCache`` → ``release_cached_blocks``."""
        self._release_cached_blocks()

    def largest_free_block(self) -> int:
        """``cacheInfo``: the largest cached (free, mapped) block."""
        return max((p.order[-1] >> ADDR_BITS for p in (self._small, self._large) if p.order), default=0)

    def free_layout(self) -> tuple[object, ...]:
        """Every cached block (size, address) of both pools, the unmapped ranges of expandable segments and the
        reserved total. With the same allocated blocks, two models with equal layouts make the same decisions
        from here on (garbage collection aside, which also reads the blocks' ages): a memo key."""
        return (
            self.reserved,
            tuple(self._small.keys),
            tuple(self._large.keys),
            tuple((a, p.unmapped[a].size) for p in (self._small, self._large) for a in p.unmapped_addrs),
        )

    def num_segments(self) -> int:
        """cudaMalloc segments plus expandable segments with mapped pages."""
        return self.segments + sum(1 for v in self._es_mapped.values() if v > 0)

    # ---- device memory -------------------------------------------------------------------------------------
    def _grow(self, nbytes: int) -> bool:
        """cudaMalloc / cuMemCreate: fails when the device cannot supply ``nbytes`` more."""
        if self.reserved + nbytes > self.capacity:
            return False
        self.reserved += nbytes
        self.num_device_alloc += 1
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        return True

    def _new_addr(self, size: int) -> int:
        addr = self._next_addr
        self._next_addr += size + K_SMALL_BUFFER  # a gap keeps segments apart
        assert self._next_addr < 1 << ADDR_BITS, "address space of the model exhausted"
        return addr

    # ---- malloc path ---------------------------------------------------------------------------------------
    def _get_free_block(self, pool: BlockPool, size: int) -> Block | None:
        """``get_free_block``: smallest cached block ≥ size, with the oversize rules."""
        if self._gc_on:
            pool.gc_calls += 1
        order, blocks = pool.order, pool.blocks
        i = bisect_left(order, size << ADDR_BITS)
        if i == len(order):
            return None
        b = blocks[order[i] & ADDR_MASK]
        if b.seg < 0:  # expandable
            if self.conf.expandable_segments:
                # Best fit counts the unmapped space after a block as room it can grow into.
                def expandable_size(x: Block) -> int:
                    nxt = x.next
                    return x.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

                j = i + 1
                while b.expandable and j < len(order):
                    nb = blocks[order[j] & ADDR_MASK]
                    if expandable_size(nb) >= expandable_size(b):
                        break
                    i, b, j = j, nb, j + 1
            else:
                i += 1
                while i < len(order) and blocks[order[i] & ADDR_MASK].expandable:
                    i += 1
                if i == len(order):
                    return None
                b = blocks[order[i] & ADDR_MASK]
        mss = self._max_split
        if size < mss and b.size >= mss:  # "Do not return an oversized block for a large request"
            return None
        if size >= mss and b.size >= size + self._max_non_split_rounding:  # "rounded up but within a limit"
            return None
        del order[i]
        del blocks[b.addr]
        return b

    def _should_split(self, block: Block, size: int) -> bool:
        """``should_split``."""
        remaining = block.size - size
        if block.small or self.conf.expandable_segments:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self._max_split and remaining > K_SMALL_SIZE

    def _alloc_found_block(self, pool: BlockPool, block: Block, size: int, orig: int) -> Block:
        """``alloc_found_block``: cut ``size`` from the front of the block if ``should_split``, return the rest
        to the pool."""
        if self._should_split(block, size):
            remaining = block
            block = Block(size, remaining.addr, small=pool.small, seg=remaining.seg)
            splice(block, remaining.prev, remaining)
            remaining.addr += size
            remaining.size -= size
            pool.insert(remaining)
        block.allocated = True
        block.requested = orig
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block

    def _alloc_block(self, pool: BlockPool, size: int, alloc: int, *, is_retry: bool) -> Block | None:
        """``alloc_block``: a new cudaMalloc segment, or growth of the expandable segment."""
        if is_retry:
            self.num_alloc_retries += 1
        if self.allowed is not None and self.reserved + alloc > self.allowed:
            return None
        if self.conf.expandable_segments:
            return self._try_allocate_expandable_block(pool, size)
        if not self._grow(alloc):
            return None
        self.segments += 1
        seg = self._next_seg
        self._next_seg += 1
        return Block(alloc, self._new_addr(alloc), small=pool.small, seg=seg)

    # ---- expandable segments -------------------------------------------------------------------------------
    def _find_expandable_block(self, pool: BlockPool, size: int) -> Block:
        """``find_expandable_block``: lowest address with enough free-or-unmapped room, else a new segment."""

        def room(b: Block | None) -> bool:
            nbytes = 0
            while nbytes < size and b is not None and not b.allocated:
                nbytes += b.size
                b = b.next
            return nbytes >= size

        for addr in pool.unmapped_addrs:
            c = pool.unmapped[addr]
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            if room(c):
                return c
        page = K_SMALL_BUFFER if pool.small else self.conf.large_segment_size_bytes
        va = -(-self._va_size // page) * page
        seg = -self._next_seg
        self._next_seg += 1
        base = self._new_addr(va)
        self._es_base[seg], self._es_page[seg], self._es_mapped[seg] = base, page, 0
        candidate = Block(va, base, small=pool.small, seg=seg, mapped=False)
        pool.add_unmapped(candidate)
        return candidate

    def _map_block(self, pool: BlockPool, to_map: Block, size: int) -> bool:
        """``map_block`` / ``ExpandableSegment::map``: map whole pages covering ``size``, all or nothing."""
        base, page = self._es_base[to_map.seg], self._es_page[to_map.seg]
        begin = (to_map.addr - base) // page
        end = -(-(to_map.addr + size - base) // page)
        mapped = (end - begin) * page
        if mapped == 0 or not self._grow(mapped):
            return False
        self._es_mapped[to_map.seg] += mapped
        pool.remove_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            rest = Block(to_map.size - mapped, to_map.addr + mapped, small=pool.small, seg=to_map.seg, mapped=False)
            splice(rest, to_map, to_map.next)
            pool.add_unmapped(rest)
            to_map.size = mapped
        self._try_merge(pool, to_map, to_map.prev)
        self._try_merge(pool, to_map, to_map.next)
        pool.insert(to_map)
        return True

    def _try_allocate_expandable_block(self, pool: BlockPool, size: int) -> Block | None:
        """``try_allocate_expandable_block``."""
        c = self._find_expandable_block(pool, size)
        if not c.mapped and not self._map_block(pool, c, min(c.size, size)):
            return None
        while c.size < size:
            nxt = c.next
            assert nxt is not None and not nxt.mapped
            if not self._map_block(pool, nxt, min(size - c.size, nxt.size)):
                return None
            c = nxt
        pool.remove(c)
        return c

    def _unmap_block(self, pool: BlockPool, block: Block) -> None:
        """``unmap_block``: return the whole pages inside a free block to the driver."""
        base, page = self._es_base[block.seg], self._es_page[block.seg]
        begin = -(-(block.addr - base) // page)
        end = (block.addr + block.size - base) // page
        if begin >= end:
            return
        pool.remove(block)
        start, nbytes = base + begin * page, (end - begin) * page
        before = start - block.addr
        if before > 0:
            bf = Block(before, block.addr, small=pool.small, seg=block.seg)
            splice(bf, block.prev, block)
            pool.insert(bf)
        after = block.size - (before + nbytes)
        if after > 0:
            af = Block(after, start + nbytes, small=pool.small, seg=block.seg)
            splice(af, block, block.next)
            pool.insert(af)
        block.addr, block.size, block.mapped = start, nbytes, False
        self._try_merge(pool, block, block.prev)
        self._try_merge(pool, block, block.next)
        pool.add_unmapped(block)
        self.reserved -= nbytes
        self._es_mapped[block.seg] -= nbytes
        self.num_device_free += 1

    # ---- free path -----------------------------------------------------------------------------------------
    def _free_block(self, block: Block) -> None:
        """``free_block``: merge with free neighbours, then cache."""
        pool = self._small if block.small else self._large
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.allocated:
            self._try_merge(pool, block, prev)
        if nxt is not None and not nxt.allocated:
            self._try_merge(pool, block, nxt)
        pool.insert(block)

    def _try_merge(self, pool: BlockPool, dst: Block, src: Block | None) -> int:
        """``try_merge_blocks``: absorb a free neighbour with the same mapped state."""
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)
        return src.size

    # ---- releasing cached memory ---------------------------------------------------------------------------
    def _release_block(self, pool: BlockPool, block: Block) -> None:
        """``release_block``: cudaFree a whole cached segment."""
        assert not block.is_split() and not block.expandable
        pool.remove(block)
        self.reserved -= block.size
        self.segments -= 1
        self.num_device_free += 1

    def _release_blocks(self, pool: BlockPool) -> None:
        """``release_blocks``: free every unsplit cached segment; unmap free pages of expandable segments."""
        to_unmap = []
        for key in list(pool.order):
            b = pool.blocks[key & ADDR_MASK]
            if b.expandable:
                to_unmap.append(b)
            elif not b.is_split():
                self._release_block(pool, b)
        for b in to_unmap:
            self._unmap_block(pool, b)
            if not b.is_split():  # release_expandable_segment: the whole segment is unmapped
                pool.remove_unmapped(b)
                del self._es_mapped[b.seg]

    def _release_cached_blocks(self) -> bool:
        """``release_cached_blocks`` (no private pools, nothing to synchronize)."""
        self._release_blocks(self._large)
        self._release_blocks(self._small)
        return True

    def _release_available_cached_blocks(self, pool: BlockPool, size: int) -> bool:
        """``release_available_cached_blocks``: free oversize cached blocks, largest first, to fit
        ``size``."""
        mss = self.conf.max_split_size_bytes
        if mss is None:
            return False
        key = max(size, mss)
        order = pool.order
        i = bisect_left(order, key << ADDR_BITS)
        if i == len(order) or pool.blocks[order[i] & ADDR_MASK].expandable:
            if i == 0:
                return False
            released = 0
            i -= 1
            while released < key and order[i] >> ADDR_BITS >= mss:
                cur = pool.blocks[order[i] & ADDR_MASK]
                is_first = i == 0
                if not is_first:
                    i -= 1
                if not cur.expandable:
                    released += cur.size
                    self._release_block(pool, cur)
                if is_first:
                    break
            return released >= key
        self._release_block(pool, pool.blocks[order[i] & ADDR_MASK])
        return True

    def _garbage_collect_cached_blocks(self) -> None:
        """``garbage_collect_cached_blocks``: free unsplit large blocks older than average until under
        target."""
        assert self.allowed is not None
        threshold = int(self.conf.garbage_collection_threshold * self.allowed)
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        pool = self._large
        ages = [pool.gc_calls - b.gc_base for b in pool.blocks.values() if not b.is_split()]
        total_age, count = sum(ages), len(ages)
        if count == 0:
            return
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for k in list(pool.order):
                b = pool.blocks[k & ADDR_MASK]
                age = pool.gc_calls - b.gc_base
                if not b.is_split() and not b.expandable and age >= age_threshold:
                    freed = True
                    reclaimed += b.size
                    total_age -= age
                    count -= 1
                    self._release_block(pool, b)
