"""FSDP's default stream: the backward thread's cuBLAS workspace in an fp32 logits block, made again in step 2.

torch CublasHandlePool.cpp ``getCurrentCUDABlasHandle`` gives the autograd engine's thread a cuBLAS handle of its
own, whose workspace (``getChosenWorkspaceSize``: 32 MiB on Hopper) goes through the caching allocator at that
thread's first matmul, lm_head's backward in step 1, and is never freed. Best fit (CUDACachingAllocator.cpp
``get_free_block``) puts it in the smallest free block that holds it. At that moment the loss's fp32 blocks
(transformers ``ForCausalLMLoss``: the upcast, the log-softmax, the two gradients, 4·V·T each) have all been
freed, the c·V·T logits block holds its gradient's cast (lm_head's backward input), and the blocks forward
freed earlier are cut up by the saved activations. Where every other free block is smaller than the workspace
(the rivals below), it is cut from an fp32 logits block (``should_split``: the remainder is > 1 MiB). From step 2
on backward needs three 4·V·T blocks at once (the saved log-softmax and ``nll_loss_backward``'s and
``_log_softmax_backward_data``'s gradients): the block with the workspace inside cannot serve one, so one more
4·V·T segment is made, and at the peak its remainder (the segment less the workspace) is cached and free beside
the c·V·T hole, unless the step's own layer transients are cut from it (under checkpointing: they share it). Each
of the loss's blocks is a segment of its own, the request rounded up to 2 MiB (``get_allocation_size``); the
floor counts the segments, not the requests.

The replay of the traced default stream shows it in every FSDP row of the grid but the 1B-parameter ones
(bench/distributed/grid.jsonl; ``python bench/distributed/run_grid.py --causes ID``): step 2 makes a 126 MiB
``_log_softmax_backward_data`` (or ``_log_softmax``) segment with the workspace in step 1's. analytic/reserve/
models the same mechanism for a single GPU only with adapters and a run with dynamic padding
(``workspace_lost``); under FSDP it applies whatever is trained, because what else forward frees differs:

- FSDP2 with ``reshard_after_forward`` (FULL_SHARD, HYBRID_SHARD): each layer's unsharded parameters are freed
  after its forward (fsdp/_fully_shard/_fsdp_param_group.py ``post_forward`` → ``reshard``; _fsdp_param.py
  ``free_unsharded_param``: ``free_storage`` of one ``all_gather_outputs`` tensor per parameter, allocated by
  ``init_all_gather_outputs``/``alloc_all_gather_outputs`` on the default stream in the copy-out). The last
  layer's are free at lm_head's backward: a rival when the largest, u·(its elements), holds the workspace
  (Llama-3.2-1B: the 2048 × 8192 MLP matrices in bf16, exactly 32 MiB; the trace puts the workspace there and
  makes no logits segment again). The root's (embeddings, lm_head) are gathered again before the loss's backward
  (``pre_backward``) and are live then; SHARD_GRAD_OP keeps every layer's until its backward.
- FSDP1 unshards into its unshard stream's pool (distributed/stream_pools.py): the default stream sees only the
  rivals of one GPU.
- Either: the rivals analytic/reserve/ lists for one GPU (``workspace_rivals_per_token``: the fp32 norm
  intermediates, PEFT's fp32 input casts, a checkpointed layer's MLP intermediates) and eager's scores.

Not modelled: FSDP1's lazy initialisation (_flat_param.py ``init_flat_param_attributes``) allocates and frees each
unit's padded unsharded buffer (``_full_param_padded``, u·E, and with fp32 parameters under a mixed-precision
policy ``_full_prec_full_param_padded``, 4·E) on the default stream; the root's segments stay cached. On
Llama-3.2-1B (tied, u·E_root = 501 MiB) forward's c·V·T logits are cut from that segment and its remainder takes
the workspace, so no logits segment is made again there; with the mid model of the grid the saved activations
and forward's workspace fill it first. The estimate counts the logits segment in both: +3.1% on the default pool
of the 1B FSDP1 row.

Legend: V vocabulary, T tokens per micro-batch, c compute-dtype bytes, u bytes per all-gathered element
(distributed/core.py), S the rank's optimizer states (sharded), W the backward thread's cuBLAS workspace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from vramledger.allocator.conf import K_SMALL_SIZE, allocation_size
from vramledger.analytic.distributed.core import fsdp_gathered_bytes
from vramledger.analytic.params import layer_linears
from vramledger.analytic.parts import StepParts
from vramledger.analytic.reserve import (
    ShapePeaks,
    cublas_workspace_block,
    logits_blocks,
    small_pool_excess,
    stranded_bytes,
)
from vramledger.analytic.reserve.forward_cache import adapter_forward_cache, checkpointed_forward_cache
from vramledger.analytic.reserve.freeze import frozen_head, frozen_head_blocks
from vramledger.analytic.reserve.full import remade_blocks
from vramledger.analytic.reserve.workspace import workspace_rivals_per_token
from vramledger.specs import Loss, ModelSpec, Sharding, TrainSpec

SOURCE = (
    "FSDP: step 1's backward cuBLAS workspace (CublasHandlePool.cpp, never freed) is cut from a freed fp32 logits "
    "block (best fit: no other free block holds it), so step 2 makes one more 4·V·T segment; the default stream's "
    "reserve is at least the loss's peak + the c·V·T hole's segment less the states in it + the larger of the "
    "workspace block's remainder in its segment and one layer's transients (with FSDP2 and adapters: the "
    "remainder + LoRA's layers' cache) "
    "(analytic/distributed/fsdp_workspace.py)"
)


def workspace_in_logits(m: ModelSpec, train: TrainSpec, p: StepParts) -> bool:
    """Whether step 1's backward-thread workspace lands in an fp32 logits block (module docstring): the standard
    loss with a compute dtype below fp32, trained layers, and no rival free block that holds the workspace."""
    band = _band(m, train, p)
    return band is not None and band.on(train.micro_batch, train.seq_len)


class _Band(NamedTuple):
    """Where the mechanism is on, at micro-batch b and length ℓ (the rest of the step as it is)."""

    no_rival: Callable[[int, int], bool]
    """No other free block holds the workspace: false from some ℓ on (the rivals grow with the tokens)."""
    fp32: Callable[[int, int], bool]
    """The fp32 logits block holds it: true from some ℓ on."""

    def on(self, b: int, ell: int) -> bool:
        return self.no_rival(b, ell) and self.fp32(b, ell)


def _band(m: ModelSpec, train: TrainSpec, p: StepParts) -> _Band | None:
    """The shapes where the workspace lands in an fp32 logits block (None: none). The rivals scale with the tokens
    (b·ℓ; eager's scores with b·ℓ², DoRA's weight norm not at all), as in analytic/reserve/runs.py ``switches_on``."""
    c = train.precision.compute.bytes
    if train.fsdp is None or train.loss is not Loss.STANDARD or c == 4 or not p.weights.trainable_layers:
        return None
    ws = cublas_workspace_block(p)
    if train.fsdp_version == 2 and train.fsdp in (Sharding.FULL_SHARD, Sharding.HYBRID_SHARD):
        u = fsdp_gathered_bytes(train, p.weights)
        if u * max((lin.in_features * lin.out_features for lin in layer_linears(m)), default=0) >= ws:
            return None  # a freed unsharded parameter holds it, whatever the shape
    per_token = max(workspace_rivals_per_token(m, train, p))
    scores, B, L = p.forward_layer_temp - p.dora_temp, train.micro_batch, train.seq_len

    def no_rival(b: int, ell: int) -> bool:
        return max(per_token * b * ell, p.dora_temp + scores * b * ell * ell // (B * L * L)) < ws

    def fp32(b: int, ell: int) -> bool:
        # a free block larger than 4·V·T loses to the logits block; one of its size wins the tie (an older segment)
        return 4 * m.vocab_size * b * ell > ws

    return _Band(no_rival, fp32)


def held_floor(
    m: ModelSpec, train: TrainSpec, p: StepParts, loss_peak: int, ranks: int, at: ShapePeaks | None, side: int
) -> int:
    """The default pool's floor of a run (``default_pool_floor``), as analytic/reserve/ treats a mechanism that
    switches off as the shape grows (``peak_reserved``, ``held_reserved``): a packed run meets one shape and gets
    the floor where the band is on there; a run with dynamic padding meets every shape up to (B, L) and keeps the
    segments each made, so it gets the largest floor
    over the shapes where the mechanism is on (it grows with the shape inside that band, so the band's upper edge is
    enough). ``at``: the step at another shape (None: this shape only); ``side``: the side pools' bytes live at
    the loss's peak, the same at every shape (shards and unsharded units), taken off ``at``'s allocated bytes."""
    band = _band(m, train, p)
    if band is None:
        return 0
    B, L = train.micro_batch, train.seq_len
    if train.packing and not band.on(B, L):
        return 0
    if band.on(B, L) or at is None:
        return default_pool_floor(m, train, p, loss_peak, ranks)
    best = 0
    for b, ell in _upper_edge(B, L, band):
        t = train.at_shape(b, ell)
        pt, loss, _, _ = at(t)
        best = max(best, default_pool_floor(m, t, pt, loss - side, ranks))
    return best


def _upper_edge(B: int, L: int, band: _Band) -> list[tuple[int, int]]:
    """For each b ≤ B, the longest ℓ ≤ L without a rival, where the fp32 block holds the workspace there too; a
    point is kept only where b + 1's is shorter (else that one, larger, dominates)."""
    points = []
    for b in range(1, B + 1):
        lo, hi = 0, L
        while lo < hi:  # the largest ℓ with no rival
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if band.no_rival(b, mid) else (lo, mid - 1)
        if lo and band.fp32(b, lo):
            points.append((b, lo))
    return [pt for pt, nxt in zip(points, [*points[1:], (0, 0)], strict=False) if nxt[1] < pt[1]]


def default_pool_floor(m: ModelSpec, train: TrainSpec, p: StepParts, loss_peak: int, ranks: int) -> int:
    """Reserved bytes of the default stream's pool at step 2's loss peak where ``workspace_in_logits`` (else 0).

    ``loss_peak``: the default stream's allocated bytes there; ``ranks``: N, the ranks a parameter is sharded over. On
    top of ``loss_peak``, cached and free: the c·V·T logits hole's segment less the optimizer states step 1 put in it
    (the first block they fill: analytic/reserve/shape.py ``single_shape``), and the larger of the workspace block's
    remainder (its segment less W) and one layer's transients (``stranded_bytes`` beyond the hole), which best fit cuts
    from that remainder (with FSDP2 and adapters the remainder and LoRA's layers' cache: ``_beside_hole``); plus the
    small pool's cached bytes (``small_pool_excess``). ``train``: the engine's dtypes (distributed/core.py
    ``engine_dtypes``), as for analytic/reserve/.
    """
    if not workspace_in_logits(m, train, p):
        return 0
    chain = logits_blocks(m, train)
    hole = chain[0] if len(chain) == 4 else 0  # the c·V·T logits block (c < 4)
    fp32 = 4 * m.vocab_size * train.tokens
    # Each of the loss's blocks is a segment of its own, of the request rounded up to kRoundLarge (2 MiB) above
    # kMinLargeAlloc (CUDACachingAllocator.cpp ``get_allocation_size``): the hole is the whole segment once its block
    # is freed, and the workspace's remainder is the segment's rest. The three fp32 blocks live at the log-softmax
    # backward keep their rounding too, but it is left out: ``loss_peak`` is the larger of forward's and backward's
    # peaks, which holds those blocks only where the log-softmax backward is the peak (FSDP1's end of backward is
    # at short lengths), and added to any other moment the rounding falls as the blocks grow into their segments
    # (mid FSDP1 full 1 × 263 → 264: −375 KB), which a run with dynamic padding never does.
    hole_segment = allocation_size(hole) if hole else 0
    states_in_hole = min(_large_pool_states(m, train, p, ranks), hole_segment)
    transients = stranded_bytes(m, train, p) - hole
    remainder = allocation_size(fp32) - cublas_workspace_block(p)
    in_chain = hole_segment - states_in_hole + _beside_hole(m, train, p, transients, remainder)
    return loss_peak + max(in_chain, _frozen_head_chain(m, train, p, ranks)) + small_pool_excess(train, p)


def _frozen_head_chain(m: ModelSpec, train: TrainSpec, p: StepParts, ranks: int) -> int:
    """The free bytes at step 2's loss peak in step 1's logits chain where the head is frozen (0 otherwise): the c·V·T
    hole's segment and the segments of the k blocks step 2 makes again (analytic/reserve/freeze.py
    ``frozen_head_blocks``: the blocks step 1 leaves a tenant in, the workspace's and those the states reach past
    the hole), less their tenants, the workspace and the rank's large-pool states (``_large_pool_states``; the
    small-pool ones sit in 2 MiB segments). ``default_pool_floor`` counts one block made again (the workspace's
    remainder) beside the hole less its states; with a frozen head and unsharded states the states reach a second
    fp32 block, whose rest is free too. The replay of FSDP1 NO_SHARD freeze at 2 ranks (``python
    bench/distributed/run_grid.py --free``; states unsharded: S = 172 MiB over two trained layers): step 1's
    log-softmax segment holds one 4 MiB activation at step 2's peak (122 MiB free), the upcast's the workspace, 11 MiB
    states and step 2's activations (10 free), and step 2 makes the loss's fp32 blocks again, as the single-GPU
    count has it (two blocks). Sharded (FSDP1/FSDP2 FULL_SHARD at 2 and 8 ranks) the states fit the hole and k is 1:
    the floor's own terms are at least as large."""
    if not frozen_head(train, p):
        return 0
    k = frozen_head_blocks(m, train, p)
    hole, blocks = remade_blocks(m, train)
    segments = allocation_size(hole) + sum(allocation_size(b) for b in blocks[:k])
    tenants = _large_pool_states(m, train, p, ranks) + cublas_workspace_block(p)
    return max(segments - tenants, 0)


def _beside_hole(m: ModelSpec, train: TrainSpec, p: StepParts, transients: int, remainder: int) -> int:
    """The free bytes at step 2's loss peak besides the c·V·T hole: the workspace block's remainder, and the layers'.

    Without a model of the layers' cache, the larger of the remainder and one layer's transients (under checkpointing
    best fit cuts a recomputed layer from the remainder). With FSDP2 and adapters, LoRA's forward cache
    (analytic/reserve/forward_cache.py) as analytic/reserve/shape.py ``single_shape`` counts it on one GPU: without
    checkpointing the blocks forward leaves free in the layers' segments (``adapter_forward_cache``), under it what
    step 1's checkpointed forward made, in place of one layer's transients (``checkpointed_forward_cache``, as
    ``_adapter_stranded``): both made before the loss, in segments of their own, so that none of them is the
    remainder's (the replay, ``python bench/distributed/run_grid.py --causes``: the mid model's LoRA at 8 ranks,
    126 MiB for the workspace's fp32 block, 94 MiB free in it, 64 MiB for the hole, and 56 MiB free in 20 MiB
    segments step 1's forward made; under checkpointing 60 MiB in four of them, the replayed layers 31 MiB). FSDP1:
    its lazy initialisation leaves the root's unsharded buffer cached on the default stream and the layers'
    transients are cut from it (module docstring, "Not modelled"): the larger of the two, as before."""
    if train.fsdp_version != 2 or not train.adapters:
        return max(transients, remainder)
    if not train.grad_ckpt:
        return max(transients, remainder) + adapter_forward_cache(m, train, p)
    layers = checkpointed_forward_cache(m, train, p, gathered_per_layer=True)
    return max(transients, remainder) if layers is None else remainder + layers


def _large_pool_states(m: ModelSpec, train: TrainSpec, p: StepParts, ranks: int) -> int:
    """The rank's optimizer states that are large-pool tensors, the only ones a large block can hold (requests of
    ≤ kSmallSize = 1 MiB are served from 2 MiB small-pool segments: CUDACachingAllocator.cpp ``get_pool``). AdamW
    makes each state like its parameter (torch/optim/adamw.py ``_init_group``: ``zeros_like``), i.e. like the
    rank's shard of it: FSDP2 shards each parameter on dim 0 (_fsdp_param.py ``_init_sharded_param``:
    ⌈rows/N⌉ rows); FSDP1 with ``use_orig_params=True`` gives the optimizer each parameter's part of the rank's flat
    shard, counted the same on average. Adapters' states are small (the small pool)."""
    wb = p.weights
    if train.adapters or not p.state_bytes:
        return 0
    b = wb.trainable_dtype.bytes
    per_param = round(p.state_bytes / max(p.grad_bytes, 1))
    rows = [(lin.out_features, lin.in_features) for lin in layer_linears(m) for _ in range(lin.per_layer)]
    shapes = rows * wb.trainable_layers
    if wb.embedding_trainable:
        shapes.append((m.vocab_size, m.hidden_size))
    if wb.head_trainable and not m.tie_word_embeddings:
        shapes.append((m.vocab_size, m.hidden_size))
    shards = (-(-rows_ // ranks) * cols * b for rows_, cols in shapes)
    return per_param * sum(x for x in shards if x > K_SMALL_SIZE)
