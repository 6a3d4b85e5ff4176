"""The additive attention mask SDPA's memory-efficient kernel keeps: how many columns it occupies."""

from __future__ import annotations

MASK_ALIGNMENT = 16
"""The memory-efficient kernel takes an attention bias whose last dimension is a multiple of 16: torch's SDPA pads
one that is not and slices it back, and the padded storage is what the kernel saves (aten/src/ATen/native/
transformers/attention.cpp ``preprocess_mask`` / ``pad_bias``, ``mem_eff_alignment = 16``)."""


def mask_columns(n: int) -> int:
    """The columns an additive SDPA mask of ``n`` keys occupies once padded for the memory-efficient kernel."""
    return -(-n // MASK_ALIGNMENT) * MASK_ALIGNMENT
