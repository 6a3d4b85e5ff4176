"""What one rank holds under a data-parallel engine: rank 0's share of the single-GPU lines, and the engine's
buffers with the phases they live in. Shared by distributed/core.py (DDP, FSDP) and distributed/zero.py (ZeRO)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from vramledger.ledger import Category, Phase
from vramledger.specs import TrainSpec

FWD_BWD = frozenset((Phase.FORWARD, Phase.BACKWARD))
ALL_PHASES = frozenset((Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER))


@dataclass(frozen=True, kw_only=True, slots=True)
class Buffer:
    """One engine buffer: its bytes on rank 0 and the phases in which it is live at the phase's peak."""

    label: str
    category: Category
    bytes: int
    phases: frozenset[Phase]
    source: str
    at_end_of_backward: bool | None = None
    """None: at whichever moment holds the phase's peak; True: only when that is the end of backward (every gradient
    allocated); False: never then."""


END_OF_BACKWARD = "end of backward"
"""How analytic/step.py ``moments`` names the backward moment where every gradient is allocated."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankParts:
    """What rank 0 holds of the persistent lines, the buffers its engine adds, and what moved to the host."""

    engine: str
    """``ddp``, ``fsdp1``/``fsdp2`` with the strategy, ``zero-1..3``, or ``single`` (offload on one GPU)."""
    ranks: int
    """Ranks one shard is spread over (N)."""
    frozen: int
    trainable: int
    master: int
    grads: int
    states: int
    step_temp: int
    autocast: int
    buffers: tuple[Buffer, ...] = ()
    host_bytes: int = 0
    """Bytes the engine keeps in host memory instead (offload)."""
    sharded: tuple[str, ...] = ()
    replicated: tuple[str, ...] = ()
    master_label: str = "fp32 master copy (ZeRO partition)"
    heaviest_rank: int = 0
    """The rank that holds most (0 unless FSDP1's flat shards split the trainable parameters unevenly)."""
    heaviest_extra_bytes: int = 0
    """What ``heaviest_rank`` holds beyond rank 0: its larger share of trainable weights, optimizer state and step
    temporaries."""
    notes: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class SingleLines:
    """The single-GPU step's persistent lines (analytic/step.py ``StepParts``) that an engine shards or moves."""

    frozen: int
    trainable: int
    grads: int
    states: int
    step_temp: int
    autocast: int

    @classmethod
    def of(cls, p: Any) -> SingleLines:
        return cls(
            frozen=p.frozen_bytes,
            trainable=p.trainable_bytes,
            grads=p.grad_bytes,
            states=p.state_bytes,
            step_temp=p.step_temp_bytes,
            autocast=p.autocast_copy_bytes,
        )


def share(n: int, ranks: int) -> int:
    """Rank 0's share: the ceiling (the padded shard)."""
    return -(-n // ranks)


def engine_name(train: TrainSpec) -> str:
    if train.fsdp is not None:
        return f"fsdp{train.fsdp_version} {train.fsdp.value}"
    if train.zero_stage:
        return f"zero-{train.zero_stage}"
    return "ddp" if train.world_size > 1 else "single"


class _Moment(Protocol):
    """What ``add_buffers`` needs of analytic/parts.py ``Moment`` (which imports this module's ``Buffer``)."""

    name: str

    def add(self, cat: Category, label: str, n: int, source: str) -> None: ...


def add_buffers(moment: _Moment, phase: Phase, buffers: tuple[Buffer, ...]) -> None:
    """Add the engine's buffers live in ``phase`` to a step moment (analytic/parts.py ``Moment``)."""
    at_end = moment.name.startswith(END_OF_BACKWARD)
    for b in buffers:
        if phase in b.phases and b.at_end_of_backward in (None, at_end):
            moment.add(b.category, b.label, b.bytes, b.source)
