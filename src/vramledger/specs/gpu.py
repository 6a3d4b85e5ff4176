"""A GPU's facts that matter for memory and time."""

from __future__ import annotations

import math
from dataclasses import dataclass

from vramledger.errors import VramledgerError

DEFAULT_HEADROOM = 0.08
"""Fraction of GPU memory kept free by default (the allocator's fragmentation and what no model sees: README,
"Why 8% headroom"). The one home of this number: every function that takes ``headroom`` defaults to it."""


def check_headroom(headroom: float) -> float:
    """``headroom`` as a float in [0, 1), or the one-line error naming ``--headroom``."""
    if (
        isinstance(headroom, bool)
        or not isinstance(headroom, (int, float))
        or not math.isfinite(headroom)
        or not (0.0 <= headroom < 1.0)
    ):
        raise VramledgerError(
            f"--headroom must be a fraction in [0, 1) (got {headroom!r}); e.g. --headroom {DEFAULT_HEADROOM:g}"
        )
    return float(headroom)


@dataclass(frozen=True, kw_only=True, slots=True)
class GPUSpec:
    """One GPU model, from the bundled catalog (``catalog/gpus.json``)."""

    name: str
    """Display name, e.g. ``"NVIDIA H100 80GB SXM"``."""
    key: str
    """Catalog key, e.g. ``"h100-sxm"``."""
    memory_bytes: int
    """Total device memory as the driver reports it (``torch.cuda.get_device_properties().total_memory``)."""
    bf16_tflops: float
    """Dense bf16 (fp16 where no bf16) tensor-core peak, TFLOP/s, without sparsity."""
    memory_bandwidth_gbs: float
    """HBM/GDDR bandwidth in GB/s."""
    host_link_gbs: float
    """Host link (PCIe) bandwidth per direction in GB/s."""
    vendor: str = "nvidia"
    """``nvidia`` or ``amd``."""
    arch: str = ""
    """Architecture family (``ampere``, ``hopper``, ``ada``, ``blackwell``, ``volta``, ``turing``, ``cdna3``)."""
    supports_bf16: bool = True
    source: str = ""

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise VramledgerError(f"GPU {self.key}: memory_bytes must be positive")
