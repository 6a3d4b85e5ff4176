"""Memory outside live tensors: the CUDA context, library workspaces and the caching allocator's reserve.

None of these is visible to a trace on CPU. Until our own GPU measurements are committed the figures are stated
assumptions with the evidence they rest on (``catalog/device_overhead.json``), and every line that uses them says so.
"""

from __future__ import annotations

from vramledger.specs import GPUSpec
from vramledger.units import MiB

CONTEXT_SOURCE = (
    "CUDA context (driver state and kernels loaded lazily, outside PyTorch's allocator): the figure for the GPU's "
    "architecture in catalog/device_overhead.json, each with its published source; not yet measured by vramledger"
)


def cuda_context_bytes(gpu: GPUSpec | None) -> int:
    """The CUDA context for ``gpu``'s architecture, from ``catalog/device_overhead.json`` (its one home, each
    figure sourced there; ``catalog.device_overhead.cuda_context``)."""
    from vramledger.catalog.device_overhead import cuda_context

    return cuda_context(gpu.arch if gpu is not None else None).bytes


def obtainable_bytes(gpu: GPUSpec | None) -> int | None:
    """What torch's caching allocator can obtain on ``gpu``: its memory less the CUDA context (None: no GPU, an
    unlimited device). The capacity every allocator replay (trace, simulate) runs against."""
    if gpu is None:
        return None
    context = cuda_context_bytes(gpu)
    if gpu.memory_bytes - context <= 0:
        from vramledger.errors import VramledgerError

        raise VramledgerError(
            f"--gpu: {gpu.name} has no memory left after the CUDA context ({context // MiB} MiB); give a larger GPU"
        )
    return gpu.memory_bytes - context


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


# Training steps take their reserve from analytic/reserve/ (the allocator's rules applied to the step); this
# flat assumption remains for inference and for evaluation phases that allocate beyond the training step's cache.
RESERVE_FRACTION = 0.05
RESERVE_SOURCE = (
    "caching-allocator reserve (2 MiB rounding, cached blocks that do not fit later requests) taken as 5% of "
    "peak allocated + 64 MiB (published OOM messages show 4-5.5% reserved-but-unallocated) until the allocator "
    "replay is checked against real streams on a GPU (bench/accuracy/replay_streams.py)"
)


def allocator_reserve_bytes(allocated: int) -> int:
    return int(allocated * RESERVE_FRACTION) + 64 * MiB
