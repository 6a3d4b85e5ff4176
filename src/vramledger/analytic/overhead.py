"""Memory outside live tensors: the CUDA context, library workspaces and the caching allocator's reserve.

None of these is visible to a trace on CPU. Until our own GPU measurements are committed (issue 4, issue 8) the
figures below are stated assumptions with the evidence they rest on, and every line that uses them says so.
"""

from __future__ import annotations

from vramledger.specs import GPUSpec
from vramledger.units import MiB

# CUDA context + kernel images loaded lazily (CUDA_MODULE_LOADING=LAZY, the default since CUDA 11.7 / torch 2.0):
# commonly reported at 300-600 MiB for torch 2.x with CUDA 12 on datacenter GPUs (nvidia-smi before and after
# torch.cuda.init() and a first matmul). We take the top of that range for recent architectures.
_CONTEXT_BY_ARCH = {
    "hopper": 600 * MiB,
    "blackwell": 600 * MiB,
    "ampere": 500 * MiB,
    "ada": 500 * MiB,
    "turing": 400 * MiB,
    "volta": 400 * MiB,
    "cdna3": 600 * MiB,
    "cdna2": 600 * MiB,
}
CONTEXT_SOURCE = (
    "assumption: CUDA context with lazy module loading, 400-600 MiB by architecture (published nvidia-smi "
    "readings for torch 2.x / CUDA 12); not yet measured by vramledger"
)


def cuda_context_bytes(gpu: GPUSpec | None) -> int:
    if gpu is None:
        return 600 * MiB
    return _CONTEXT_BY_ARCH.get(gpu.arch, 600 * MiB)


def cublas_workspace_bytes(gpu: GPUSpec | None) -> int:
    """cuBLAS workspaces, allocated through torch's caching allocator (so counted as allocated).

    torch ``aten/src/ATen/cuda/CublasHandlePool.cpp`` ``getChosenWorkspaceSize``: 32 MiB (``:4096:8``) on Hopper
    and newer, ``4096·1024·2 + 16·1024·8`` bytes otherwise; one per (handle, stream), and the autograd engine's
    backward thread has its own handle, so two.
    """
    hopper_plus = gpu is None or gpu.arch in ("hopper", "blackwell")
    per = 32 * MiB if hopper_plus else 4096 * 1024 * 2 + 16 * 1024 * 8
    return 2 * per


RESERVE_FRACTION = 0.05
RESERVE_SOURCE = (
    "assumption: caching-allocator reserve (2 MiB rounding, cached blocks that do not fit later requests) "
    "taken as 5% of peak allocated + 64 MiB until the allocator replay is calibrated on a GPU (issue 4)"
)


def allocator_reserve_bytes(allocated: int) -> int:
    return int(allocated * RESERVE_FRACTION) + 64 * MiB
