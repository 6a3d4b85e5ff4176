"""FSDP1: the instant a decoder layer's unit gradient is made, inside that layer's backward.

Legend: u bytes per element of the unsharded parameters and of the gradients autograd writes for them
(analytic/distributed/core.py ``fsdp_gathered_bytes``); E_layer elements of one decoder layer's unit, its adapters
included (``fsdp_layer_elements``).

With ``use_orig_params=True`` (Lightning Fabric's default for torch ≥ 2.0, accelerate's, torchtune's) a unit's
parameters are views of its unsharded flat parameter (torch fsdp ``_use_unsharded_views`` and ``_get_unflat_views_*``:
``torch.split`` of the flat parameter then ``view``; 2.1.0 flat_param.py l. 1729-1785, 2.13 _flat_param.py
l. 1894-1901). When the flat parameter requires grad (a full fine-tune, or adapters flattened with their layer's frozen
weights: analytic/distributed/core.py ``adapters_in_layer_units``) every view's gradient is computed, the frozen ones'
too, and autograd's ``SplitWithSizesBackward0`` holds them until the last one is ready, then concatenates them into
one new tensor of the unit's size, which ``AccumulateGrad`` adds into the unsharded ``flat_param.grad`` that
``no_sync`` keeps (or makes the gradient a synchronising micro-step reduce-scatters). While ``cat`` runs, its inputs
and its output are alive: 2·u·E_layer. FSDP1's default ``backward_prefetch=BACKWARD_PRE`` (Lightning 71aed751
``FSDPStrategy`` passes none of its own) has all-gathered the next unit by then: ``_pre_backward_hook`` unshards this
unit and calls ``_prefetch_handle(state, handle, _PrefetchMode.BACKWARD)`` before the unit's backward runs
(torch 2.1.0 _runtime_utils.py l. 696-714; 2.13 l. 673-693), and the unit is resharded only in
``_post_backward_hook`` (2.1.0 l. 761; 2.13 l. 742), registered on the flat parameter's ``AccumulateGrad`` node
(2.1.0 l. 1440-1444: ``acc_grad.register_hook``), which runs after the addition. So, beside what the step keeps (shards,
the root unsharded, the kept gradients, LitGPT's fp32 logits, the checkpointed inputs) and this unit unsharded
(analytic/distributed/core.py's one decoder layer):

    extra = u·E_layer (the next unit, prefetched) + 2·u·E_layer (the views' gradients and their concatenation)

The layer's own saved (or recomputed) activations and its MLP gradients are freed by then, each after its node's
backward; the gradient of the layer's input is alive. The top layer's instant holds the most (every checkpointed
input below it, or every lower layer's saved activations). It is the backward peak when the units are large beside
one micro-step's activations: LoRA under Block checkpointing at micro-batch 1 (bench/published/
litgpt_trace.py ``replay_fsdp``: LitGPT 8641822's step under PyTorch's FSDP1 on a fake process group,
StableLM-Alpha-3B 1 × 1034: 17 unit-sized gradients, the current and the next unit unsharded and the views' gradients
at the peak).
"""

from __future__ import annotations

from typing import NamedTuple

from vramledger.analytic.distributed.core import adapters_in_layer_units, fsdp_gathered_bytes, fsdp_layer_elements
from vramledger.analytic.weights import WeightBudget
from vramledger.ledger import Category
from vramledger.specs import Method, ModelSpec, Sharding, TrainSpec

NAME = "a decoder layer's flat gradient concatenated (FSDP1), the next unit prefetched"
PREFETCH_LABEL = "the next decoder layer unsharded (BACKWARD_PRE prefetch)"
"""Allocated on FSDP1's unshard stream (stream_pools.py counts it in the all-gather pool)."""
PREFETCH_SOURCE = (
    "torch fsdp _runtime_utils.py _pre_backward_hook: _unshard(this unit), then _prefetch_handle(BACKWARD) "
    "all-gathers the next unit (backward_prefetch=BACKWARD_PRE, the default); this unit is resharded in "
    "_post_backward_hook, after AccumulateGrad"
)
VIEWS_SOURCE = (
    "torch fsdp _flat_param.py _use_unsharded_views (use_orig_params=True): the parameters are split views of the "
    "flat parameter; SplitWithSizesBackward0 holds every view's gradient, then cat makes the unit's new gradient, "
    "which AccumulateGrad adds into flat_param.grad"
)


class Line(NamedTuple):
    category: Category
    label: str
    bytes: int
    source: str


def layer_gradient_lines(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> tuple[Line, ...]:
    """The lines this instant adds beyond the step's persistent lines, the engine's backward buffers and the
    activations (module docstring); none unless FSDP1 reshards its layer units (FULL_SHARD, HYBRID_SHARD) and their
    flat parameters require grad.

    >>> from vramledger.catalog import resolve_model
    >>> from vramledger.specs import Precision
    >>> t = TrainSpec(method=Method.FULL, precision=Precision.BF16, world_size=2, fsdp=Sharding.FULL_SHARD,
    ...               fsdp_version=1)
    >>> from vramledger.analytic.weights import weight_budget
    >>> m = resolve_model("llama-2-7b")
    >>> [line.bytes // (2 * 202_383_360) for line in layer_gradient_lines(m, t, weight_budget(m, t))]
    [1, 2]
    """
    if train.fsdp_version != 1 or train.fsdp not in (Sharding.FULL_SHARD, Sharding.HYBRID_SHARD):
        return ()
    if not wb.trainable_layers:
        return ()
    if train.adapters and not adapters_in_layer_units(train, wb):
        return ()  # each adapter in a unit of its own (PEFT's wrap policy): the layer's unit has no gradient
    if not train.adapters and train.method not in (Method.FULL, Method.FREEZE):
        return ()
    u = fsdp_gathered_bytes(train, wb)
    unit = u * fsdp_layer_elements(m, train, wb, u)
    return (
        Line(Category.WEIGHTS, PREFETCH_LABEL, unit, PREFETCH_SOURCE),
        Line(Category.TEMPORARIES, "this layer's new unsharded gradient: the views' gradients and their cat",
             2 * unit, VIEWS_SOURCE),
    )  # fmt: skip
