"""The per-rank reserve under FSDP (analytic/distributed/stream_pools.py) against the allocator replay of the real
FSDP2/FSDP1/DDP wrappers traced on the fake process group (bench/distributed/grid.jsonl, written by
bench/distributed/run_grid.py: one caching-allocator pool per CUDA stream, trace/oom.py), and one pool derived by hand.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tests.analytic._distributed_grid import mid_fsdp2, records, runner, specs
from vramledger.analytic import estimate
from vramledger.analytic.distributed import compute_view
from vramledger.analytic.distributed.ddp_reserve import SOURCE as DDP_RESERVE_SOURCE
from vramledger.analytic.distributed.stream_pools import DEFAULT_POOL_LABEL, RESERVE_LABEL, SIDE_POOLS_LABEL, side_pools
from vramledger.analytic.step import step_parts
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.ledger import Category, Phase
from vramledger.specs import Method, Precision, Sharding, TrainSpec

MiB = 2**20


def _records(engines: tuple[str, ...]) -> list[dict[str, Any]]:
    return [r for r in records() if r["id"].split("/")[1] in engines]


FSDP = ("fsdp2", "fsdp2-sgo", "fsdp1", "fsdp2-hsdp", "fsdp1-hsdp", "fsdp1-noshard")


def test_the_grid_has_the_replays_pools_of_every_engine_with_and_without_checkpointing() -> None:
    recs = _records((*FSDP, "ddp"))
    assert len(recs) >= 35 and all("replay" in r["trace"] for r in recs)
    kinds = {(r["id"].split("/")[1], r["id"].split("/")[3], r["id"].endswith("/ckpt")) for r in recs}
    for engine in ("fsdp2", "fsdp1", "ddp"):
        for method in ("full", "lora"):
            assert {(engine, method, False), (engine, method, True)} <= kinds, (engine, method)
    fsdp = [r for r in recs if r["id"].split("/")[1] in FSDP]
    side = {"default", "all_gather", "reduce_scatter"}
    sharded = [r for r in fsdp if "-noshard/" not in r["id"]]
    assert all(set(r["trace"]["replay"]["pools"]) - {"pre_unshard", "all_reduce"} == side for r in sharded)
    # HSDP casts the gradients back on its all-reduce stream (FSDP2's post_reduce_stream; FSDP1's _reduce_grad)
    assert {r["id"] for r in fsdp if "all_reduce" in r["trace"]["replay"]["pools"]} == {
        r["id"] for r in fsdp if "-hsdp/" in r["id"] and "/bf16-mixed/" in r["id"]
    }
    # FSDP1's pre-unshard stream casts fp32 flat parameters: only where a mixed-precision policy meets them
    assert {r["id"] for r in fsdp if "pre_unshard" in r["trace"]["replay"]["pools"]} == {
        r["id"] for r in fsdp if "/fsdp1" in r["id"] and "/bf16-mixed/" in r["id"]
    }
    # NO_SHARD: pure bf16 allocates on no side stream; under the policy, the casts (pre-unshard) and the fp32
    # gradients (post-backward), and no all-gather
    for r in fsdp:
        if "-noshard/" in r["id"]:
            mixed = "/bf16-mixed/" in r["id"]
            want = {"default", "pre_unshard", "reduce_scatter"} if mixed else {"default"}
            assert set(r["trace"]["replay"]["pools"]) == want, r["id"]
    assert all(set(r["trace"]["replay"]["pools"]) == {"default"} for r in recs if "/ddp/" in r["id"])


@pytest.mark.parametrize("rec", [pytest.param(r, id=r["id"]) for r in _records(FSDP)])
def test_side_pools_match_the_replay(rec: dict[str, Any]) -> None:
    """Each side stream's reserved bytes, modelled from the wrappers' allocation order, against the replay's pool of
    that stream: the same to within one 2 MiB segment."""
    m, t = specs(rec)
    got = side_pools(m, t, step_parts(m, t).weights)
    pools = rec["trace"]["replay"]["pools"]
    for name, ours in (
        ("all_gather", got.all_gather),
        ("pre_unshard", got.pre_unshard),
        ("reduce_scatter", got.reduce_scatter),
        ("all_reduce", got.all_reduce),
    ):
        want = pools.get(name, {"reserved": 0})["reserved"]
        print(rec["id"], name, "estimate", ours, "replay", want)
        assert abs(ours - want) <= 2 * MiB, name


@pytest.mark.parametrize("rec", [pytest.param(r, id=r["id"]) for r in _records(("fsdp2",))])
def test_fsdp2_ledger_line_of_the_side_pools_at_the_loss_is_the_replays(rec: dict[str, Any]) -> None:
    """The estimate's own reserve line for the side pools, at the forward phase's peak (the loss): under FSDP2
    FULL_SHARD nothing is live there in either pool (each all-gather output is freed once copied out, the
    sharded gradients by step 1's ``zero_grad``), so the line is the replay's all-gather and reduce-scatter
    pools' reserved bytes, within one 2 MiB segment each."""
    m, t = specs(rec)
    ledger = estimate(m, t)
    got = sum(i.bytes for i in ledger.items if i.phase is Phase.FORWARD and i.label == SIDE_POOLS_LABEL)
    pools = rec["trace"]["replay"]["pools"]
    want = pools["all_gather"]["reserved"] + pools["reduce_scatter"]["reserved"]
    print(rec["id"], "ledger line", got, "replay", want)
    assert abs(got - want) <= 2 * 2 * MiB


def test_no_side_pool_line_without_sharding() -> None:
    """Pure bf16 NO_SHARD allocates nothing on a side stream: FSDP1 all-reduces the flat gradient in place
    (_runtime_utils.py ``_reduce_grad_no_shard``: ``dist.all_reduce(flat_param.grad)``) and casts nothing
    (``_cast_grad_to_param_dtype`` only where the gradient's dtype is not the parameter's); FSDP at one rank is
    NO_SHARD. One reserve line per phase, as for DDP, and none labelled as the side pools'."""
    run = runner()
    m = model_spec_from_config(run.MID, name="mid", source="test")
    for t in (
        TrainSpec(method=Method.FULL, precision=Precision.BF16, world_size=8, fsdp=Sharding.NO_SHARD),
        TrainSpec(method=Method.FULL, precision=Precision.BF16, world_size=1, fsdp=Sharding.FULL_SHARD),
    ):
        lines = [i for i in estimate(m, t).items if i.category is Category.ALLOCATOR_RESERVE]
        assert lines and all(i.label == RESERVE_LABEL for i in lines)
        assert len({i.phase for i in lines}) == len(lines)


@pytest.mark.parametrize("rec", [pytest.param(r, id=r["id"]) for r in _records(FSDP)])
def test_fsdp_peak_reserved_within_10_percent(rec: dict[str, Any]) -> None:
    """Rank 0's peak reserved (default stream + side pools) against the replay's. Before the side pools were
    modelled the estimate was 10-32% under on these configs; before the backward workspace's logits segment
    (analytic/distributed/fsdp_workspace.py) the four frozen-base rows of the mid model at 8 ranks (and FSDP1 at 2) were
    11-13% under. The replay is of one shape, so it is a packed run's estimate that meets it: a run with dynamic
    padding also holds what its shorter shapes reserve (stream_pools.py ``_held_flatten_floor``: Llama-3.2-1B
    FSDP1 at 1 × 1024, where the fp32 logits block first holds the tied head's flattening blocks, keeps the three
    made again at every shorter length, +28.7% here), and never less than the packed run's."""
    m, t = specs(rec)
    padded = estimate(m, t).peak_reserved
    got, want = estimate(m, dataclasses.replace(t, packing=True)).peak_reserved, rec["trace"]["peak_reserved"]
    assert padded >= got
    print(rec["id"], "estimate", got, "replay", want, f"{100 * (got - want) / want:+.1f}%")
    assert abs(got - want) <= 0.10 * want


@pytest.mark.parametrize("rec", [pytest.param(r, id=r["id"]) for r in _records(("ddp",))])
def test_ddp_reserve_adds_nothing_to_the_single_gpu_model(rec: dict[str, Any]) -> None:
    """DDP allocates its buckets and reduces on the default stream (reducer.cpp): one pool, so the per-rank reserve
    misses by what the single-GPU reserve misses on the same step, and by nothing more (within 1%); where
    analytic/distributed/ddp_reserve.py replays the rank's step (bf16-mixed full fine-tuning), the estimate is held
    to the trace itself instead (test_ddp_reserve.py)."""
    m, t = specs(rec)
    ledger = estimate(m, t)
    if any(i.source == DDP_RESERVE_SOURCE for i in ledger.items):
        pytest.skip("the rank's step replayed: tests/analytic/test_ddp_reserve.py")
    one = rec["single_view"]
    # the single-GPU estimate of today (the recorded one predates changes to analytic/reserve/), its trace recorded
    inherited = estimate(m, compute_view(t)).peak_reserved - one["trace_peak_reserved"]
    got, want = ledger.peak_reserved, rec["trace"]["peak_reserved"]
    print(rec["id"], "estimate", got, "replay", want, "inherited", inherited)
    assert abs(got - inherited - want) <= 0.01 * want


def test_fsdp2_all_gather_pool_by_hand() -> None:
    """FSDP2, 8 ranks, bf16-mixed, the grid's mid model (hidden 1024, MLP 2816, 16 query and 4 KV heads of 64,
    vocabulary 32000, untied). Root unit E_root = 2·32000·1024 + 1024 = 65,537,024 elements; a layer
    E_layer = 2·1024² + 2·1024·256 + 3·1024·2816 + 2·1024 = 11,274,240. Forward, in the copy-in stream:
    the root's fp32 shards cast to bf16 (2·E_root/8 = 15.6 MiB → a 16 MiB segment, freed after the copy-in), its
    output (2·E_root = 125.0 MiB → 126 MiB); layer 0's cast (2.7 MiB) splits the freed 16 MiB block, its output
    (21.5 MiB) needs a new 22 MiB segment since the root's output is still kept; from layer 1 on the root's block
    is free and serves every layer output. 16 + 126 + 22 = 164 MiB."""
    m, t = mid_fsdp2(Method.FULL)
    got = side_pools(m, t, step_parts(m, t).weights).all_gather
    print("expected", 164 * MiB, "got", got)
    assert got == 164 * MiB


def _default_pool(rec: dict[str, Any]) -> int:
    """The estimate's default-stream pool at its largest: the default stream's allocated bytes plus its reserve
    line, at each phase's peak (the whole reserve where there is no side pool). A packed run's: the replay is of one
    shape (``test_fsdp_peak_reserved_within_10_percent``)."""
    m, t = specs(rec)
    t = dataclasses.replace(t, packing=True)
    ledger = estimate(m, t)
    default = [i for i in ledger.items if i.label in (DEFAULT_POOL_LABEL, RESERVE_LABEL)]
    side = {i.phase: i.bytes for i in ledger.items if i.label == SIDE_POOLS_LABEL}
    pools = side_pools(m, t, step_parts(m, t).weights).total
    # allocated on the default stream = the phase's allocated less what of the side pools is live (their reserved
    # less their cached line)
    return max(ledger.allocated(i.phase) - (pools - side.get(i.phase, pools)) + i.bytes for i in default)


@pytest.mark.parametrize("rec", [pytest.param(r, id=r["id"]) for r in _records(FSDP)])
def test_default_pool_within_7_percent_of_the_replays(rec: dict[str, Any]) -> None:
    """The default stream's pool against the replay of the trace's default stream alone. Before the backward
    thread's workspace was modelled (analytic/distributed/fsdp_workspace.py) it was 0-17% under (median 6.7%); now -6.3%
    (FSDP2 LoRA under checkpointing) to +5.9% (FSDP1 LoRA, 2 ranks)."""
    got, want = _default_pool(rec), rec["trace"]["replay"]["pools"]["default"]["reserved"]
    print(rec["id"], "estimate", got, "replay", want, f"{100 * (got - want) / want:+.1f}%")
    assert abs(got - want) <= 0.07 * want


@pytest.mark.parametrize(
    "rec",
    [
        pytest.param(r, id=r["id"])
        for r in records()
        if r["id"].split("/")[1:4:2] in (["fsdp2", "lora"], ["fsdp2-sgo", "lora"], ["fsdp2-hsdp", "lora"])
    ],
)
def test_fsdp2_lora_default_pool_counts_the_layers_cache(rec: dict[str, Any]) -> None:
    """FSDP2 with adapters: the default pool's floor counts LoRA's forward cache beside the workspace block's
    remainder (analytic/distributed/fsdp_workspace.py ``_beside_hole``). The replay of these rows
    (``run_grid.py --causes``) holds at step 2's peak, besides the 94 MiB left of the fp32 block the workspace
    took and the free 64 MiB hole, 56 MiB free in 20 MiB segments step 1's forward made (60 MiB under
    checkpointing); the floor without them was 4.1-6.3% under on all six rows, an under-estimate that lets a run
    out of memory. Now each is within 3%."""
    got, want = _default_pool(rec), rec["trace"]["replay"]["pools"]["default"]["reserved"]
    print(rec["id"], "estimate", got, "replay", want, f"{100 * (got - want) / want:+.1f}%")
    assert abs(got - want) <= 0.03 * want
