"""FSDP2's end of backward on rank 0 (analytic/distributed/core.py ``_fsdp_root_grad_buffers``,
``fsdp2_pending_root_shard``): the last layer's reduce-scatter input is still held, the root's gradient shard is not
made yet. Derived by hand and held to the trace of Llama-3.2-1B on 8 ranks (bench/distributed/grid.jsonl), whose
peak is that moment (the tied embedding's two gradients summed)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.analytic._distributed_grid import records, specs
from vramledger.analytic.distributed import fsdp2_pending_root_shard
from vramledger.analytic.distributed.core import LAST_REDUCE_SCATTER_INPUT_LABEL
from vramledger.analytic.step import moments, step_parts
from vramledger.ledger import Category, Phase
from vramledger.specs import Method, Sharding

MiB = 2**20
ROW = "llama-3.2-1b/fsdp2/w8/full/bf16-mixed/b1/L1024/ckpt"


def _row() -> dict:
    return next(r for r in records() if r["id"] == ROW)


def test_end_of_backward_by_hand() -> None:
    """Llama-3.2-1B (hidden 2048, MLP 8192, 8 KV heads of 64, vocabulary 128,256, tied), full fine-tune, FSDP2
    on 8 ranks, bf16-mixed (fp32 shards, bf16 reduce dtype). A decoder layer has 2 × 2048² (q, o) + 2 × 512 × 2048
    (k, v) + 3 × 8192 × 2048 (MLP) + 2 × 2048 (norms) = 60,821,504 elements; the embeddings' backward comes after
    layer 0's post_backward, whose reduce_scatter_input (bf16: 121,643,008 B) ``reduce_scatter_states`` keeps until
    the root's post_backward. The root (the tied embedding, the final norm) has no shard gradient yet:
    ⌈128256/8⌉ × 2048 × 4 B + ⌈2048/8⌉ × 4 B = 131,335,168 B fewer gradient bytes than after the step."""
    m, t = specs(_row())
    p = step_parts(m, t)
    pending = fsdp2_pending_root_shard(m, t, p.weights)
    print("pending root shard: expected", 131_335_168, "got", pending)
    assert pending == 131_335_168
    mo = moments(m, t)[Phase.BACKWARD]
    rs = sum(i.bytes for i in mo.items if i.label == LAST_REDUCE_SCATTER_INPUT_LABEL)
    print("reduce-scatter input: expected", 121_643_008, "got", rs)
    assert rs == 121_643_008


def test_end_of_backward_is_the_traced_peak() -> None:
    """The row's backward peak, as traced (rank 0, step 2): allocated and gradients to within 1 MiB (the trace
    rounds each tensor to 512 B). Before, the estimate held every shard and no reduce-scatter input: 9.2 MiB more
    in all, and 125 MiB too many in the reduce-scatter stream's pool, 116 MiB too few on the default stream."""
    rec = _row()
    m, t = specs(rec)
    mo = moments(m, t)[Phase.BACKWARD]
    traced = rec["trace"]["phases"]["backward"]
    grads = sum(i.bytes for i in mo.items if i.category is Category.GRADIENTS)
    print("allocated: trace", traced["allocated"], "estimate", mo.total)
    print("gradients: trace", traced["by_category"]["gradients"], "estimate", grads)
    assert abs(mo.total - traced["allocated"]) <= MiB
    assert abs(grads - traced["by_category"]["gradients"]) <= MiB


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"fsdp_version": 1}, id="fsdp1"),  # its own flattening moments (fsdp_root_flatten.py)
        pytest.param({"fsdp": None}, id="ddp"),
        pytest.param({"fsdp": Sharding.NO_SHARD, "fsdp_version": 1}, id="no_shard"),
        pytest.param({"offload_params": True}, id="offload"),  # the shards live on the host
        pytest.param({"method": Method.LORA}, id="lora"),  # the root is frozen: no root shard to wait for
    ],
)
def test_no_pending_shard_elsewhere(change: dict) -> None:
    m, t = specs(_row())
    t = dataclasses.replace(t, **change)
    assert fsdp2_pending_root_shard(m, t, step_parts(m, t).weights) == 0
