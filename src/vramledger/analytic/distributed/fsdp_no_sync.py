"""FSDP1 under gradient accumulation: ``no_sync`` keeps every unit's gradient unsharded on every rank.

Legend: N ranks sharing a shard; u bytes per element of the unsharded parameters (what autograd writes the
unsharded gradient in: distributed/core.py's ``u``); L decoder layers whose unit trains; E_layer elements of one
decoder layer's unit (its adapters included), E_root of the root unit (embeddings, final norm, output layer).

On an accumulating micro-step the training loop runs forward and backward inside ``FullyShardedDataParallel.no_sync``
(Lightning Fabric's ``no_backward_sync``, which LitGPT's ``finetune/*.py`` call on every micro-step but the last;
accelerate's ``Accelerator.accumulate``, which the HF Trainer uses, unless ``GradientAccumulationPlugin(
sync_each_batch=True)``). FSDP1 then skips the reduce-scatter and keeps the unit's whole unsharded gradient in
``flat_param.grad``; the next micro-steps accumulate into it, and only the synchronising micro-step's backward turns
it into the shard (then freed by ``zero_grad``). From the second step on, every forward and backward of an
accumulation window therefore runs beside the unsharded gradient of every unit that requires grad:

    kept = u · (L · E_layer + E_root if the root trains)   units flattened with their frozen weights
    kept = u · P_trainable                                 otherwise (each trainable tensor in its own unit)

where the rank's sharded gradient (``grads``, ≈ kept / N) would otherwise be; the optimizer step sees the shard.

Sources (PyTorch 2.1.0, the version LitGPT's resource tables name; the same code through 2.13, whose FSDP1 the test
runs on a fake process group):
- torch/distributed/fsdp/fully_sharded_data_parallel.py ``no_sync`` (l. 1016-1052): sets ``_sync_gradients = False``
  on every FSDP instance; its docstring: "FSDP will accumulate the full model gradients (instead of gradient
  shards) until the eventual sync".
- _runtime_utils.py ``_post_backward_hook`` (l. 761-765): ``if not state._sync_gradients: ... return`` before the
  reduce-scatter; flat_param.py ``prepare_gradient_for_backward`` (l. 1477-1480) keeps a ``.grad`` of the unsharded
  size for autograd to accumulate into.
- flat_param.py ``_validate_tensors_to_flatten`` (l. 741, ``use_orig_params=True``): a flat parameter requires grad
  when any tensor in it does, so a LoRA layer's unit keeps the gradient of its frozen base weights too.
  FSDP1 says so itself when it wraps such a unit (_wrap_utils.py ``_validate_frozen_params``, l. 156-165: "the
  gradient memory usage will be higher than expected (... numel instead of ... numel before sharding via
  reduce-scatter)").
- Callers: Lightning 2.1.0.rc0 src/lightning/fabric/strategies/fsdp.py l. 768 (``with module.no_sync():``), and the
  same ``module.no_sync()`` in 2.3.0.dev20240328 (l. 785); LitGPT 8641822 finetune/lora.py l. 215 and 43c44323
  litgpt/finetune/full.py l. 228 (``with fabric.no_backward_sync(model, enabled=is_accumulating)``).

The root unit's new gradient at the end of backward. With ``use_orig_params=True`` the module's parameters are
views of the unsharded flat parameter (flat_param.py ``_use_unsharded_views``: ``torch.split`` then ``view``), so
autograd holds each view's gradient until the last one, the embedding's, is computed, then concatenates them
(``SplitWithSizesBackward0`` → ``cat``, a new tensor of the unit's size) and adds that into the kept ``.grad``:
2·u·E_root live at once beside the kept gradients (the output layer's and the embedding's pieces, and the
concatenation). analytic/step.py already counts the embedding's piece on an accumulating step ("embedding gradient
before accumulation"), so the buffer here is the rest. Seen on PyTorch's FSDP1 with a root of 2·V·H elements:
the memory profiler's autograd temporaries at the peak of a ``no_sync`` micro-step are 2·u·E_root
(tests/analytic/test_fsdp_no_sync.py).

FSDP2 under gradient accumulation: ``FSDPModule.set_requires_gradient_sync(False)``, FSDP2's ``no_sync``, is what
accelerate's ``Accelerator.no_sync`` calls for FSDP2 (accelerate 16cb6eb ``accelerator.py`` l. 1165-1170, inside
``accumulate`` on every micro-step but the synchronising one) and what the HF Trainer's loop enters for every
micro-batch but the last (transformers 5.23 ``trainer.py`` l. 1896-1908; its ``_defer_fsdp_gradient_reduction``
does the same for a model sharded at load time). In torch 2.13 it sets ``reduce_grads = False`` on every parameter
group (fsdp/_fully_shard/_fully_shard.py l. 413-435), and ``FSDPParamGroup.post_backward`` then reshards the
parameters and returns before ``foreach_reduce`` (_fsdp_param_group.py: ``if not self.reduce_grads: ... return``):
the unsharded parameter's ``.grad`` outlives its resharded data, and the next micro-steps' autograd accumulates into
it (or, when the policy's ``reduce_dtype`` differs from the parameter dtype, into ``unsharded_accumulated_grad``, a
copy in the reduce dtype: ``_fsdp_param.py`` ``to_accumulated_grad_if_needed`` / ``accumulate_unsharded_grad_if_
needed``). FSDP2 keeps one gradient per parameter, and frozen parameters have none, so, unlike FSDP1's flat units,

    kept = g · P_trainable     g: bytes of the reduce dtype (the compute dtype under a mixed-precision policy)

from the first accumulating micro-step's backward until the synchronising micro-step reduce-scatters each unit's
gradients (which frees them) - no whole units, no root concatenation. Checked on PyTorch's FSDP2 itself on a fake
process group (tests/analytic/test_fsdp_no_sync.py).

The same split-and-concatenate transient of an FSDP1 decoder layer's unit (2·u·E_layer inside that layer's backward,
beside the next unit prefetched) is a moment of its own: analytic/distributed/fsdp1_layer_grad.py.
"""

from __future__ import annotations

from vramledger.analytic.distributed.rank import FWD_BWD, Buffer
from vramledger.analytic.weights import WeightBudget
from vramledger.ledger import Category, Phase
from vramledger.specs import TrainSpec

SOURCE = (
    "torch fsdp FullyShardedDataParallel.no_sync (Fabric no_backward_sync, accelerate accumulate) and "
    "_runtime_utils.py _post_backward_hook: no reduce-scatter, flat_param.grad stays the unit's unsharded gradient "
    "until the synchronising micro-step"
)
ROOT_SOURCE = (
    "torch fsdp flat_param.py _use_unsharded_views (parameters as split views of the flat parameter): "
    "SplitWithSizesBackward0 holds every view's gradient until the embedding's, then cat into one unit-sized "
    "gradient that AccumulateGrad adds into the kept one"
)
FSDP2_SOURCE = (
    "torch fsdp/_fully_shard FSDPModule.set_requires_gradient_sync(False) (accelerate's no_sync for FSDP2, the HF "
    "Trainer's accumulating micro-steps): FSDPParamGroup.post_backward returns before foreach_reduce, each trainable "
    "parameter keeps its unsharded gradient until the synchronising micro-step"
)
FSDP2_NOTE = (
    "FSDP2 with gradient accumulation: accelerate and the HF Trainer call set_requires_gradient_sync(False) on the "
    "accumulating micro-steps, so every rank keeps the unsharded gradients of the trainable parameters between "
    "optimizer steps; GradientAccumulationPlugin(sync_each_batch=True) avoids it at the cost of a reduce-scatter per "
    "micro-step"
)
NOTE = (
    "FSDP1 with gradient accumulation: the micro-steps run inside no_sync (Fabric's no_backward_sync, accelerate's "
    "accumulate), so every rank keeps the unsharded gradients of every trainable unit between optimizer steps; "
    "accelerate's GradientAccumulationPlugin(sync_each_batch=True) avoids it at the cost of a reduce-scatter per "
    "micro-step"
)


def kept_gradient_elements(
    train: TrainSpec, wb: WeightBudget, *, layer_elements: int, root_elements: int, whole_units: bool
) -> int:
    """Elements of the unsharded gradients a rank keeps through an accumulation window (module docstring).

    ``whole_units``: trainable and frozen tensors share each unit (FSDP1 ``use_orig_params=True`` with adapters in
    the base dtype), so each trainable unit's gradient has the whole unit's size.
    """
    if not whole_units:
        return wb.trainable_params
    per_layer_trainable = sum(a.params for a in wb.adapted) if train.adapters else layer_elements
    in_layers = wb.trainable_layers * per_layer_trainable
    root = root_elements + (wb.trainable_params - in_layers) if root_trains(train, wb) else 0
    return wb.trainable_layers * layer_elements + root


def root_trains(train: TrainSpec, wb: WeightBudget) -> bool:
    """Whether the root unit's flat parameter requires grad: a trainable embedding or output layer, or an adapter
    on the output layer flattened with it."""
    return wb.embedding_trainable or wb.head_trainable or (train.lora is not None and train.lora.head)


def no_sync_buffers(
    train: TrainSpec,
    wb: WeightBudget,
    *,
    u: int,
    sharded_grad_bytes: int,
    layer_elements: int,
    root_elements: int,
    whole_units: bool,
) -> tuple[Buffer, ...]:
    """The unsharded gradients beyond the rank's sharded gradient, live in forward and backward, and the root
    unit's new gradient at the end of backward (module docstring); none when the run does not accumulate under
    FSDP1.

    >>> from vramledger.specs import Method, Precision, Sharding, TrainSpec
    >>> TrainSpec(method=Method.FULL, precision=Precision.BF16, world_size=2,
    ...           fsdp=Sharding.FULL_SHARD, fsdp_version=1, grad_accum=1).keeps_unsharded_grads
    False
    """
    if not train.keeps_unsharded_grads:
        return ()
    kept = u * kept_gradient_elements(
        train, wb, layer_elements=layer_elements, root_elements=root_elements, whole_units=whole_units
    )
    out = []
    if kept > sharded_grad_bytes:
        out.append(
            Buffer(
                label="unsharded gradients kept across accumulation micro-steps (FSDP1 no_sync), beyond the shard",
                category=Category.GRADIENTS,
                bytes=kept - sharded_grad_bytes,
                phases=FWD_BWD,
                source=SOURCE,
            )
        )
    if root_trains(train, wb):
        # step.py's "embedding gradient before accumulation" is the embedding's piece (accumulating, trainable)
        counted = wb.lm_head_weight_numel * wb.trainable_dtype.bytes if wb.embedding_trainable else 0
        out.append(
            Buffer(
                label="root unit's new gradient: the output layer's piece and the concatenation (FSDP1 flat views)",
                category=Category.TEMPORARIES,
                bytes=max(0, 2 * u * root_elements - counted),
                phases=frozenset((Phase.BACKWARD,)),
                source=ROOT_SOURCE,
                at_end_of_backward=True,
            )
        )
    return tuple(out)


def skips_gradient_sync(train: TrainSpec) -> bool:
    """FSDP2 sharding under gradient accumulation: the accumulating micro-steps run with
    ``set_requires_gradient_sync(False)`` (module docstring)."""
    return (
        train.fsdp is not None
        and train.fsdp.shards_params
        and train.fsdp_version == 2
        and train.grad_accum > 1
        and train.world_size > 1
    )


def fsdp2_kept_buffers(train: TrainSpec, wb: WeightBudget, *, sharded_grad_bytes: int) -> tuple[Buffer, ...]:
    """FSDP2 under accumulation: the trainable parameters' unsharded gradients beyond the rank's sharded gradient,
    live in forward and backward (module docstring); none without accumulation or under FSDP1.

    >>> from vramledger.specs import Method, Precision, Sharding, TrainSpec
    >>> skips_gradient_sync(TrainSpec(method=Method.FULL, precision=Precision.BF16, world_size=2,
    ...     fsdp=Sharding.FULL_SHARD, fsdp_version=2, grad_accum=4))
    True
    """
    if not skips_gradient_sync(train):
        return ()
    g = train.precision.compute.bytes if train.precision.mixed else wb.trainable_dtype.bytes
    kept = g * wb.trainable_params
    if kept <= sharded_grad_bytes:
        return ()
    return (
        Buffer(
            label="unsharded gradients kept across accumulation micro-steps (FSDP2 without gradient sync), beyond "
            "the shard",
            category=Category.GRADIENTS,
            bytes=kept - sharded_grad_bytes,
            phases=FWD_BWD,
            source=FSDP2_SOURCE,
        ),
    )
