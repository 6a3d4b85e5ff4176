"""Falls of the estimate as the shape grows that bench/invariants_sweep.py found beyond the single-GPU dense grid,
each at the first shape where it fell, with the mechanism named. ``fit`` and ``plan`` bisect on a run with dynamic
padding (the default) never reserving less at a larger micro-batch or length; a packed run meets one shape and may."""

from __future__ import annotations

import dataclasses

import pytest

from vramledger.analytic import estimate
from vramledger.catalog import resolve_model
from vramledger.ledger import Ledger, Phase
from vramledger.specs import Method, Sharding, TrainSpec

TRAIN = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)


def _reserved(led: Ledger) -> int:
    return max(led.reserved(p) for p in TRAIN)


# FSDP1's root flattening blocks made again from step 2 on (distributed/fsdp_root_flatten.py): each is made again
# only while the loss's fp32 logits block (4·V·T, cached by step 2) is smaller than it. Qwen2.5-0.5B, full, FSDP1
# on 4 ranks, checkpointing: at 1 × 448 the logits block, 4 · 151,936 · 448 = 272,269,312 B, is exactly the
# embedding's flattening block, 2 · 151,936 · 896, and holds it; at 1 × 447 it is 607,744 B short. The padded run's
# reserve fell by 778 MiB there (FULL_SHARD), by 589 MiB at 1 × 373 → 504 (SHARD_GRAD_OP), and by 625 MiB from
# 4 to 5 sequences of 106 tokens, until the floor was held over the shorter shapes (stream_pools.py
# ``_held_flatten_floor``).
FSDP1_FALLS = [
    pytest.param(Sharding.FULL_SHARD, (1, 447), (1, 448), id="full_shard-1x447-448"),
    pytest.param(Sharding.FULL_SHARD, (4, 106), (5, 106), id="full_shard-4-5x106"),
    pytest.param(Sharding.SHARD_GRAD_OP, (1, 373), (1, 504), id="shard_grad_op-1x373-504"),
]


@pytest.mark.parametrize(("sharding", "before", "after"), FSDP1_FALLS)
def test_fsdp1_flattening_floor_is_held_over_shorter_shapes(
    sharding: Sharding, before: tuple[int, int], after: tuple[int, int]
) -> None:
    m = resolve_model("qwen2.5-0.5b")
    setup = TrainSpec(method=Method.FULL, grad_ckpt=True, world_size=4, fsdp=sharding, fsdp_version=1)
    small, large = (estimate(m, setup.at_shape(*shape)) for shape in (before, after))
    print(sharding.value, before, _reserved(small), after, _reserved(large))
    assert _reserved(large) >= _reserved(small)
    assert large.device_total >= small.device_total


def test_fsdp1_packed_run_still_meets_one_shape() -> None:
    """The packed run's figure does fall there: the blocks are made again at 1 × 447 and fit the logits block at
    1 × 448 (real allocator behaviour, which a packed run, meeting one shape, shows); the padded run holds the
    shorter shape's."""
    m = resolve_model("qwen2.5-0.5b")
    setup = TrainSpec(
        method=Method.FULL, grad_ckpt=True, world_size=4, fsdp=Sharding.FULL_SHARD, fsdp_version=1, packing=True
    )
    short, long = (_reserved(estimate(m, setup.at_shape(1, ell))) for ell in (447, 448))
    padded = _reserved(estimate(m, dataclasses.replace(setup, packing=False).at_shape(1, 448)))
    print("packed 447", short, "packed 448", long, "padded 448", padded)
    assert long < short <= padded
