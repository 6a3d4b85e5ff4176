"""Paged optimizer states: CUDA unified (managed) memory that PyTorch's allocator never sees.

bitsandbytes ``optim/optimizer.py`` ``Optimizer8bit.get_state_buffer``: when ``is_paged`` (``PagedAdamW``,
``PagedAdamW8bit``, ``PagedLion``; HF ``paged_adamw_32bit`` / ``paged_adamw_8bit``), each state buffer comes from
``F.get_paged(*shape, dtype=…)`` (``functional.py``: ``cudaMallocManaged`` through ``lib.cget_managed_ptr``, wrapped
as a tensor with ``is_paged = True``) and is registered with ``GlobalPageManager``, which prefetches it to the device
before the step. Tensors below ``min_8bit_size`` (4096 elements) are not paged (``zeros_like`` on the device).

Consequences modelled:
- the states are counted in neither ``torch.cuda.max_memory_allocated`` nor ``max_memory_reserved``, so they stand
  on their own line (``Category.MANAGED_MEMORY``), added only to the device total (what nvidia-smi shows while
  they are resident);
- under memory pressure the driver pages them out to host memory instead of raising an OOM, so the device total is
  an upper bound when the GPU is nearly full;
- the allocator reserve does not include them (they never pass through the caching allocator).
Simplification: the small tensors that bitsandbytes keeps unpaged (norms, biases under 4096 elements) are counted
as paged too.
"""

from __future__ import annotations

PAGED_SOURCE = (
    "bitsandbytes optim/optimizer.py get_state_buffer → F.get_paged (cudaMallocManaged), GlobalPageManager: "
    "CUDA managed memory outside PyTorch's allocator (in neither max_memory_allocated nor reserved; may page out)"
)
