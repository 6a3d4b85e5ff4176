"""FSDP1's end of backward with a trained root unit: its gradients are flattened before they are reduce-scattered.

Legend: N ranks sharing a shard; u bytes per element of the unsharded parameters (distributed/core.py ``u``,
what autograd writes their gradients in); E_root elements of the root unit (embeddings, final norm, output layer),
R the same padded to a multiple of N (the flat parameter's unsharded size); E_head the output layer's weight; g
bytes per element of the sharded gradient (the parameter dtype: fp32 under a mixed-precision policy).

With ``use_orig_params=True`` (accelerate's and torchtune's FSDP1 default, and the trace's) the module's parameters
are views of the unit's unsharded flat parameter: torch/distributed/fsdp/_flat_param.py ``_use_unsharded_views``
sets each to ``_get_unflat_views_aligned`` → ``torch.split(flat_param, _numels_with_padding)`` then ``view``, under
``torch.enable_grad()`` so that the views carry ``SplitWithSizesBackward0``. Autograd therefore keeps each view's
gradient in that node's input buffer until the last of them arrives, and then runs ``split_with_sizes_backward``
(tools/autograd/derivatives.yaml ``split_with_sizes``; torch/csrc/autograd/FunctionsManual.cpp: undefined
gradients become zeros, then ``at::cat``), a new tensor of the flat parameter's size that AccumulateGrad makes
``flat_param.grad``. Only then does ``_post_backward_hook`` (_runtime_utils.py) run ``_post_backward_reshard`` and
``_reduce_grad``, whose reduce-scatter output (cast to the parameter dtype, ``_cast_grad_to_param_dtype``) is the
unit's gradient shard. For the root unit the output layer's gradient is made in the loss's backward and the
embedding's last of all, so at the end of backward rank 0 holds, beside every other unit's shard:

    flattened:  u·E_root (the pieces) + u·R (the concatenation)             untied output layer
    tied:       3·u·E_head at the sum (lm_head's piece, the embedding's, their out-of-place sum: analytic/parts.py
                ``TIED_SUM``), then u·E_head + u·R at the concatenation

and not yet the root's own shard (g·R/N). Traced (trace/distributed.py, torch 2.13): Llama-3.1-8B full fine-tune,
FSDP1 FULL_SHARD on 8 ranks, checkpointing, 1,024 tokens peaks at that ``cat`` (20.40 GiB: 1002 + 1002 MiB of
pieces, 2004 MiB concatenated, the layers' shards, the root still unsharded); Llama-3.2-1B (tied) at the sum
(bench/distributed/grid.jsonl). A decoder layer's unit goes through the same split and concatenation inside its own
backward (2·u·E_layer), below the activations it frees: not modelled. Under ``no_sync`` (gradient accumulation)
distributed/fsdp_no_sync.py models the root's pieces instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramledger.analytic.distributed.fsdp_no_sync import root_trains
from vramledger.analytic.distributed.rank import END_OF_BACKWARD, share
from vramledger.analytic.params import embedding_params, head_params
from vramledger.analytic.weights import WeightBudget
from vramledger.ledger import Category
from vramledger.specs import ModelSpec, Sharding, TrainSpec

SOURCE = (
    "torch fsdp/_flat_param.py _use_unsharded_views (use_orig_params: parameters are torch.split views of the flat "
    "parameter): split_with_sizes_backward holds every view's gradient until the embedding's, then cats them into "
    "the unit's flat gradient; _runtime_utils.py _post_backward_hook reduce-scatters it only after"
)
TIED_SOURCE = (
    "torch/csrc/autograd/input_buffer.cpp accumulate: the tied view's two gradients (lm_head's, the embedding's) "
    "are summed out of place before split_with_sizes_backward's cat (analytic/parts.py TIED_SUM)"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class FlattenLine:
    """One line of a flattening moment."""

    category: Category
    label: str
    bytes: int
    source: str


@dataclass(frozen=True, kw_only=True, slots=True)
class FlattenMoment:
    """One instant at the end of an FSDP1 backward, before the root's reduce-scatter."""

    name: str
    pending_shard: int
    """Bytes of rank 0's sharded gradient not allocated yet: the root unit's shard (g·R/N)."""
    lines: tuple[FlattenLine, ...]


def flattens_root(train: TrainSpec, wb: WeightBudget) -> bool:
    """Whether the end of backward is FSDP1 flattening a trained root unit and then reduce-scattering it: a sharding
    strategy, gradients synchronised on every backward (under ``no_sync`` distributed/fsdp_no_sync.py holds it)."""
    return (
        train.fsdp is not None
        and train.fsdp is not Sharding.NO_SHARD
        and train.fsdp_version == 1
        and train.world_size > 1
        and not train.keeps_unsharded_grads
        and root_trains(train, wb)
    )


def root_flatten_moments(
    m: ModelSpec, train: TrainSpec, wb: WeightBudget, *, u: int, ranks: int
) -> tuple[FlattenMoment, ...]:
    """The end-of-backward moments of FSDP1's root unit (module docstring); none when ``flattens_root`` is false."""
    if not flattens_root(train, wb):
        return ()
    root = embedding_params(m) + head_params(m)
    padded = share(root, ranks) * ranks  # _flat_param.py _get_shard pads the flat parameter to a multiple of N
    pending = share(root, ranks) * wb.trainable_dtype.bytes
    flat = FlattenLine(
        category=Category.GRADIENTS,
        label="root unit's flat gradient (the concatenation of its pieces)",
        bytes=u * padded,
        source=SOURCE,
    )
    name = f"{END_OF_BACKWARD}: FSDP1 flattens the root unit's gradients (split_with_sizes_backward's cat)"
    if not m.tie_word_embeddings:
        pieces = FlattenLine(
            category=Category.TEMPORARIES,
            label="root unit's per-parameter gradients (output layer, final norm, embeddings)",
            bytes=u * root,
            source=SOURCE,
        )
        return (FlattenMoment(name=name, pending_shard=pending, lines=(pieces, flat)),)
    head = u * wb.lm_head_weight_numel
    summed = FlattenMoment(
        name=f"{END_OF_BACKWARD}: FSDP1 sums the tied weight's two gradients before flattening the root unit",
        pending_shard=pending,
        lines=(
            FlattenLine(
                category=Category.TEMPORARIES,
                label="tied weight's gradients: lm_head's, the embedding's and their sum",
                bytes=3 * head,
                source=TIED_SOURCE,
            ),
        ),
    )
    rest = FlattenLine(
        category=Category.TEMPORARIES,
        label="root unit's per-parameter gradients (the tied weight's sum, final norm)",
        bytes=u * (root - wb.lm_head_weight_numel) + head,
        source=SOURCE,
    )
    return summed, FlattenMoment(name=name, pending_shard=pending, lines=(rest, flat))


PRE_FORWARD_NAME = "before forward: FSDP1 still holds the previous step's flat gradients (freed in its pre-forward)"
PRE_FORWARD_SOURCE = (
    "torch fsdp/_flat_param.py _reset_flat_param_grad_info_if_needed: with use_orig_params, zero_grad(set_to_none) "
    "clears the parameters' .grad views, and flat_param.grad is set to None only in the root's pre-forward "
    "(_runtime_utils.py _root_pre_forward), after the batch is on the GPU"
)


def holds_grads_into_forward(train: TrainSpec) -> bool:
    """Whether the next step begins with the previous step's gradients still allocated: FSDP1 with
    ``use_orig_params=True`` frees ``flat_param.grad`` only in the root's pre-forward (``PRE_FORWARD_SOURCE``), so the
    batch is moved to the GPU beside weights, gradients and states (traced: the Llama-3.1-8B FSDP1 row's forward peak
    is a ``clone`` of the inputs in step 2). Under ``no_sync`` distributed/fsdp_no_sync.py holds the gradients
    instead."""
    return (
        train.fsdp is not None
        and train.fsdp_version == 1
        and train.world_size > 1
        and not train.keeps_unsharded_grads
        and train.grad_accum <= 1
    )


POOL_SOURCE = (
    "caching allocator (CUDACachingAllocator.cpp get_free_block: best fit, a block never spans two segments): step "
    "1's optimizer creates its states (and foreach temporaries) after backward has freed the root's flattening "
    "blocks, and best fit packs them there; from step 2 on each of those blocks, larger than anything the optimizer "
    "allocates, needs a segment of its own again (analytic/distributed/fsdp_root_flatten.py)"
)


def flatten_blocks(m: ModelSpec, train: TrainSpec, wb: WeightBudget, *, u: int, ranks: int) -> tuple[int, ...]:
    """The blocks the root's flattening allocates at its peak (module docstring): the output layer's and the
    embedding's gradient and the concatenation, or, tied, the two gradients and their sum."""
    if not flattens_root(train, wb):
        return ()
    head = u * wb.lm_head_weight_numel
    if m.tie_word_embeddings:
        return (head, head, head)
    root = embedding_params(m) + head_params(m)
    return (u * embedding_params(m), head, u * share(root, ranks) * ranks)


def flatten_pool_floor(
    blocks: tuple[int, ...], *, optimizer_default: int, loss_blocks: int, largest_cached_block: int, packed: bool
) -> int:
    """The default pool's floor from step 2 on: step 1's optimizer peak on the default stream, which it reaches
    inside the segments backward freed (``packed``: its states and temporaries need at least what was cached free),
    so that step 2 makes the loss's blocks again (``loss_blocks``, analytic/reserve/full.py's own mechanism) and each
    flattening block larger than every block cached by then (the optimizer's, the loss's), POOL_SOURCE. Traced:
    Llama-3.1-8B FSDP1 on 8 ranks (bench/distributed/grid.jsonl): step 2 makes 502 + 502 MiB for the loss's fp32
    blocks and 2,006 + 1,002 + 1,002 MiB for the cat and the two pieces; the replay's default pool is 20,580 MiB
    over a 15,562 MiB peak."""
    if not blocks or not packed:
        return 0
    return optimizer_default + loss_blocks + sum(b for b in blocks if b > largest_cached_block)
