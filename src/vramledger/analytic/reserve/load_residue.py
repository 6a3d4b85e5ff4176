"""What loading a frozen base leaves cached in its segments, and how much of it no step's request can use.

Loading puts each weight in the caching allocator one tensor at a time (``CUDACachingAllocator.cpp``
``get_allocation_size``: a tensor of at least 10 MiB gets a segment of its own, rounded up to 2 MiB; smaller ones
are cut from 20 MiB segments, tensors of at most 1 MiB from the small pool's 2 MiB ones). What is left over in those
segments is a set of free blocks: the < 2 MiB tail of each large weight's segment (Qwen2.5-1.5B's MLP weights, 1536
× 8960 in bf16: 26.25 MiB in 28 MiB segments, 84 tails of 1.75 MiB) and the rest of the 20 MiB segments the smaller
weights share (Qwen2.5-0.5B: two 8.3 MiB MLP weights in each, 3.4 MiB left). Segments are never merged or released,
so a tail stays cached unless a later request fits in it (best fit, ``get_free_block``); what is live at the
loss's peak besides the weights is the saved activations, none smaller than k's and v's projections (c·kv·T). The
tails smaller than that stay free there (Qwen2.5-3B's 4 MiB tails, two 8 MiB projections in each 20 MiB segment,
hold its 4 MiB k and v at 4 × 2048). The trace replay shows them at step 2's peak (Qwen2.5-1.5B DoRA 2 × 1024: 147 MiB
in 84 blocks made by the load, Gemma-2-2B LoRA 2 × 1024: 195 MiB; a 2-layer toy's are used: bench/reserve/).

Under checkpointing the tails stay cached too (Qwen3-1.7B LoRA 1 × 4096: 8 MiB, the custom 8-layer Llama 8 × 512: 18
MiB), but there the checkpointed layer's transients counted as stranded (reserve/shape.py ``stranded_bytes``) already
over-count what is cached (tests/analytic/test_reserve.py LORA_OVER, +3 to +7%): the tails are left out until that
term is right.

The load order is the modules' (``named_parameters``: the embedding, each layer's projections in order and its
norms, the final norm, lm_head), replayed through ``allocator/model.py``. Quantised bases (bitsandbytes storage) are
not modelled (0).
"""

from __future__ import annotations

from functools import lru_cache

from vramledger.allocator.model import CachingAllocatorModel
from vramledger.analytic.params import layer_linears
from vramledger.analytic.parts import StepParts
from vramledger.specs import Loss, ModelSpec, TrainSpec


def load_tails(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """Bytes of the frozen base's segment tails that no request of the step fits in (see above; 0 under
    checkpointing)."""
    wb = p.weights
    frozen = wb.total_params - wb.trainable_params
    if train.quant is not None or not frozen or not train.adapters or m.is_moe or train.grad_ckpt:
        return 0
    if train.loss not in (Loss.STANDARD, Loss.CHUNKED_NLL):  # a fused or chunked loss's chunks can take them
        return 0
    # The smallest tensors a decoder layer keeps to the loss: k's and v's projections (c·kv·T; in the small pool
    # up to 1 MiB, where no tail is counted, so that the figure never falls as T grows).
    smallest = train.precision.compute.bytes * m.kv_dim * train.tokens
    return sum(t for t in _tails(m, round(wb.frozen_bytes / frozen)) if t < smallest)


def weight_tails(m: ModelSpec, dtype_bytes: int) -> tuple[int, ...]:
    """The free large-pool blocks loading every weight in ``dtype_bytes`` per element leaves, from an empty cache
    (trained weights are loaded the same way: reserve/ckpt_forward.py)."""
    return _tails(m, dtype_bytes)


@lru_cache(maxsize=256)
def _tails(m: ModelSpec, dtype_bytes: int) -> tuple[int, ...]:
    """The free large-pool blocks after loading the base in ``dtype_bytes`` per element, from an empty cache."""
    model = CachingAllocatorModel()
    H, V = m.hidden_size, m.vocab_size
    model.malloc(V * H * dtype_bytes)
    for _ in range(m.num_layers):
        for lin in layer_linears(m):
            model.malloc(lin.in_features * lin.out_features * dtype_bytes)
            if lin.bias:
                model.malloc(lin.out_features * dtype_bytes)
        model.malloc(H * dtype_bytes)  # the input and post-attention norms
        model.malloc(H * dtype_bytes)
    model.malloc(H * dtype_bytes)
    if not m.tie_word_embeddings:
        model.malloc(V * H * dtype_bytes)
    large = model.free_layout()[2]  # the large pool's cached blocks, (size, address)
    assert isinstance(large, tuple)
    return tuple(size for size, _ in large)
