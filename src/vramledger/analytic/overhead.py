"""Memory outside live tensors: the CUDA context, library workspaces and the caching allocator's reserve.

None of these is visible to a trace on CPU. Until our own GPU measurements are committed (issue 4, issue 8) the
figures below are stated assumptions with the evidence they rest on, and every line that uses them says so.
"""

from __future__ import annotations

from vramledger.specs import GPUSpec
from vramledger.units import MiB

# CUDA context + kernel images loaded lazily (CUDA_MODULE_LOADING=LAZY, the default since CUDA 11.7 / torch 2.0).
# Evidence: torch's OOM message prints "this process has X in use" beside what PyTorch allocated and reserved;
# the difference is memory outside the allocator. OpenHelix-Team/cobra#24 (24 GB card): 23.57 − 22.14 − 0.91 =
# 0.52 GiB; kaito-project/kaito#976 (16 GB card, vLLM): 15.25 − 13.73 − 0.74 = 0.78 GiB (vLLM adds NCCL and graphs).
_CONTEXT_BY_ARCH = {
    "hopper": 600 * MiB,
    "blackwell": 600 * MiB,
    "cdna3": 600 * MiB,
    "cdna2": 600 * MiB,
}
_CONTEXT_DEFAULT = 540 * MiB
CONTEXT_SOURCE = (
    "CUDA context with lazy module loading: 540 MiB (600 MiB Hopper+), from the non-PyTorch memory printed in "
    "published OOM messages (pytorch OOM text: in use − allocated − reserved); not yet measured by vramledger"
)


def cuda_context_bytes(gpu: GPUSpec | None) -> int:
    if gpu is None:
        return 600 * MiB
    return _CONTEXT_BY_ARCH.get(gpu.arch, _CONTEXT_DEFAULT)


def cublas_workspace_bytes(gpu: GPUSpec | None) -> int:
    """cuBLAS + cuBLASLt workspaces, allocated through torch's caching allocator (so counted as allocated).

    Figures and sources in ``catalog/device_overhead.json`` (torch ``CublasHandlePool.cpp``
    ``getChosenWorkspaceSize``: 32 MiB on Hopper and newer, 8.125 MiB before; cuBLASLt 1 MiB), one of each per
    thread's handle: the forward thread and the autograd engine's backward thread.
    """
    from vramledger.catalog.device_overhead import device_overhead
    from vramledger.errors import VramledgerError

    try:
        return sum(device_overhead(gpu.arch if gpu is not None and gpu.arch else "hopper").workspace_sizes())
    except VramledgerError:  # an architecture without figures (AMD): take the largest NVIDIA one
        return sum(device_overhead("hopper").workspace_sizes())


# Training steps take their reserve from analytic/reserve.py (the allocator's rules applied to the step); this
# flat assumption remains for inference and for evaluation phases that allocate beyond the training step's cache.
RESERVE_FRACTION = 0.05
RESERVE_SOURCE = (
    "caching-allocator reserve (2 MiB rounding, cached blocks that do not fit later requests) taken as 5% of "
    "peak allocated + 64 MiB (published OOM messages show 4-5.5% reserved-but-unallocated) until the allocator "
    "replay is calibrated on a GPU (issue 4)"
)


def allocator_reserve_bytes(allocated: int) -> int:
    return int(allocated * RESERVE_FRACTION) + 64 * MiB
