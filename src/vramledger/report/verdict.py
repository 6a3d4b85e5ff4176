"""The verdict in words: one home for the sentence every view prints (terminal, inference, HTML, fit/plan)."""

from __future__ import annotations

from vramledger.ledger import Verdict
from vramledger.units import fmt_bytes


def fit_status(total: int, usable: int) -> str:
    """``FITS (1.20 GiB to spare)`` or ``DOES NOT FIT (3.40 GiB over)``."""
    if total <= usable:
        return f"FITS ({fmt_bytes(usable - total)} to spare)"
    return f"DOES NOT FIT ({fmt_bytes(total - usable)} over)"


def verdict_sentence(v: Verdict) -> str:
    """``FITS on NVIDIA H100 80GB SXM (79.19 GiB, keeping 8% headroom = 72.86 GiB usable): 20.15 GiB to spare``."""
    status = "FITS" if v.fits else "DOES NOT FIT"
    margin = f"{fmt_bytes(v.margin_bytes)} to spare" if v.fits else f"{fmt_bytes(-v.margin_bytes)} over"
    sentence = (
        f"{status} on {v.gpu} ({fmt_bytes(v.capacity_bytes)}, keeping {v.headroom_fraction:.0%} headroom = "
        f"{fmt_bytes(v.usable_bytes)} usable): {margin}"
    )
    if not v.fits and 0 < v.without_cache_bytes <= v.usable_bytes:
        # CUDACachingAllocator.cpp malloc: release_cached_blocks() and a retry before out of memory
        sentence += (
            f"; without the allocator's cache it needs {fmt_bytes(v.without_cache_bytes)}, which fits: PyTorch "
            "frees its cache and retries before it fails, so the run may go on, slower, at the risk of a "
            "fragmentation OOM"
        )
    return sentence
