"""GPU memory outside the caching allocator's arithmetic: the CUDA context and the BLAS workspaces.

The figures live in ``catalog/device_overhead.json``, each with its source; none is measured by vramledger yet
(``measured_by_us`` is false everywhere), so a ledger that uses them should mark them ``Basis.ASSUMPTION``.

- The CUDA context is outside PyTorch: device total = reserved + context.
- The cuBLAS and cuBLASLt workspaces are allocated *through* the caching allocator (``CublasHandlePool.cpp``),
  so they are live blocks counted in ``memory_allocated`` from the first matmul on; pass
  :meth:`DeviceOverhead.workspace_sizes` to ``reserve_for_blocks`` together with the tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from vramledger.errors import VramledgerError

_PATH = Path(__file__).resolve().parent / "device_overhead.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class OverheadFigure:
    """One sourced number."""

    bytes: int
    source: str
    """Where the number comes from (upstream file and function, or a published measurement)."""
    approximate: bool = False
    """The source gave a rounded figure ("around 400MB")."""
    measured_by_us: bool = False
    what: str = ""
    """What exactly the figure covers."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceOverhead:
    """Overheads for one GPU architecture family."""

    arch: str
    cuda_context: OverheadFigure
    """Outside PyTorch: add to reserved for the device total (what nvidia-smi shows)."""
    cublas_workspace: OverheadFigure
    """Inside the caching allocator: one block per cuBLAS handle and stream (two handles in a training step)."""
    cublaslt_workspace: OverheadFigure
    """Inside the caching allocator: one block per cuBLASLt handle and stream."""

    def workspace_sizes(self, handles: int = 2) -> tuple[int, ...]:
        """Block sizes of the BLAS workspaces: one cuBLAS and one cuBLASLt workspace per (handle, stream).

        Handles are per thread (``DeviceThreadHandlePool``), and autograd runs backward on its own device
        thread, so a single-stream training step uses two handles: the forward's and the backward's.
        """
        return (self.cublas_workspace.bytes, self.cublaslt_workspace.bytes) * handles


@lru_cache(maxsize=1)
def _raw() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(_PATH.read_text())
    return data


def known_archs() -> tuple[str, ...]:
    return tuple(_raw()["arch_compute_capability_major"])


@lru_cache(maxsize=64)  # pure over the bundled file; every estimate asks for its GPU's
def device_overhead(arch: str) -> DeviceOverhead:
    """Overheads for ``arch`` (``GPUSpec.arch``: ``ampere``, ``hopper``, ``ada``, ``blackwell``...).

    >>> device_overhead("hopper").cublas_workspace.bytes  # 32 MiB on compute capability 9.x
    33554432
    """
    raw = _raw()
    majors: dict[str, int] = raw["arch_compute_capability_major"]
    key = arch.strip().lower()
    if key not in majors:
        raise VramledgerError(f"no device overhead figures for GPU architecture {arch!r}; known: {', '.join(majors)}")
    major = majors[key]
    contexts = {c["arch"]: c for c in raw["cuda_context"]}
    ctx = contexts.get(key, contexts["*"])
    blas = next(w for w in raw["cublas_workspace"] if major in w["compute_capability_major"])
    lt = raw["cublaslt_workspace"]

    return DeviceOverhead(arch=key, cuda_context=_fig(ctx), cublas_workspace=_fig(blas), cublaslt_workspace=_fig(lt))


def _fig(d: dict[str, Any]) -> OverheadFigure:
    return OverheadFigure(
        bytes=int(d["bytes"]),
        source=d["source"],
        approximate=bool(d.get("approximate", False)),
        measured_by_us=bool(d["measured_by_us"]),
        what=d.get("what", d.get("per", "")),
    )


@lru_cache(maxsize=64)
def cuda_context(arch: str | None) -> OverheadFigure:
    """The CUDA context for ``arch``, else (no GPU, or an architecture without figures such as AMD's) the figure
    for any architecture (``"*"``: pytorch#109888, "around 400MB" with lazy module loading).

    >>> cuda_context(None).bytes // 2**20
    400
    """
    contexts = {c["arch"]: c for c in _raw()["cuda_context"]}
    return _fig(contexts.get((arch or "*").strip().lower(), contexts["*"]))
