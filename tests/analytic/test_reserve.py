"""The analytic allocator reserve against the caching-allocator rules and against the replay of real traces.

Truths used:
- a hand-built allocation sequence whose reserved memory follows from CUDACachingAllocator.cpp's rules alone;
- bench/reserve/replay_grid.jsonl: real transformers/PEFT steps traced on fake tensors and replayed through the
  allocator model (trace/oom.py), committed (regenerate with ``python bench/reserve/run_grid.py``);
- a few cheap configs traced live, so the committed figures cannot drift from the tracer unnoticed.
Neither is a GPU measurement (the allocator model awaits validation on a GPU).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from vramledger.analytic import estimate
from vramledger.analytic.reserve import replay_excess, stranded_bytes
from vramledger.analytic.step import step_parts
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.ledger import Category, Phase
from vramledger.specs import Attention, Method, TrainSpec

MiB = 2**20
ROOT = Path(__file__).resolve().parents[2]
GRID = ROOT / "bench" / "reserve" / "replay_grid.jsonl"
TRAIN = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)
# The analytic reserved may be at most this far below the trace replay's peak reserved.
TOLERANCE = 0.07
# Known misses (the analytic reserved more than TOLERANCE below the trace replay), kept visible as strict xfails.
# What the trace replay shows there and the closed form does not model:
KNOWN_BELOW = {
    # full fine-tuning at its optimizer peak: the foreach temporaries (P·b) and the states, cut among the
    # activation blocks cached by then, need new segments
    "llama-3.2-1b/full/b2/L512/nockpt/sdpa": "optimizer-peak fragmentation (full fine-tuning)",
    # per-parameter tensors of 1-10 MiB cut from 20 MiB segments and re-made every step: 200+ split tails
    "qwen2.5-0.5b/full/b2/L256/nockpt/eager": "per-parameter-tensor fragmentation at a short length",
    # suspected: the backward thread's cuBLAS workspace, allocated at the first backward matmul (after the loss),
    # lands in a cached logits block (the replay's excess is +16% with Ada's 8 MiB workspaces, +35% with Hopper's
    # 32 MiB ones, which the grid uses)
    "qwen2.5-0.5b/lora/b2/L512/ckpt/eager": "suspected workspace placement in the logits blocks (not modelled)",
    "qwen3-0.6b/lora/b4/L512/nockpt/sdpa": "not yet explained (short length, large vocabulary)",
    "tiny/lora/b4/L512/nockpt/sdpa": "not yet explained (2-layer model: segment granularity dominates)",
    "mid/lora/b2/L1024/nockpt/eager": "not yet explained (eager scores and their backward)",
}


def _records() -> list[dict[str, Any]]:
    return [json.loads(line) for line in GRID.read_text().splitlines()]


def _specs(rec: dict[str, Any]):  # noqa: ANN202
    sys.path.insert(0, str(ROOT / "bench" / "reserve"))
    try:
        import run_grid
    finally:
        sys.path.pop(0)
    return run_grid.specs((rec["model"], rec["method"], rec["micro_batch"], rec["seq_len"], rec["grad_ckpt"],
                           rec["attn"]))


def _analytic_reserved(model, train) -> int:  # noqa: ANN001
    led = estimate(model, train)
    return max(led.reserved(p) for p in TRAIN)


def test_logits_hole_from_the_allocator_rules() -> None:
    """Forward's bf16 logits block cannot serve backward's fp32 requests: one new segment, the hole stays cached.

    CUDACachingAllocator.cpp: get_free_block takes the smallest cached block ≥ the request (best fit); blocks of
    different cudaMalloc segments never merge; requests ≥ 10 MiB get a segment of their size rounded to 2 MiB.
    With X = c·V·T = 100 MiB: forward allocates logits X, fp32 copy 2X, log-softmax 2X, frees the copy and the
    logits; backward's first 2X gradient reuses the copy's block, the second finds only the X hole and gets a
    new 2X segment. Reserved = X + 2X + 2X + 2X = 7X while 6X is allocated (log-softmax + two gradients).
    """
    X = 100 * MiB
    seq = ((1, X), (2, 2 * X), (3, 2 * X), (2, 0), (1, 0), (4, 2 * X), (5, 2 * X), (4, 0), (3, 0), (5, 0))
    reserved, allocated = replay_excess(seq)
    print(f"expected reserved {7 * X}, allocated {6 * X}; got {reserved}, {allocated}")
    assert (reserved, allocated) == (7 * X, 6 * X)


def test_stranded_bytes_is_the_logits_block_without_checkpointing() -> None:
    """bf16 AMP, standard loss, SDPA, no checkpointing: what is stranded at the loss's peak is the c·V·T logits
    block alone (backward's layer transients come after the loss and split the freed logits blocks)."""
    cfg = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1376, "num_attention_heads": 8,
           "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 8000, "tie_word_embeddings": False}
    m = model_spec_from_config(cfg, name="hand", source="test")
    train = TrainSpec(method=Method.LORA, micro_batch=2, seq_len=512)
    expected = 2 * 8000 * 2 * 512
    got = stranded_bytes(m, train, step_parts(m, train))
    print(f"expected {expected}, got {got}")
    assert got == expected


@pytest.mark.parametrize("rec", _records(), ids=lambda r: r["id"])
def test_not_below_the_committed_trace_replay(rec: dict[str, Any]) -> None:
    model, train, _ = _specs(rec)
    expected = rec["trace"]["replay_peak_reserved"]
    got = _analytic_reserved(model, train)
    gap = got / expected - 1
    print(f"{rec['id']}: trace-replay reserved {expected / 2**30:.3f} GiB, analytic {got / 2**30:.3f} GiB "
          f"({gap:+.1%})")
    if rec["id"] in KNOWN_BELOW:
        assert gap < -TOLERANCE, "no longer a known miss: take it out of KNOWN_BELOW"
        pytest.xfail(KNOWN_BELOW[rec["id"]])
    assert gap >= -TOLERANCE


def test_reserved_is_flat_across_training_phases() -> None:
    """From step 2 on the cache built by step 1 is still held (no empty_cache): the trace replay reports the same
    reserved at the forward, backward and optimizer peaks (bench/reserve/replay_grid.jsonl, e.g. Llama-3.2-1B
    LoRA: 10.10 GiB in every phase), so the analytic ledger does too."""
    rec = next(r for r in _records() if r["id"] == "llama-3.2-1b/lora/b2/L2048/ckpt/sdpa")
    traced = {rec["trace"]["phases"][p.value]["reserved"] for p in TRAIN}
    print("trace reserved by phase:", traced)
    assert len(traced) == 1
    model, train, _ = _specs(rec)
    led = estimate(model, train)
    assert len({led.reserved(p) for p in TRAIN}) == 1
    assert all(led.bytes_of(Category.ALLOCATOR_RESERVE, p) >= 0 for p in TRAIN)


LIVE = [
    # Cheap traces (a 2-layer model), run live so that the committed figures follow the tracer.
    "tiny/full/b8/L1024/ckpt/sdpa",
    "tiny/full/b2/L4096/nockpt/sdpa",
    "tiny/full/b1/L256/nockpt/sdpa",
    "tiny/lora/b1/L2048/ckpt/sdpa",
]


@pytest.mark.parametrize("cid", LIVE)
def test_not_below_a_live_trace_replay(cid: str) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from vramledger.trace import trace_step

    rec = next(r for r in _records() if r["id"] == cid)
    model, train, cfg = _specs(rec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' deprecation warnings about checkpointing names
        led = trace_step(model, train, config=cfg)
    alloc = led.settings["allocator"]
    assert alloc["peak_reserved_bytes"] == rec["trace"]["replay_peak_reserved"], "regenerate replay_grid.jsonl"
    expected = alloc["peak_reserved_bytes"]
    got = _analytic_reserved(model, train)
    print(f"{cid}: trace-replay reserved {expected / 2**30:.3f} GiB, analytic {got / 2**30:.3f} GiB")
    assert got >= expected * (1 - TOLERANCE)


def test_eager_attention_strands_its_scores_too() -> None:
    """Eager attention's pre-softmax scores (c·nh·L² per sequence) are made in forward before the loss and are
    too small for its requests: they add to what is stranded (stranded grows by exactly that transient)."""
    cfg = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1376, "num_attention_heads": 8,
           "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 8000, "tie_word_embeddings": False}
    m = model_spec_from_config(cfg, name="hand", source="test")
    sdpa = TrainSpec(method=Method.LORA, micro_batch=2, seq_len=512)
    eager = TrainSpec(method=Method.LORA, micro_batch=2, seq_len=512, attn=Attention.EAGER)
    diff = stranded_bytes(m, eager, step_parts(m, eager)) - stranded_bytes(m, sdpa, step_parts(m, sdpa))
    assert diff == 2 * 8 * 512 * 512 * 2  # c · nh · L² · B
