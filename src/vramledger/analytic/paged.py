"""Paged optimizer states: CUDA unified (managed) memory that PyTorch's allocator never sees.

bitsandbytes ``optim/optimizer.py`` ``Optimizer8bit.get_state_buffer``: when ``is_paged`` (``PagedAdamW``,
``PagedAdamW8bit``, ``PagedLion``; HF ``paged_adamw_32bit`` / ``paged_adamw_8bit``), each state buffer comes from
``F.get_paged(*shape, dtype=…)`` (``functional.py``: ``cudaMallocManaged`` through ``lib.cget_managed_ptr``, wrapped
as a tensor with ``is_paged = True``) and is registered with ``GlobalPageManager``, which prefetches it to the device
before the step. Tensors of fewer than 1e5 elements are not paged: ``if not self.is_paged or p.numel() < 1e5:
return torch.zeros_like(p, ...)`` (0.41.1 and 0.42.0 l. 305, 0.50.2 l. 383), so their states are ordinary device
tensors inside PyTorch's allocator. LoRA's matrices are often that small (r·in and out·r: rank 8 on H = 4096 is
32,768 elements), so for a LoRA/QLoRA run the split is made per adapter tensor (``device_state_params``).

Consequences modelled:
- the states are counted in neither ``torch.cuda.max_memory_allocated`` nor ``max_memory_reserved``, so they stand
  on their own line (``Category.MANAGED_MEMORY``), added only to the device total (what nvidia-smi shows while
  they are resident);
- under memory pressure the driver pages them out to host memory instead of raising an OOM, so the device total is
  an upper bound when the GPU is nearly full;
- the allocator reserve does not include them (they never pass through the caching allocator).
Simplification: outside LoRA adapters (full fine-tuning, other PEFT methods) the small tensors that bitsandbytes
keeps unpaged (norms, biases) are counted as paged too.
"""

from __future__ import annotations

from vramledger.analytic.params import in_layers
from vramledger.analytic.weights import WeightBudget
from vramledger.specs import ModelSpec, TrainSpec

PAGED_MIN_NUMEL = 100_000
"""bitsandbytes ``get_state_buffer``: a tensor of fewer elements keeps its states on the device, unpaged."""

PAGED_SOURCE = (
    "bitsandbytes optim/optimizer.py get_state_buffer → F.get_paged (cudaMallocManaged), GlobalPageManager: "
    "CUDA managed memory outside PyTorch's allocator (in neither max_memory_allocated nor reserved; may page out)"
)


def device_state_params(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> int:
    """LoRA parameters in tensors too small to page (< ``PAGED_MIN_NUMEL`` elements): lora_A (r×in), lora_B
    (out×r) and DoRA's magnitude (out) of every adapted linear, and the head adapter's r×H and V×r. 0 for other
    methods (see the module's simplification)."""
    lora = train.lora
    if lora is None or not train.adapters or train.peft_config is not None:
        return 0
    small = 0
    for a in wb.adapted:
        lin = a.linear
        tensors = (lora.rank * lin.in_features, lin.out_features * lora.rank, lin.out_features if lora.dora else 0)
        if sum(tensors) * lin.per_layer != a.params:  # another layout (PEFT's fused experts): left paged
            continue
        small += in_layers(m, lin) * lin.per_layer * sum(n for n in tensors if n < PAGED_MIN_NUMEL)
    if lora.head:
        tensors = (lora.rank * m.hidden_size, m.vocab_size * lora.rank, m.vocab_size if lora.dora else 0)
        small += sum(n for n in tensors if n < PAGED_MIN_NUMEL)
    return small


def split_paged_states(m: ModelSpec, train: TrainSpec, wb: WeightBudget, states: int, paged: bool) -> tuple[int, int]:
    """(managed, device) bytes of the optimizer states: a paged optimizer's states of small tensors stay on the
    device, in proportion to their parameters (exact for 32-bit states)."""
    if not paged or not wb.trainable_params:
        return (0, states) if not paged else (states, 0)
    device = states * device_state_params(m, train, wb) // wb.trainable_params
    return states - device, device
