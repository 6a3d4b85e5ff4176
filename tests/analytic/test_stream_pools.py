"""The per-rank reserve under FSDP (analytic/stream_pools.py) against the allocator replay of the real FSDP2/FSDP1/DDP
wrappers traced on the fake process group (bench/distributed/grid.jsonl, written by bench/distributed/run_grid.py:
one caching-allocator pool per CUDA stream, trace/oom.py), and one pool derived by hand.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.analytic._distributed_grid import records, runner, specs
from vramledger.analytic import estimate
from vramledger.analytic.distributed import compute_view
from vramledger.analytic.step import step_parts
from vramledger.analytic.stream_pools import RESERVE_LABEL, SIDE_POOLS_LABEL, side_pools
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.ledger import Category, Phase
from vramledger.specs import Method, Precision, Sharding, TrainSpec

MiB = 2**20
# Known misses of the whole reserved figure, strict xfails: config id -> cause.
DEFAULT_POOL = (
    "the default stream's pool, {}% under the replay's (the side pools agree to the MiB): at step 2's peak the step-1 "
    "logits segments hold tensors made after them ({}), so step 2 makes the 125 MiB fp32 log-softmax gradient's "
    "segment again; analytic/reserve.py's single-GPU model counts that only for full fine-tuning's optimizer states "
    "(replay of the trace's default stream)"
)
FSDP2_TENANTS = "backward's 32 MiB cuBLAS workspace, the root's unsharded embedding and lm_head, 2 x 62.5 MiB"
FSDP1_TENANTS = (
    "the forward and backward cuBLAS workspaces, 2 x 32 MiB, step 1's optimizer states, step 2's activations"
)
KNOWN = {
    "mid/fsdp2/w8/freeze/bf16-mixed/b1/L1024/nockpt": DEFAULT_POOL.format(15, FSDP2_TENANTS),
    "mid/fsdp2-sgo/w8/freeze/bf16-mixed/b1/L1024/nockpt": DEFAULT_POOL.format(14, FSDP2_TENANTS),
    "mid/fsdp1/w2/freeze/bf16-mixed/b1/L1024/nockpt": DEFAULT_POOL.format(14, FSDP1_TENANTS),
    "mid/fsdp1/w8/freeze/bf16-mixed/b1/L1024/nockpt": DEFAULT_POOL.format(17, FSDP1_TENANTS),
}
# The LoRA steps whose adapters share their input (no dropout, adapters in the compute dtype: analytic/activations.py
# ``_adapter_inputs_bytes``): their allocated peak now equals the trace's (FSDP2 within 0.01%, FSDP1 -3.3% as the
# peak test's known miss; it was +6% when every adapter counted its own copy of the shared input, a figure the whole
# reserved had absorbed), so the default stream's pool shows the same shortfall as the freeze rows above.
LORA_POOL = (
    "the default stream's pool {}% under the replay's, now that the allocated peak is the trace's (it was +6%: "
    "the shared input of the dropout-free adapters counted once per adapter); the side pools agree"
)
KNOWN |= {
    "mid/fsdp2/w2/lora/bf16-mixed/b1/L1024/nockpt": LORA_POOL.format(10.1),
    "mid/fsdp2/w8/lora/bf16-mixed/b1/L1024/nockpt": LORA_POOL.format(10.8),
    "mid/fsdp2-sgo/w8/lora/bf16-mixed/b1/L1024/nockpt": LORA_POOL.format(10.6),
    "mid/fsdp1/w8/lora/bf16-true/b1/L1024/nockpt": LORA_POOL.format(12.1),
    "mid/fsdp2-hsdp/w8/lora/bf16-mixed/b1/L1024/nockpt": LORA_POOL.format(10.5),
}


def _records(engines: tuple[str, ...]) -> list[dict[str, Any]]:
    return [r for r in records() if r["id"].split("/")[1] in engines]


FSDP = ("fsdp2", "fsdp2-sgo", "fsdp1", "fsdp2-hsdp")


def test_the_grid_has_the_replays_pools_of_every_engine_with_and_without_checkpointing() -> None:
    recs = _records((*FSDP, "ddp"))
    assert len(recs) >= 35 and all("replay" in r["trace"] for r in recs)
    kinds = {(r["id"].split("/")[1], r["id"].split("/")[3], r["id"].endswith("/ckpt")) for r in recs}
    for engine in ("fsdp2", "fsdp1", "ddp"):
        for method in ("full", "lora"):
            assert {(engine, method, False), (engine, method, True)} <= kinds, (engine, method)
    fsdp = [r for r in recs if r["id"].split("/")[1] in FSDP]
    side = {"default", "all_gather", "reduce_scatter"}
    assert all(set(r["trace"]["replay"]["pools"]) - {"pre_unshard", "all_reduce"} == side for r in fsdp)
    # FSDP2's HSDP casts the gradients back on its all-reduce stream
    assert {r["id"] for r in fsdp if "all_reduce" in r["trace"]["replay"]["pools"]} == {
        r["id"] for r in fsdp if "/fsdp2-hsdp/" in r["id"]
    }
    # FSDP1's pre-unshard stream casts fp32 shards: only where a mixed-precision policy meets fp32 parameters
    assert {r["id"] for r in fsdp if "pre_unshard" in r["trace"]["replay"]["pools"]} == {
        r["id"] for r in fsdp if "/fsdp1/" in r["id"] and "/bf16-mixed/" in r["id"]
    }
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


@pytest.mark.parametrize(
    "rec",
    [
        pytest.param(r, id=r["id"], marks=pytest.mark.xfail(strict=True, reason=KNOWN[r["id"]]))
        if r["id"] in KNOWN
        else pytest.param(r, id=r["id"])
        for r in _records(FSDP)
    ],
)
def test_fsdp_peak_reserved_within_10_percent(rec: dict[str, Any]) -> None:
    """Rank 0's peak reserved (default stream + side pools) against the replay's. Before the side pools were
    modelled the estimate was 10-32% under on these configs; the rest is the default stream's pool."""
    m, t = specs(rec)
    got, want = estimate(m, t).peak_reserved, rec["trace"]["peak_reserved"]
    print(rec["id"], "estimate", got, "replay", want, f"{100 * (got - want) / want:+.1f}%")
    assert abs(got - want) <= 0.10 * want


@pytest.mark.parametrize("rec", [pytest.param(r, id=r["id"]) for r in _records(("ddp",))])
def test_ddp_reserve_adds_nothing_to_the_single_gpu_model(rec: dict[str, Any]) -> None:
    """DDP allocates its buckets and reduces on the default stream (reducer.cpp): one pool, so the per-rank reserve
    misses by what the single-GPU reserve misses on the same step, and by nothing more (within 1%)."""
    m, t = specs(rec)
    one = rec["single_view"]
    # the single-GPU estimate of today (the recorded one predates changes to analytic/reserve.py), its trace recorded
    inherited = estimate(m, compute_view(t)).peak_reserved - one["trace_peak_reserved"]
    got, want = estimate(m, t).peak_reserved, rec["trace"]["peak_reserved"]
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
    run = runner()
    m = model_spec_from_config(run.MID, name="mid", source="test")
    t = TrainSpec(
        method=Method.FULL,
        precision=Precision.BF16_MIXED,
        micro_batch=1,
        seq_len=1024,
        world_size=8,
        fsdp=Sharding.FULL_SHARD,
        fsdp_version=2,
    )
    got = side_pools(m, t, step_parts(m, t).weights).all_gather
    print("expected", 164 * MiB, "got", got)
    assert got == 164 * MiB
