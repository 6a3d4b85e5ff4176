"""A GPU's facts that matter for memory and time."""

from __future__ import annotations

from dataclasses import dataclass

from vramledger.errors import VramledgerError


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
