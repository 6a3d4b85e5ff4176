"""The few CUDA calls the callbacks need, behind one small interface, with a stand-in where CUDA is absent.

Every call here reads the caching allocator's host-side counters (``torch.cuda.memory_stats``,
``reset_peak_memory_stats``: ``DeviceCachingAllocator::getStats`` / ``resetPeakStats`` take the allocator's mutex,
never the GPU), so watching a step adds no device synchronisation. Device properties are read once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

OomObserver = Callable[[int, int, int, int], None]
"""``(device, requested, limit_or_total, device_free)``: what ``torch._C._cuda_attach_out_of_memory_observer``
passes (c10/cuda/CUDACachingAllocator.cpp ``malloc``: ``alloc_size``, the fraction's cap else the device total,
``cudaMemGetInfo``'s free)."""


class MemoryStats(Protocol):
    """What a watcher reads. ``None`` where the backend cannot say (no CUDA)."""

    def available(self) -> bool: ...
    def reset_peaks(self) -> None: ...
    def peaks(self) -> tuple[int, int] | None:
        """(max allocated, max reserved) since the last reset."""

    def current(self) -> tuple[int, int] | None:
        """(allocated, reserved) now."""

    def capacity(self) -> int | None: ...
    def device_name(self) -> str: ...
    def start_history(self, max_entries: int) -> bool: ...
    def stop_history(self) -> None: ...
    def snapshot(self) -> dict[str, Any] | None: ...
    def attach_oom_observer(self, observer: OomObserver) -> bool: ...


class NoStats:
    """No CUDA: nothing to measure; the watcher still records batches and the prediction."""

    def available(self) -> bool:
        return False

    def reset_peaks(self) -> None:
        return None

    def peaks(self) -> tuple[int, int] | None:
        return None

    def current(self) -> tuple[int, int] | None:
        return None

    def capacity(self) -> int | None:
        return None

    def device_name(self) -> str:
        return "cpu"

    def start_history(self, max_entries: int) -> bool:
        return False

    def stop_history(self) -> None:
        return None

    def snapshot(self) -> dict[str, Any] | None:
        return None

    def attach_oom_observer(self, observer: OomObserver) -> bool:
        return False


class CudaStats:
    """The current CUDA device's allocator statistics."""

    def __init__(self, device: Any = None) -> None:
        import torch

        self._torch = torch
        self.device = torch.cuda.current_device() if device is None else torch.device(device).index or 0
        props = torch.cuda.get_device_properties(self.device)
        self._capacity = int(props.total_memory)
        self._name = str(props.name)

    def available(self) -> bool:
        return True

    def reset_peaks(self) -> None:
        self._torch.cuda.reset_peak_memory_stats(self.device)

    def peaks(self) -> tuple[int, int] | None:
        s = self._torch.cuda.memory_stats(self.device)  # one call for both figures
        return int(s.get("allocated_bytes.all.peak", 0)), int(s.get("reserved_bytes.all.peak", 0))

    def current(self) -> tuple[int, int] | None:
        s = self._torch.cuda.memory_stats(self.device)
        return int(s.get("allocated_bytes.all.current", 0)), int(s.get("reserved_bytes.all.current", 0))

    def capacity(self) -> int | None:
        return self._capacity

    def device_name(self) -> str:
        return self._name

    def start_history(self, max_entries: int) -> bool:
        # Python stacks only: C++ frames ("all") cost more per allocation and the attribution needs none.
        self._torch.cuda.memory._record_memory_history("all", context="all", stacks="python", max_entries=max_entries)
        return True

    def stop_history(self) -> None:
        self._torch.cuda.memory._record_memory_history(enabled=None)

    def snapshot(self) -> dict[str, Any] | None:
        return dict(self._torch.cuda.memory._snapshot())

    def attach_oom_observer(self, observer: OomObserver) -> bool:
        attach = getattr(self._torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is None:
            return False
        attach(observer)
        return True


def default_stats() -> MemoryStats:
    """CUDA's statistics when a CUDA device is there, else the stand-in that measures nothing."""
    import torch

    return CudaStats() if torch.cuda.is_available() else NoStats()
