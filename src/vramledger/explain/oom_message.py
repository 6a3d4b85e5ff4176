"""Read the figures out of PyTorch's CUDA out-of-memory message, in every wording it has had.

The message is written by ``DeviceCachingAllocator::malloc`` in ``c10/cuda/CUDACachingAllocator.cpp`` when a
request fails after the allocator's retries (it has freed every cached segment that is wholly free first, so
the cached bytes it still reports sit in segments that also hold live blocks). Wordings, oldest first:

- torch 1.0–1.3 (pytorch/pytorch#13751): ``Tried to allocate A (GPU d; T total capacity; X already allocated;
  F free; C cached)`` — ``cached`` is reserved − allocated (``stats.amount_cached - stats.amount_allocated``);
- torch 1.4–2.0: ``... F free; [L allowed; ]R reserved in total by PyTorch)`` — ``R`` is all reserved bytes;
  from 1.10 followed by ``If reserved memory is >> allocated memory try setting max_split_size_mb ...``;
- torch 2.1: ``Tried to allocate A. GPU d has a total capacty of T of which F is free. [Process p has P memory
  in use. ][Including non-PyTorch memory, this process has P memory in use. ]Of the allocated memory X is
  allocated by PyTorch, and U is reserved by PyTorch but unallocated.`` (``capacty`` sic);
- torch ≥ 2.2 (the stored pytorch/pytorch commit 001074d): the same with ``capacity``, ``L allowed; `` after the
  process lines when ``set_per_process_memory_fraction`` is in force, ``with G allocated in private pools
  (e.g., CUDA Graphs), `` when graphs hold memory, and the hint ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.

The process lines come from ``reportProcessMemoryInfo`` (NVML; absent without it). Every size is printed by
``format_size``: ``N bytes`` up to 1 KiB, then two decimals of KiB, MiB or GiB, so each figure is exact only to
half a unit of its last digit (±5 MiB for a figure in GiB). ``A`` is the allocation size after rounding
(``get_allocation_size``), not the tensor's own size.

Each figure is matched on its own, so a message cut short or wrapped over lines still gives what it holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SIZE = r"(\d+(?:\.\d+)?) (bytes|KiB|MiB|GiB)"
_UNIT = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_START = re.compile(r"out of memory\. Tried to allocate ", re.IGNORECASE)


def _bytes(value: str, unit: str) -> int:
    return int(round(float(value) * _UNIT[unit]))


@dataclass(frozen=True, kw_only=True, slots=True)
class OomMessage:
    """The figures of one CUDA OOM message; ``None`` where that wording does not say."""

    requested_bytes: int
    """``Tried to allocate``: the rounded allocation that failed."""
    device: int | None
    capacity_bytes: int | None
    """The GPU's total memory (``cudaMemGetInfo`` total)."""
    free_bytes: int | None
    """Free on the device as the driver saw it, all processes included."""
    process_bytes: int | None
    """``this process has P memory in use`` (NVML): PyTorch's reserve plus the CUDA context and other libraries."""
    other_processes: tuple[tuple[int, int], ...]
    """``Process p has P memory in use``: (pid, bytes) of other processes on the same GPU."""
    allowed_bytes: int | None
    """``L allowed``: the cap of ``set_per_process_memory_fraction``."""
    allocated_bytes: int | None
    """Bytes in live tensors (``allocated by PyTorch`` / ``already allocated``)."""
    reserved_bytes: int | None
    """All bytes the caching allocator holds: allocated plus reserved-but-unallocated."""
    private_pool_bytes: int | None
    wording: str
    """Which PyTorch wording the message has (see the module docstring)."""
    text: str
    """The message as matched (whitespace collapsed)."""

    @property
    def unallocated_bytes(self) -> int | None:
        """Reserved but not in a live tensor: free blocks inside segments that also hold live blocks."""
        if self.reserved_bytes is None or self.allocated_bytes is None:
            return None
        return self.reserved_bytes - self.allocated_bytes


def _find(pattern: str, text: str) -> re.Match[str] | None:
    return re.search(pattern, text)


def _size(pattern: str, text: str) -> int | None:
    m = _find(pattern, text)
    return None if m is None else _bytes(m.group(1), m.group(2))


def _first(*values: int | None) -> int | None:
    """The first figure found (``or`` would skip a real ``0 bytes``)."""
    return next((v for v in values if v is not None), None)


def _wording(text: str) -> str:
    if "total capacty of" in text:
        return "torch 2.1"
    if "reserved by PyTorch but unallocated" in text or "has a total capacity of" in text:
        return "torch >= 2.2"
    if "reserved in total by PyTorch" in text:
        return "torch 1.4-2.0"
    if re.search(_SIZE + r" cached\)", text):
        return "torch 1.0-1.3"
    return "unknown (only the request was found)"


def find_messages(text: str) -> list[str]:
    """Every OOM message in ``text`` (a log may hold several), whitespace collapsed, oldest first."""
    flat = " ".join(text.split())
    starts = [m.start() for m in _START.finditer(flat)]
    return [flat[s : (starts[i + 1] if i + 1 < len(starts) else len(flat))][:2000] for i, s in enumerate(starts)]


def parse_message(text: str) -> OomMessage | None:
    """The figures of the last OOM message in ``text``; None when it holds none.

    >>> m = parse_message("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; "
    ...                   "14.56 GiB already allocated; 4.31 MiB free; 14.70 GiB reserved in total by PyTorch)")
    >>> m.requested_bytes, m.wording
    (20971520, 'torch 1.4-2.0')
    """
    found = find_messages(text)
    if not found:
        return None
    msg = found[-1]
    requested = _size("Tried to allocate " + _SIZE, msg)
    assert requested is not None  # _START matched it
    device = _find(r"GPU (\d+)[ ;]", msg)
    capacity = _first(_size(r"has a total capac(?:ity|ty) of " + _SIZE, msg), _size(_SIZE + r" total capacity", msg))
    free = _first(_size(r"of which " + _SIZE + " is free", msg), _size(r"; " + _SIZE + r" free[;)]", msg))
    allocated = _first(_size(r"Of the allocated memory " + _SIZE, msg), _size(_SIZE + r" already allocated", msg))
    reserved = _size(_SIZE + r" reserved in total by PyTorch", msg)
    unallocated = _size(r"and " + _SIZE + r" is reserved by PyTorch but unallocated", msg)
    cached = _size(r"; " + _SIZE + r" cached\)", msg)
    if reserved is None and allocated is not None:
        extra = unallocated if unallocated is not None else cached
        reserved = None if extra is None else allocated + extra
    others = tuple(
        (int(m.group(1)), _bytes(m.group(2), m.group(3)))
        for m in re.finditer(r"Process (\d+) has " + _SIZE + " memory in use", msg)
    )
    return OomMessage(
        requested_bytes=requested,
        device=None if device is None else int(device.group(1)),
        capacity_bytes=capacity,
        free_bytes=free,
        process_bytes=_size(r"this process has " + _SIZE + " memory in use", msg),
        other_processes=others,
        allowed_bytes=_size(_SIZE + r" allowed;", msg),
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        private_pool_bytes=_size(r"with " + _SIZE + r" allocated in private pools", msg),
        wording=_wording(msg),
        text=msg.strip(),
    )
