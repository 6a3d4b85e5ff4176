"""Many GPUs on the analytic path: what one rank of a data-parallel run holds and reserves (DDP, PyTorch FSDP 1 and
2, DeepSpeed ZeRO-1/2/3, CPU offload), and NCCL's own device memory.

The single-GPU step (analytic/step.py) is computed first; ``rank_step_parts`` then gives rank 0's step: what rank 0
keeps of each persistent line and which buffers the engine adds. ``stream_pools`` gives the rank's reserve with
FSDP's side-stream pools, ``nccl`` the communicators' memory outside PyTorch's allocator. docs/distributed.md and
docs/nccl.md say what each models and how it was checked against the traces of the real wrappers.

Modules, each on the ones before it: ``rank`` (what one rank holds: ``Buffer``, ``RankParts``, rank 0's
``share``), ``fsdp1_shards`` (FSDP1's uneven flat shards of a unit's adapters), ``fsdp_no_sync`` (FSDP1 under
gradient accumulation), ``fsdp_root_flatten`` (FSDP1's end of backward with a trained root unit), ``zero``
(DeepSpeed ZeRO-1/2/3 buffer by buffer, and DeepSpeed's own figure), ``core`` (DDP and FSDP per rank, the engine's
dtypes, rank 0's step; it was analytic/distributed.py), ``fsdp1_layer_grad`` (FSDP1's instant inside a decoder
layer's backward: its flat gradient made, the next unit prefetched), ``nccl`` (NCCL's communicators),
``fsdp_workspace`` (the default stream's floor under FSDP: the backward thread's cuBLAS workspace) and
``stream_pools`` (the side streams' pools and the rank's reserve lines).

Imports: the modules import one another by module path (``vramledger.analytic.distributed.core``), never through
this package, and the rest of vramledger imports the names below from the package. ``fsdp_workspace`` and
``stream_pools`` are not re-exported: they are built on analytic/parts.py and analytic/reserve/, and parts.py
imports ``Buffer`` from here, so importing them here would close a cycle (parts → this package → stream_pools →
parts); import them by their module path.
"""

from __future__ import annotations

from vramledger.analytic.distributed.core import (
    compute_view,
    distributed_settings,
    distributed_warnings,
    engine_dtypes,
    fsdp2_pending_root_shard,
    rank_step_parts,
    root_flatten,
    single_gpu_spec,
)
from vramledger.analytic.distributed.fsdp1_layer_grad import NAME as LAYER_GRADIENT_NAME
from vramledger.analytic.distributed.fsdp1_layer_grad import layer_gradient_lines
from vramledger.analytic.distributed.fsdp_root_flatten import PRE_FORWARD_NAME, FlattenMoment, holds_grads_into_forward
from vramledger.analytic.distributed.nccl import nccl_bill, nccl_lines
from vramledger.analytic.distributed.rank import Buffer, add_buffers
from vramledger.analytic.distributed.zero import deepspeed_estimate

__all__ = [
    "LAYER_GRADIENT_NAME",
    "PRE_FORWARD_NAME",
    "Buffer",
    "FlattenMoment",
    "add_buffers",
    "compute_view",
    "deepspeed_estimate",
    "distributed_settings",
    "distributed_warnings",
    "engine_dtypes",
    "fsdp2_pending_root_shard",
    "holds_grads_into_forward",
    "layer_gradient_lines",
    "nccl_bill",
    "nccl_lines",
    "rank_step_parts",
    "root_flatten",
    "single_gpu_spec",
]
