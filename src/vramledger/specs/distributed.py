"""How a data-parallel run spreads one model over several GPUs: FSDP's sharding strategy and DeepSpeed ZeRO's
communication buffers. TrainSpec holds these; ``analytic/distributed/core.py`` and ``trace/distributed.py`` read them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from vramledger.errors import VramledgerError


class Sharding(str, enum.Enum):
    """FSDP's sharding strategy (torch/distributed/fsdp/api.py ``ShardingStrategy``; FSDP2 spells FULL_SHARD as
    ``reshard_after_forward=True`` and SHARD_GRAD_OP as ``False``, and HYBRID_SHARD as a 2-D device mesh)."""

    FULL_SHARD = "full_shard"
    """Parameters, gradients and optimizer states sharded; each unit all-gathered for its forward and again for
    its backward."""
    SHARD_GRAD_OP = "shard_grad_op"
    """Gradients and optimizer states sharded; parameters stay unsharded from a unit's forward to its backward."""
    HYBRID_SHARD = "hybrid_shard"
    """FULL_SHARD within a node, replicated across nodes (shards over the GPUs of one node)."""
    NO_SHARD = "no_shard"
    """Nothing sharded: DDP through FSDP's all-reduce (no buckets)."""

    @property
    def shards_params(self) -> bool:
        return self in (Sharding.FULL_SHARD, Sharding.HYBRID_SHARD, Sharding.SHARD_GRAD_OP)


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroBuffers:
    """DeepSpeed ZeRO's communication buffers, in elements (deepspeed runtime/zero/config.py
    ``DeepSpeedZeroConfig`` defaults; the HF integration's ``"auto"`` values are resolved by the adapter)."""

    reduce_bucket_size: int = 500_000_000
    """``reduce_bucket_size``: elements per gradient reduce bucket (``ipg_buffer``)."""
    allgather_bucket_size: int = 500_000_000
    """``allgather_bucket_size``: ZeRO-1/2 all-gather of updated parameter partitions, in chunks of this size."""
    overlap_comm: bool | None = None
    """``overlap_comm``: two reduce buckets instead of one. None: DeepSpeed's default (True at ZeRO-3, False
    below: stage3.py sets it on; config.py ``overlap_comm`` default False)."""
    contiguous_gradients: bool = True
    """``contiguous_gradients``: gradients copied into one partition-sized buffer as they are reduced."""
    prefetch_bucket_size: int = 50_000_000
    """``stage3_prefetch_bucket_size``: elements ZeRO-3 all-gathers ahead of use."""
    max_live_parameters: int = 1_000_000_000
    """``stage3_max_live_parameters``: elements ZeRO-3 keeps gathered at once, at most."""
    param_persistence_threshold: int = 100_000
    """``stage3_param_persistence_threshold``: parameters with fewer elements stay whole on every rank."""
    auto: tuple[str, ...] = ()
    """Keys left ``"auto"`` where the model was not known when the config was read: resolved from the hidden size
    as the HF integration does (``reduce_bucket_size`` = h², ``stage3_prefetch_bucket_size`` = 0.9·h²,
    ``stage3_param_persistence_threshold`` = 10·h; transformers integrations/deepspeed.py
    ``trainer_config_finalize``)."""

    def __post_init__(self) -> None:
        for name in (
            "reduce_bucket_size",
            "allgather_bucket_size",
            "prefetch_bucket_size",
            "max_live_parameters",
            "param_persistence_threshold",
        ):
            if getattr(self, name) < 0:
                raise VramledgerError(f"deepspeed {name} must be 0 or more elements (got {getattr(self, name)})")

    def resolved(self, hidden: int) -> ZeroBuffers:
        """The sizes with ``"auto"`` filled in from the model's hidden size."""
        auto = {
            "reduce_bucket_size": ("reduce_bucket_size", hidden * hidden),
            "stage3_prefetch_bucket_size": ("prefetch_bucket_size", int(0.9 * hidden * hidden)),
            "stage3_param_persistence_threshold": ("param_persistence_threshold", 10 * hidden),
        }
        fields = dict(auto[k] for k in self.auto if k in auto)
        return replace(self, auto=(), **fields)  # type: ignore[arg-type]  # the keys above are all int fields

    def overlap(self, stage: int) -> bool:
        return self.overlap_comm if self.overlap_comm is not None else stage == 3
