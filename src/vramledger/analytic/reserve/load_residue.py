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

Under checkpointing what is live at the loss's peak besides the weights is the layers' inputs the checkpoints save
(c·H·T each; ``torch.utils.checkpoint``'s non-reentrant forward keeps nothing else of a layer) and the final norm's
(larger), so the tails smaller than c·H·T stay free there (the trace, bench/reserve/forward_cache_ckpt.jsonl: Qwen3-8B
LoRA 2 × 4096 144 MiB, analytic 144; Llama-3-8B 1 × 16384 120 MiB, analytic 128: RoPE's cos and sin, c·hd·T = 4 MiB
each there, take two 4 MiB tails, not modelled).

Adapter weights above the small pool's 1 MiB (``r·in`` or ``out·r`` fp32 elements: Qwen2.5-7B's MLP adapters at r =
16, 1.16 MiB) go on the device after the base (PEFT ``lora.Linear.update_layer`` →
``_move_adapter_to_device_of_base_layer``), and best fit cuts each from the smallest tail that holds it: Qwen2.5-7B's
68 tails of 1.5 MiB (each 1.16 MiB adapter takes a whole one, the 0.34 MiB rest being under the 1 MiB a split needs)
leave 9.6 MiB (the trace: 2.7 MiB free, its MLP adapters' states in a few more).

The load order is the modules' (``named_parameters``: the embedding, each layer's projections in order and its
norms, the final norm, lm_head), replayed through ``allocator/model.py``. Quantised bases (bitsandbytes storage) are
not modelled (0).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from vramledger.allocator.conf import K_SMALL_SIZE
from vramledger.allocator.model import CachingAllocatorModel
from vramledger.analytic.params import layer_linears
from vramledger.analytic.parts import StepParts
from vramledger.analytic.reserve.forward_cache import one_copy_weights
from vramledger.specs import Loss, ModelSpec, TrainSpec


def load_tails(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """Bytes of the frozen base's segment tails that no request of the step fits in (see above)."""
    wb = p.weights
    frozen = wb.total_params - wb.trainable_params
    if not one_copy_weights(train) or train.fsdp is not None or not frozen or not train.adapters or m.is_moe:
        return 0  # FSDP's flat parameters (even unsharded), ZeRO-3's partitions: no segment per weight
    if train.loss not in (Loss.STANDARD, Loss.CHUNKED_NLL):  # a fused or chunked loss's chunks can take them
        return 0
    c, T = train.precision.compute.bytes, train.tokens
    # The smallest tensors kept to the loss: without checkpointing a decoder layer's k and v projections (c·kv·T);
    # under checkpointing the layers' inputs the checkpoints save (c·H·T). In the small pool up to 1 MiB, where no
    # tail is counted, so that the figure never falls as T grows.
    smallest = c * (m.hidden_size if train.grad_ckpt else m.kv_dim) * T
    return sum(t for t in _tails(m, round(wb.frozen_bytes / frozen), _adapters_in_large_pool(train, p)) if t < smallest)


def _adapters_in_large_pool(train: TrainSpec, p: StepParts) -> tuple[int, ...]:
    """The adapter weights above the small pool's 1 MiB, in ``named_parameters`` order: ``lora_A`` (r·in) and
    ``lora_B`` (out·r) of each adapted projection (Qwen2.5-7B's MLP adapters at r = 16: 1.16 MiB in fp32; most 7B
    MLP adapters at r = 64)."""
    wb = p.weights
    assert train.lora is not None
    r, b = train.lora.rank, wb.trainable_dtype.bytes
    per_layer = [
        n * b for a in wb.adapted for n in (r * a.linear.in_features, a.linear.out_features * r) if n * b > K_SMALL_SIZE
    ]
    return tuple(per_layer) * wb.trainable_layers


def optimizer_tails(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """Bytes of the trained weights' segment tails free at step 1's optimizer peak (full fine-tuning, every weight
    trained; 0 otherwise): those smaller than the smallest large-pool per-parameter tensor.

    What is live there besides the weights is per-parameter: gradients, AdamW's states (torch/optim/adam.py
    ``_init_group``: ``zeros_like`` of each parameter) and the foreach temporaries (``_foreach_sqrt``), each the size
    of a parameter in its dtype; one above kSmallSize (1 MiB) is a large-pool request (``get_pool``) and best fit
    (``get_free_block``) puts it in a tail only if the tail holds it, so the tails smaller than the smallest of them
    are free and cached while step 1's optimizer allocates its peak (what it frees before is irrelevant: a freed
    block in a tail is the tail again). Qwen2.5-0.5B fp32, 4 × 512 (bench/reserve/: a per-segment count of the
    replay at step 1's optimizer peak): 0.112 GiB free in 91 blocks of the load's segments; counted 0.109 GiB, the
    80 tails under its 3.06 MiB q and o projections."""
    wb = p.weights
    if train.adapters or p.frozen_bytes or not wb.trainable_layers or m.is_moe or train.fsdp is not None:
        return 0  # FSDP's flat parameters, an MoE's fused experts: no segment per weight (as ``load_tails``)
    b = wb.trainable_dtype.bytes
    smallest = _smallest_large_tensor(m, b)
    return sum(t for t in _tails(m, b) if t < smallest)


@lru_cache(maxsize=256)
def _smallest_large_tensor(m: ModelSpec, b: int) -> int:
    """The smallest decoder matrix above kSmallSize (1 MiB) at ``b`` bytes per element: the smallest large-pool
    per-parameter tensor (gradient, state, foreach temporary) of full fine-tuning."""
    return min(
        (x for lin in layer_linears(m) if (x := b * lin.in_features * lin.out_features) > K_SMALL_SIZE), default=0
    )


def loss_tails_switch(m: ModelSpec, train: TrainSpec, p: StepParts) -> Callable[[int, int], bool] | None:
    """Full fine-tuning without checkpointing: where the trained weights' segment tails are free at step 2's loss peak
    too (``loss_tails``), k's and v's saved projections (c·kv·T, the smallest tensors kept to the loss) being small-pool
    blocks (≤ 1 MiB, CUDACachingAllocator.cpp ``get_pool``), which never take a large-pool tail; None where it never
    is. Above, best fit (``get_free_block``) cuts them from the tails that hold them, and the count falls: a set of
    shapes closed downwards, held for a run with dynamic padding (runs.py)."""
    if train.grad_ckpt or not optimizer_tails(m, train, p):
        return None
    ckv = train.precision.compute.bytes * m.kv_dim

    def on(b: int, ell: int) -> bool:
        return ckv * b * ell <= K_SMALL_SIZE

    return on


def loss_tails(m: ModelSpec, train: TrainSpec, p: StepParts) -> int:
    """Bytes of the trained weights' segment tails free at step 2's loss peak (where ``loss_tails_switch`` is on):
    those ``optimizer_tails`` counts at step 1's optimizer peak that are also smaller than every large-pool tensor
    saved to the loss besides k and v, the c·H·T residual stream and the c·q·T query and attention output
    (transformers ``LlamaDecoderLayer``; the norms' fp32 inputs are larger), so no saved activation is cut from them.
    The trace replay of Qwen2.5-0.5B full, fp32, fused AdamW, 4 × 256 (bench/reserve/replay_causes.jsonl): 114 MiB
    free in 97 blocks of the load's segments at step 2's peak; counted 112 MiB (80 tails under its 3.06 MiB q and o
    projections; c·H·T = 3.5 MiB, c·kv·T = 0.5 MiB)."""
    wb = p.weights
    b = wb.trainable_dtype.bytes
    saved = train.precision.compute.bytes * min(m.hidden_size, m.q_dim) * train.tokens
    smallest = min(_smallest_large_tensor(m, b), saved)
    return sum(t for t in _tails(m, b) if t < smallest)


def weight_tails(m: ModelSpec, dtype_bytes: int) -> tuple[int, ...]:
    """The free large-pool blocks loading every weight in ``dtype_bytes`` per element leaves, from an empty cache
    (trained weights are loaded the same way: reserve/ckpt_forward.py)."""
    return _tails(m, dtype_bytes)


@lru_cache(maxsize=256)
def _tails(m: ModelSpec, dtype_bytes: int, adapters: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The free large-pool blocks once the base is loaded in ``dtype_bytes`` per element from an empty cache and
    the adapter weights above 1 MiB (``adapters``) are put on the device after it (PEFT ``lora.Linear.update_layer``
    → ``_move_adapter_to_device_of_base_layer``): best fit cuts each from the smallest tail that holds it."""
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
    for size in adapters:
        model.malloc(size)
    large = model.free_layout()[2]  # the large pool's cached blocks, (size, address)
    assert isinstance(large, tuple)
    return tuple(size for size, _ in large)
