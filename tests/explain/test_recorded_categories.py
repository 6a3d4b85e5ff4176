"""A category recorded on a block's ``alloc`` entry decides its bucket: in snapshots that ``vramledger trace
--snapshot`` writes (the ledger's categories) and in those torch's ``_memory_viz._profile_to_snapshot`` writes (the
memory profiler's, torch/profiler/_memory_profiler.py ``Category`` names lowercased). Before, every block of a
trace-written snapshot (whose frames name the tracer's op labels, not real files) fell in "other"."""

from __future__ import annotations

from typing import Any

import pytest

from tests.explain.conftest import MiB, make_snapshot
from tests.trace._trace_tiny import TINY, spec
from vramledger.explain import evidence_from_snapshot
from vramledger.explain.attribute import Bucket, attribute, recorded_categories, traced_allocs
from vramledger.explain.snapshot import facts
from vramledger.specs import Method, TrainSpec


def test_profiler_categories_win_over_frames() -> None:
    """The hand-made snapshot of conftest, with a profiler category written on the first traced alloc of a live
    block: that block moves to the bucket the category names, whatever its frames say, and nothing else moves."""
    snap = make_snapshot()
    live = {b["address"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"}
    first = next(e for e in snap["device_traces"][0] if e["action"] == "alloc" and e["addr"] in live)
    before = {s.bucket: s.bytes for s in attribute(facts(snap), traced_addresses=traced_allocs(snap))}
    first["category"] = "optimizer_state"
    recorded = recorded_categories(snap)
    assert recorded == {first["addr"]: Bucket.OPTIMIZER_STATE}
    after = {s.bucket: s.bytes for s in attribute(facts(snap), traced_addresses=traced_allocs(snap), recorded=recorded)}
    size = next(b["size"] for s in snap["segments"] for b in s["blocks"] if b["address"] == first["addr"])
    assert after[Bucket.OPTIMIZER_STATE] == before.get(Bucket.OPTIMIZER_STATE, 0) + size
    assert sum(after.values()) == sum(before.values())


def test_unknown_and_later_allocs_at_the_same_address() -> None:
    """The latest alloc at an address decides: a later one without a known category leaves the frames to decide."""
    trace = [
        {"action": "alloc", "addr": 4 * MiB, "category": "parameter"},
        {"action": "free_completed", "addr": 4 * MiB},
        {"action": "alloc", "addr": 4 * MiB, "category": "unknown"},
        {"action": "alloc", "addr": 8 * MiB, "category": "kv_cache"},
    ]
    assert recorded_categories({"device_traces": [trace]}) == {8 * MiB: Bucket.KV_CACHE}


@pytest.fixture(scope="module")
def traced() -> dict[str, Any]:
    from vramledger.trace.api import trace_step_snapshot

    train = TrainSpec(method=Method.FULL, micro_batch=2, seq_len=40)
    return trace_step_snapshot(spec("llama"), train, config=TINY["llama"])[1]


def test_a_trace_snapshot_puts_the_weights_where_the_model_has_them(traced: dict[str, Any]) -> None:
    """The tiny Llama built by transformers on the meta device is the truth: at the peak of a full fine-tuning
    step (bf16-mixed: fp32 parameters) every parameter and buffer (the rotary ``inv_freq`` and
    ``original_inv_freq``) is live, each one block of its bytes rounded up to 512 (CUDACachingAllocator.cpp
    ``round_size``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY["llama"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    tensors = [*model.parameters(), *model.buffers()]
    expected = sum(-(-t.numel() * t.element_size() // 512) * 512 for t in tensors)
    ev = evidence_from_snapshot(traced, source="trace --snapshot")
    shares = {s.bucket: s.bytes for s in ev.shares}
    assert shares[Bucket.WEIGHTS] == expected
    assert Bucket.OTHER not in shares
    # the first matmul's cuBLAS workspace, which the tracer sizes per architecture (catalog/device_overhead.json)
    assert shares[Bucket.WORKSPACE] > 0
