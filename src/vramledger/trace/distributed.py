"""Trace a data-parallel step: the real FSDP2, FSDP1 and DDP wrappers on PyTorch's fake process group, rank 0.

PyTorch's test utility ``torch.testing._internal.distributed.fake_pg`` registers a backend ``"fake"`` whose
collectives complete at once and touch no data: with it, ``fully_shard`` (on a ``cpu`` device mesh),
``FullyShardedDataParallel`` (``device_id=cpu``) and ``DistributedDataParallel`` build and run unmodified on
fake tensors, and every buffer they allocate passes through the recorder as on a GPU. Rank 0 of N is traced:
the rank with the ceiling share of every padded shard.

Three things the single-GPU recorder did not need (each gave wrong numbers without it):
1. a DTensor (FSDP2's sharded parameter, its gradient and optimizer states) is a wrapper: its memory is its local
   tensor's (``Recorder.on_output`` counts ``_local_tensor``), never its global size;
2. FSDP frees and re-allocates the unsharded parameters by resizing their storage in place
   (fsdp/_fully_shard/_fsdp_param.py ``free_storage``/``alloc_storage``, FSDP1 distributed/utils.py
   ``_free_storage``/``_alloc_storage``): ``UntypedStorage.resize_`` is patched to report a free and an allocation
   (PyTorch's own MemTracker, torch/distributed/_tools/mem_tracker.py, patches it the same way);
3. the all-gather and reduce-scatter buffers are allocated on FSDP's own CUDA streams, and the caching allocator
   never serves one stream's request from another stream's cached blocks: allocations inside
   ``foreach_all_gather`` and, after its ``foreach_reduce_scatter_copy_in``, ``foreach_reduce`` (HSDP's cast on
   the all-reduce stream; FSDP1: ``_unshard``, within it ``FlatParamHandle.pre_unshard``, and
   ``_reduce_grad``/``_reduce_grad_no_shard``, HYBRID_SHARD's cast on the all-reduce stream) carry their stream,
   and the replay keeps one pool per stream (trace/oom.py ``stream_pools``).

Simplifications: DeepSpeed is not traced (its engine needs CUDA): ZeRO runs are estimated; CPU offload is not
traced (on a CPU mesh host and device are the same memory). DDP's initial parameter broadcast is skipped
(``init_sync=False``) and its all-reduce is replaced by a hook that returns the bucket as it is (the fake backend's
all-reduce future carries no buffer); neither allocates on a GPU beyond what is traced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.ledger import Category
from vramledger.specs import ModelSpec, Sharding, TrainSpec
from vramledger.trace.recorder import Recorder

ALL_GATHER = "all_gather"
PRE_UNSHARD = "pre_unshard"
"""FSDP1's pre-unshard stream: the mixed-precision cast of a unit's shard (``_mp_shard``) and CPU offload's copy."""
REDUCE_SCATTER = "reduce_scatter"
"""FSDP2's reduce-scatter stream; FSDP1's post-backward stream."""
ALL_REDUCE = "all_reduce"
"""The all-reduce stream of HSDP (FSDP2: or an all-reduce hook; FSDP1: HYBRID_SHARD): where the sharded gradient is
cast back."""


def wrapper_settings(train: TrainSpec) -> dict[str, object]:
    """What was traced: the wrapper, the world size, and that the figures are rank 0's."""
    wrapper = "DDP" if train.fsdp is None else f"FSDP{train.fsdp_version} {train.fsdp.value}"
    return {
        "wrapper": wrapper,
        "world_size": train.world_size,
        "rank": 0,
        "process_group": "torch.testing._internal.distributed.fake_pg (backend 'fake')",
    }


def check_traceable(train: TrainSpec) -> None:
    """The data-parallel setups ``trace`` can run; one clear line for the others."""
    if train.zero_stage:
        raise VramledgerError(
            f"trace: DeepSpeed ZeRO-{train.zero_stage} is not traced (its engine needs CUDA); use `vramledger "
            "estimate`, or --fsdp full_shard to trace the PyTorch equivalent"
        )
    if train.fsdp is Sharding.SHARD_GRAD_OP and train.fsdp_version == 1:
        # FlatParamHandle._writeback_orig_params asserts that the unsharded flat parameter is allocated, which it
        # is not on fake tensors at that point; not yet worked around
        raise VramledgerError(
            "trace: FSDP1 SHARD_GRAD_OP is not traced yet; use --fsdp-version 2 (the same bytes) "
            "or `vramledger estimate`"
        )
    if train.offload_optimizer or train.offload_params:
        raise VramledgerError(
            "trace: CPU offload is not traced (host and device are one memory here); use "
            "`vramledger estimate` or drop --offload"
        )


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A process group of ``world_size`` ranks, this process rank 0, on the fake backend; destroyed on exit."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise VramledgerError(
            "trace: a torch.distributed process group already exists in this process; run the trace in a fresh process"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def recorded_resizes(rec: Recorder) -> Iterator[None]:
    """Report ``UntypedStorage.resize_`` to ``rec``: to 0 is a free, from 0 an allocation."""
    import torch

    original = torch.UntypedStorage.resize_

    def resize_(storage: Any, size: int) -> Any:
        before = storage.nbytes()
        out = original(storage, size)
        rec.on_resize(storage, before, int(size))
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _stream_of(
    rec: Recorder, module: Any, name: str, stream: str, grads: Callable[..., Iterable[Any]] | None = None
) -> Iterator[None]:
    """Run ``module.name`` with ``rec.stream`` set to ``stream`` (restored after each call and on exit). ``grads``
    picks, from the call's arguments, the unsharded gradients it reduces: they are gradients (the trace would
    otherwise file the output layer's under logits, by module)."""
    original = getattr(module, name)

    def tagged(*args: Any, **kwargs: Any) -> Any:
        for g in grads(*args, **kwargs) if grads is not None else ():
            if g is not None:
                rec.mark(g, Category.GRADIENTS.value)
        outer, rec.stream = rec.stream, stream
        try:
            return original(*args, **kwargs)
        finally:
            rec.stream = outer

    setattr(module, name, tagged)
    try:
        yield
    finally:
        setattr(module, name, original)


@contextlib.contextmanager
def _stream_after(rec: Recorder, module: Any, name: str, stream: str) -> Iterator[None]:
    """After each call of ``module.name``, mark its second argument a gradient and set ``rec.stream`` to ``stream``
    (the enclosing ``_stream_of`` restores it)."""
    original = getattr(module, name)

    def switched(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        rec.mark(args[1], Category.GRADIENTS.value)
        rec.stream = stream
        return out

    setattr(module, name, switched)
    try:
        yield
    finally:
        setattr(module, name, original)


@contextlib.contextmanager
def _fsdp2_post_reduce(rec: Recorder, pg: Any, coll: Any) -> Iterator[None]:
    """FSDP2's ``foreach_reduce`` casts the sharded gradient back (``_to_dtype_if_needed``) on its
    ``post_reduce_stream``: the reduce-scatter stream, but the all-reduce stream where the gradients are
    all-reduced (HSDP's replicate group) or an all-reduce hook runs; set ``rec.stream`` to it before the cast (the
    enclosing ``_stream_of`` restores it)."""
    import inspect

    arguments = inspect.signature(coll.foreach_reduce).bind
    reduce, cast = pg.foreach_reduce, coll._to_dtype_if_needed
    post: list[str] = []

    def reduce_(*args: Any, **kwargs: Any) -> Any:
        a = arguments(*args, **kwargs).arguments
        all_reduced = a["all_reduce_group"] is not None and a["all_reduce_grads"]
        post.append(ALL_REDUCE if all_reduced or a.get("all_reduce_hook") is not None else REDUCE_SCATTER)
        try:
            return reduce(*args, **kwargs)
        finally:
            post.pop()

    def cast_(*args: Any, **kwargs: Any) -> Any:
        if post:
            rec.stream = post[-1]
        return cast(*args, **kwargs)

    pg.foreach_reduce, coll._to_dtype_if_needed = reduce_, cast_
    try:
        yield
    finally:
        pg.foreach_reduce, coll._to_dtype_if_needed = reduce, cast


@contextlib.contextmanager
def tagged_streams(rec: Recorder, version: int) -> Iterator[None]:
    """Tag FSDP's collective buffers with the stream they are allocated on."""
    with contextlib.ExitStack() as stack:
        if version == 2:
            from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll
            from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

            stack.enter_context(_stream_of(rec, pg, "foreach_all_gather", ALL_GATHER))
            # foreach_reduce (torch 2.13) allocates and fills the reduce_scatter_input on the current stream and
            # enters the reduce-scatter stream after foreach_reduce_scatter_copy_in: the input is the default
            # stream's, the sharded gradient and its cast the reduce-scatter stream's.
            stack.enter_context(
                _stream_of(rec, pg, "foreach_reduce", "", lambda _params, unsharded, *_a, **_k: unsharded)
            )
            stack.enter_context(_stream_after(rec, coll, "foreach_reduce_scatter_copy_in", REDUCE_SCATTER))
            stack.enter_context(_fsdp2_post_reduce(rec, pg, coll))
        else:
            from torch.distributed.fsdp import _runtime_utils as ru
            from torch.distributed.fsdp._flat_param import FlatParamHandle

            # _runtime_utils.py _unshard: handle.pre_unshard() under the pre-unshard stream (_flat_param.py
            # _use_low_precision_shard: "_mp_shard is allocated in the pre-unshard stream"), handle.unshard() under
            # the unshard stream; _post_backward_hook reduces (and NO_SHARD casts back to the parameter's dtype)
            # under the post-backward stream.
            stack.enter_context(_stream_of(rec, ru, "_unshard", ALL_GATHER))
            stack.enter_context(_stream_of(rec, FlatParamHandle, "pre_unshard", PRE_UNSHARD))
            for reduce in ("_reduce_grad", "_reduce_grad_no_shard"):
                stack.enter_context(
                    _stream_of(rec, ru, reduce, REDUCE_SCATTER, lambda _state, handle: [handle.flat_param.grad])
                )
            stack.enter_context(_fsdp1_all_reduce(rec, ru))
        yield


@contextlib.contextmanager
def _fsdp1_all_reduce(rec: Recorder, ru: Any) -> Iterator[None]:
    """FSDP1's HYBRID_SHARD: _runtime_utils.py ``_reduce_grad`` all-reduces the reduce-scattered shard across nodes
    inside ``state._all_reduce_stream`` (a stream of its own under hybrid sharding: ``_init_streams``) and there
    calls ``_accumulate_sharded_grad``, whose ``_cast_grad_to_param_dtype`` allocates the cast back to the
    parameter's dtype: run that call with ``rec.stream`` set to the all-reduce stream (other strategies call it on
    the post-backward stream)."""
    from torch.distributed.fsdp._flat_param import HandleShardingStrategy

    hybrid = (HandleShardingStrategy.HYBRID_SHARD, HandleShardingStrategy._HYBRID_SHARD_ZERO2)
    original = ru._accumulate_sharded_grad

    def accumulate(state: Any, handle: Any, sharded_grad: Any) -> Any:
        outer = rec.stream
        if handle._sharding_strategy in hybrid:
            rec.stream = ALL_REDUCE
        try:
            return original(state, handle, sharded_grad)
        finally:
            rec.stream = outer

    ru._accumulate_sharded_grad = accumulate
    try:
        yield
    finally:
        ru._accumulate_sharded_grad = original


def _layer_classes(hf: Any, m: ModelSpec) -> set[type]:
    from vramledger.catalog.inventory import decoder_layers

    return {type(layer) for layer in decoder_layers(hf, m.num_layers)}


def _mixed(train: TrainSpec) -> Any:
    import torch

    return torch.bfloat16 if train.precision.compute.value == "bf16" else torch.float16


@contextlib.contextmanager
def _outside_modes() -> Iterator[None]:
    """No dispatch or torch-function mode: the device mesh holds a real (tiny) rank tensor."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C.DisableTorchFunction():
        yield


def _device_mesh(train: TrainSpec) -> Any:
    """A ``cpu`` device mesh over the world; under HYBRID_SHARD two-dimensional, (replicate, shard), sharding over
    the GPUs of one node (FSDP2 ``fully_shard``'s HSDP mesh; FSDP1 _init_utils.py
    ``_init_process_group_state_for_hybrid_shard``: the inter-node group is dimension 0, the shard group 1)."""
    from torch.distributed.device_mesh import init_device_mesh

    with _outside_modes():
        if train.fsdp is not Sharding.HYBRID_SHARD:
            return init_device_mesh("cpu", (train.world_size,))
        per_node = min(train.gpus_per_node, train.world_size)
        if train.world_size % per_node:
            raise VramledgerError(
                f"--fsdp hybrid_shard: world size {train.world_size} is not a multiple of the GPUs per node "
                f"({per_node}); pass --nproc-per-node and --nnodes"
            )
        return init_device_mesh("cpu", (train.world_size // per_node, per_node), mesh_dim_names=("replicate", "shard"))


def _fsdp2(hf: Any, m: ModelSpec, train: TrainSpec) -> Any:
    """accelerate's FSDP2 path (utils/fsdp_utils.py ``fsdp2_prepare_model``): ``fully_shard`` on each decoder
    layer, then on the root, with the mixed-precision policy in the compute dtype."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    assert train.fsdp is not None
    mesh = _device_mesh(train)
    reshard = train.fsdp is not Sharding.SHARD_GRAD_OP
    mp = (
        MixedPrecisionPolicy(param_dtype=_mixed(train), reduce_dtype=_mixed(train))
        if train.precision.mixed
        else MixedPrecisionPolicy()
    )
    classes = _layer_classes(hf, m)
    layers: list[torch.nn.Module] = [module for module in hf.modules() if type(module) in classes]
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(hf, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    return hf


def _fsdp1(hf: Any, m: ModelSpec, train: TrainSpec) -> Any:
    """accelerate's FSDP1 path: ``FullyShardedDataParallel`` with a transformer-layer wrap policy (PEFT's, which
    adds a unit per LoRA leaf, on the HF Trainer's path), ``use_orig_params=True`` (what PEFT needs), and the compute
    dtype as ``MixedPrecision``."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    assert train.fsdp is not None
    strategy = {
        Sharding.FULL_SHARD: ShardingStrategy.FULL_SHARD,
        Sharding.SHARD_GRAD_OP: ShardingStrategy.SHARD_GRAD_OP,
        Sharding.NO_SHARD: ShardingStrategy.NO_SHARD,
        Sharding.HYBRID_SHARD: ShardingStrategy.HYBRID_SHARD,
    }[train.fsdp]
    mp = None
    if train.precision.mixed:
        mp = MixedPrecision(param_dtype=_mixed(train), reduce_dtype=_mixed(train), buffer_dtype=_mixed(train))
    classes = _layer_classes(hf, m)
    layers = [mod for mod in hf.modules() if type(mod) in classes]
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    units = [{p.dtype for p in layer.parameters()} for layer in layers]
    units.append({p.dtype for p in hf.parameters() if id(p) not in in_layers})
    dtypes = max(units, key=len)
    if len(dtypes) > 1:
        # _flat_param.py _validate_tensors_to_flatten: "Must flatten tensors with uniform dtype" - a real run fails
        raise VramledgerError(
            "trace: FSDP1 flattens each unit into one tensor of one dtype, and this model mixes "
            f"{' and '.join(sorted(str(d).removeprefix('torch.') for d in dtypes))} (fp32 adapters over a bf16 "
            "base): a real run fails the same way; use --fsdp-version 2, or --precision bf16-true"
        )
    policy: Any = ModuleWrapPolicy(classes)
    if train.base_dtype is not None and train.adapters:
        # The HF Trainer's path (a base loaded in a dtype of its own, TRL's fp32 default): transformers
        # distributed/fsdp.py update_fsdp_plugin_peft sets PEFT's fsdp_auto_wrap_policy, which wraps each leaf with a
        # trainable weight (lora_A, lora_B) in a unit of its own beside the decoder layers
        # (analytic/distributed/core.py).
        from peft.utils.other import fsdp_auto_wrap_policy

        policy = fsdp_auto_wrap_policy(hf)
    # HYBRID_SHARD: shard over one node's GPUs, all-reduce across nodes (a 2-D mesh, as for FSDP2)
    mesh = _device_mesh(train) if train.fsdp is Sharding.HYBRID_SHARD else None
    return FullyShardedDataParallel(
        hf,
        auto_wrap_policy=policy,
        sharding_strategy=strategy,
        mixed_precision=mp,
        device_id=torch.device("cpu"),
        use_orig_params=True,
        sync_module_states=False,
        device_mesh=mesh,
    )


def _ddp(hf: Any) -> Any:
    """``DistributedDataParallel`` with its defaults (bucket_cap_mb=25, gradient_as_bucket_view=False)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(hf, init_sync=False)

    def keep_bucket(_state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    # DDP checks the annotations as objects (distributed.py _check_comm_hook); this module's are strings.
    keep_bucket.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}

    ddp.register_comm_hook(None, keep_bucket)
    ddp.reducer = _NoRebuild(ddp.reducer)
    return ddp


class _NoRebuild:
    """DDP's reducer without the step-2 bucket rebuild (``Reducer::rebuild_buckets`` syncs the new bucket order
    through real tensors). The rebuilt buckets hold the same gradients in another order: same bytes."""

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


@contextlib.contextmanager
def data_parallel(hf: Any, m: ModelSpec, train: TrainSpec, rec: Recorder) -> Iterator[Any]:
    """Wrap ``hf`` as ``train`` asks (FSDP2, FSDP1 or DDP) on a fake process group; yields the module to call.
    Enter inside the fake-tensor mode and the recorder's dispatch mode, after the parameters are materialised."""
    check_traceable(train)
    rec.stream_categories = {
        ALL_GATHER: Category.WEIGHTS.value,
        PRE_UNSHARD: Category.WEIGHTS.value,
        ALL_REDUCE: Category.GRADIENTS.value,
        REDUCE_SCATTER: Category.GRADIENTS.value,
        "resize_": Category.WEIGHTS.value,
    }
    with contextlib.ExitStack() as stack:
        stack.enter_context(fake_process_group(train.world_size))
        stack.enter_context(recorded_resizes(rec))
        start = len(rec.events)
        if train.fsdp is None:
            wrapped = _ddp(hf)
        else:
            stack.enter_context(tagged_streams(rec, train.fsdp_version))
            wrapped = _fsdp2(hf, m, train) if train.fsdp_version == 2 else _fsdp1(hf, m, train)
        _loaded_on_host(rec, start)
        if train.fsdp is None:  # what DDP allocated and kept: its gradient buckets
            _mark_kept(rec, start, Category.GRADIENTS.value)
        yield wrapped


def _mark_kept(rec: Recorder, wrap_start: int, category: str) -> None:
    for e in rec.events[wrap_start:]:
        info = rec.storages[e.storage]
        if e.kind == "alloc" and info.free_index < 0:
            info.category = category


def _loaded_on_host(rec: Recorder, wrap_start: int) -> None:
    """Whole parameters that the wrapper replaced by shards, and what it built and dropped while sharding (FSDP1's
    unsharded flat parameters), never reach the GPU in a real run (accelerate loads on the CPU or the meta device
    and the wrapper moves only the shards): they count as host memory."""
    for e in rec.events[wrap_start:]:
        if e.kind == "free":
            rec.storages[e.storage].category = "host"
