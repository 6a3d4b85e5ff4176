"""The analytic allocator reserve against the caching-allocator rules and against the replay of real traces.

Truths used:
- hand-built allocation sequences whose reserved memory follows from CUDACachingAllocator.cpp's rules alone
  (replayed through ``allocator/model.py``, its port);
- bench/reserve/replay_grid.jsonl: real transformers/PEFT steps traced on fake tensors and replayed through the
  allocator model (trace/oom.py), committed (regenerate with ``python bench/reserve/run_grid.py``; no tracing
  here), and bench/reserve/replay_causes.jsonl: for each config the estimate misses, where the replay's excess
  sits (``run_grid.py --causes``);
- bench/reserve/runs.jsonl: 48 of the same configs replayed at other lengths (the simulate engine on the traced
  steps, ``python bench/reserve/run_runs.py``): single shapes from L/4 to 8L and every L/32 from L/2 to L, and
  runs of mixed lengths ≤ L in four orders through one allocator;
- bench/reserve/runs_padded.jsonl: the padded configs among them (micro-batch > 1, SDPA, not packed) measured the
  same way with their batches' attention mask, which the trace now feeds them (trace/step.py ``padding_mask``) and
  the estimate prices (``python bench/reserve/run_padded_runs.py``): their fine envelope, checked against real
  traces at L and L − 8; a padded run's reference is the most of it and runs.jsonl's (its batches of equal rows,
  which carry no mask).
Which replay an estimate is compared with depends on how the run batches (``TrainSpec.packing``): a packed run's
every step is L long, so its reference is the single-shape replay; a run with dynamic padding meets shorter
batches too and keeps their segments, so its reference is the most any length ≤ L reserves on its own (the
fine envelope, what a run whose first steps are at that length keeps) where it is measured, else the single
shape. None of this is a GPU measurement (the allocator model awaits validation on a GPU).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from vramledger.analytic import estimate
from vramledger.analytic.reserve import replay_excess, stranded_bytes
from vramledger.analytic.reserve.full import blocks_with_states
from vramledger.analytic.step import step_parts
from vramledger.catalog import resolve_model
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.ledger import Category, Phase
from vramledger.specs import Attention, Method, ModelSpec, Precision, TrainSpec

MiB = 2**20
ROOT = Path(__file__).resolve().parents[2]
GRID = ROOT / "bench" / "reserve" / "replay_grid.jsonl"
CAUSES = ROOT / "bench" / "reserve" / "replay_causes.jsonl"
RUNS = ROOT / "bench" / "reserve" / "runs.jsonl"
RUNS_PADDED = ROOT / "bench" / "reserve" / "runs_padded.jsonl"
TRAIN = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)
# The analytic peak reserved must be within this fraction of the trace replay's.
TOLERANCE = 0.03
# Configs the closed form still misses by more than TOLERANCE, kept visible as strict xfails; the reason shown is
# what the replay measured (replay_causes.jsonl: the free blocks at step 2's peak and who made their segments).
TINY_FULL = (
    "a 2-layer toy model at 256 tokens: the estimate is the two steps replayed up to step 2's backward "
    "(analytic/distributed/ddp_reserve.py without DDP's bucket: 352 MiB, the same at 1 × 1, which the run with "
    "dynamic padding holds), and the trace's step 2 makes more after it: a 16 MiB foreach temporary of a V×H matrix "
    "in its optimizer, whose step-1 segment holds a V·H gradient (step 1 cut the gradients from the 20 MiB segments "
    "of the 7.81 MiB fp32 logits blocks), and 2 MiB small-pool segments for its ≤ 1 MiB blocks, which the replay "
    "leaves out; docs/reserve.md, the 2-layer toy"
)
TINY_LORA = (
    "a 2-layer toy model at 512 tokens: 8.4 MiB free in the small pool (the c·H·T and 4·H·T activations are ≤ 1 MiB, "
    "small_pool_excess counts only per-parameter tensors) and 10.1 MiB in 20 MiB segments at step 2's peak, and one "
    "more small segment in step 2; docs/reserve.md, the 2-layer toy"
)
TINY_LORA_REST = (
    "a 2-layer toy model, packed 4 × 512: the third fp32 logits block's 2 MiB segment rest at backward's peak is left "
    "out (the estimate counts the rests of the two fp32 blocks forward's cross-entropy holds too, where forward is the "
    "peak at short lengths and a third rest would make the figure fall as the blocks grow), with the small pool's and "
    "20 MiB segments' free bytes of TINY_LORA: −2.9% with the third rest, −3.3% without"
)
# The 2-layer toy's LoRA run against the masked envelope (runs_padded.jsonl): the estimate allocates what the masked
# trace does (its ledger's peak), and the replay's reserved grows with the mask more than the estimate's. (The full
# fine-tuning toys' four such misses closed in session 33, when the closed forms' bound on a padded shape's replay
# took the mask's bytes as the replay does: runs.py ``closed_at``.)
TOY_MASK_LORA = (
    "2-layer toy, LoRA 4 × 512: allocated 388 MiB on both sides; reserved, the replay 486 → 494 MiB at L and 506 at "
    "504 tokens (the mask padded to 512 columns, 2 MiB less allocated), the estimate 470 → 480: −5.1% (packed −3.3%: "
    "TINY_LORA_REST's small-pool and 20 MiB segments' free bytes)"
)
KNOWN_MISSES: dict[str, str] = {
    "tiny/full/b1/L256/nockpt/sdpa": TINY_FULL,
    "tiny/lora/b2/L256/nockpt/eager": TINY_LORA,
    "tiny/lora/b4/L512/nockpt/sdpa": TOY_MASK_LORA,
}
# The same grid estimated as packed runs (``packing``: every step B × L, the single-shape replay the reference).
PACKED_MISSES: dict[str, str] = {
    "tiny/full/b1/L256/nockpt/sdpa": TINY_FULL,
    "tiny/lora/b2/L256/nockpt/eager": TINY_LORA,
    "tiny/lora/b4/L512/nockpt/sdpa": TINY_LORA_REST,
}


def _records() -> list[dict[str, Any]]:
    return [json.loads(line) for line in GRID.read_text().splitlines()]


def _runs() -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in map(json.loads, RUNS.read_text().splitlines())}


def _envelopes() -> dict[str, int]:
    """The fine envelope of each config measured: runs.jsonl's, and for a padded run (micro-batch > 1, SDPA, not
    packed) runs_padded.jsonl's ``envelope_run``, the most of its batches with a padded row (traced with their
    attention mask, as the estimate prices them) and of its batches of equal rows (no mask: runs.jsonl's)."""
    out = {cid: r["reference"]["envelope_fine"] for cid, r in _runs().items()}
    out |= {r["id"]: r["reference"]["envelope_run"] for r in map(json.loads, RUNS_PADDED.read_text().splitlines())}
    return out


def _reference(rec: dict[str, Any], train: TrainSpec) -> tuple[int, str]:
    """The replay an estimate of ``rec``'s config is compared with, and which one it is."""
    envelope = _envelopes().get(rec["id"])
    if train.packing or envelope is None:
        return rec["trace"]["replay_peak_reserved"], "single-shape replay"
    return envelope, "most any length ≤ L reserves (dynamic padding)"


def _causes() -> dict[str, dict[str, Any]]:
    if not CAUSES.exists():
        return {}
    return {r["id"]: r for r in map(json.loads, CAUSES.read_text().splitlines())}


def _run_grid():  # noqa: ANN202
    sys.path.insert(0, str(ROOT / "bench" / "reserve"))
    try:
        import run_grid
    finally:
        sys.path.pop(0)
    return run_grid


def _specs(cid: str) -> tuple[ModelSpec, TrainSpec]:
    g = _run_grid()
    row = {g.config_id(r): r for r in g.GRID}[cid]
    model, train, _ = g.specs(row)
    return model, train


def _analytic_reserved(model: ModelSpec, train: TrainSpec) -> int:
    led = estimate(model, train)
    return max(led.reserved(p) for p in TRAIN)


def _measured(cid: str) -> str:
    rec = _causes().get(cid)
    if rec is None:
        return "cause not recorded (python bench/reserve/run_grid.py --causes)"
    free = "; ".join(
        f"{f['bytes'] / 2**30:.2f} GiB in {f['blocks']} blocks made by {f['made_by']}" for f in rec["free_at_peak"][:2]
    )
    made = "; ".join(f"{f['made_by']} {f['bytes'] / 2**30:.2f} GiB" for f in rec["made_in_step_2"][:2])
    return f"replay: free at step 2's peak: {free}; made in step 2: {made or 'nothing'}"


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


def test_a_state_in_a_logits_block_makes_step_2_remake_it() -> None:
    """Mechanism 2 of ``peak_reserved``, from the allocator rules alone.

    Weights W = 200 MiB; step 1 makes an activation block A = 50 MiB and an fp32 logits block F = 400 MiB and
    frees both; the optimizer then creates a state of 100 MiB. Best fit: A is too small, so the state is cut from
    F (split: the 300 MiB rest goes back to the pool). Step 2 asks for F's 400 MiB again: no cached block is that
    large (50 and 300 MiB), so a new segment is made: reserved = W + A + F + F = 1050 MiB for 700 MiB allocated.
    A 40 MiB state fits A instead, and step 2 finds F again: reserved = W + A + F = 650 MiB.
    """

    def step(state: int) -> tuple[tuple[int, int], ...]:
        return ((1, 200 * MiB), (2, 50 * MiB), (3, 400 * MiB), (2, 0), (3, 0), (4, state), (5, 400 * MiB), (5, 0))

    got = [replay_excess(step(s * MiB))[0] for s in (100, 40)]
    print(f"expected reserved 1050 and 650 MiB, got {[g // MiB for g in got]}")
    assert got == [1050 * MiB, 650 * MiB]


def test_states_spilling_into_two_logits_blocks_make_step_2_remake_both() -> None:
    """Mechanism 2 counted in whole blocks (reserve/full.py ``blocks_with_states``, ``relaid_counted``), from the
    allocator rules alone.

    Weights W = 200 MiB; step 1 frees a c·V·T logits block X = 100 MiB and three fp32 blocks F = 200 MiB; AdamW
    then creates seven 50 MiB states (torch/optim/adam.py ``_init_group``: exp_avg, exp_avg_sq per parameter).
    Best fit: two fill X (the smallest block that holds one), four fill the first F (each time its split rest is
    the smallest), the seventh is cut from the second F. Step 2's backward needs three F at once: one is whole,
    two are made anew, 400 MiB, where the states spilled past X are 250 MiB (min(S, 3F) = 350 MiB).
    Reserved = W + X + 3F + 2F = 1300 MiB for 1150 MiB allocated (W + states + 3F).
    """
    F, X = 200 * MiB, 100 * MiB
    step1 = ((1, 200 * MiB), (2, X), (3, F), (4, F), (5, F), (2, 0), (3, 0), (4, 0), (5, 0))
    states = tuple((10 + i, 50 * MiB) for i in range(7))
    step2 = ((20, F), (21, F), (22, F), (20, 0), (21, 0), (22, 0))
    reserved, allocated = replay_excess(step1 + states + step2)
    reached = blocks_with_states(7 * 50 * MiB, X, (F, F, F))
    print(f"expected reserved 1300 MiB, allocated 1150 MiB, 2 blocks reached; got {reserved // MiB}, "
          f"{allocated // MiB}, {reached}")  # fmt: skip
    assert (reserved, allocated, reached) == (1300 * MiB, 1150 * MiB, 2)


def test_activation_blocks_too_small_for_the_optimizer_stay_cached() -> None:
    """Activations too small for the optimizer (reserve/full.py ``activations_unused``): eight 16 MiB activation
    blocks freed after backward cannot hold the optimizer's 96 MiB per-parameter tensors (an fp32 state of a
    3072×8192 matrix): each gets a new segment, and at the optimizer's peak the 128 MiB of activation blocks are
    free but reserved: reserved = W + 8·16 + 4·96 MiB."""
    acts = tuple((10 + i, 16 * MiB) for i in range(8)) + tuple((10 + i, 0) for i in range(8))
    opt = tuple((100 + i, 96 * MiB) for i in range(4))
    reserved, allocated = replay_excess(((1, 200 * MiB), *acts, *opt))
    print(
        f"expected reserved {(200 + 128 + 384)} MiB, allocated {200 + 384} MiB; got {reserved // MiB}, "
        f"{allocated // MiB}"
    )
    assert (reserved, allocated) == ((200 + 128 + 384) * MiB, (200 + 384) * MiB)


def test_the_backward_workspace_in_a_logits_block_costs_step_2_a_segment() -> None:
    """The backward workspace (reserve/workspace.py ``workspace_lost``), from the allocator rules alone: forward leaves
    three fp32 logits blocks F = 400 MiB and 20 MiB blocks free; the backward thread's 32 MiB cuBLAS workspace
    (allocated once, never freed) fits only an F and is cut from it. Step 2's backward needs three F at once
    (log-softmax, two gradients): two are whole, the third is made anew. Reserved = 3F + 20 + F = 1620 MiB;
    without the workspace (or with a 40 MiB block free for it) 1220 (1260) MiB."""
    F = 400 * MiB

    def steps(spare: int, workspace: bool) -> tuple[tuple[int, int], ...]:
        first = ((1, F), (2, F), (3, F), (4, 20 * MiB), (5, spare), (1, 0), (2, 0), (3, 0), (4, 0), (5, 0))
        ws = ((6, 32 * MiB),) if workspace else ()
        second = ((7, F), (8, F), (9, F), (7, 0), (8, 0), (9, 0))
        return first + ws + second

    got = [replay_excess(steps(0, True))[0], replay_excess(steps(0, False))[0], replay_excess(steps(40 * MiB, True))[0]]
    print(f"expected 1620, 1220, 1260 MiB; got {[g // MiB for g in got]}")
    assert got == [1620 * MiB, 1220 * MiB, 1260 * MiB]


def test_a_shorter_batchs_lost_segment_stays_cached_when_a_longer_batch_comes() -> None:
    """The run-level rule behind the held terms, from the allocator rules alone: a run with dynamic padding whose
    first steps are short loses an fp32 logits block F = 400 MiB to the workspace, as above (1620 MiB reserved);
    a later, longer step needs three blocks G = 600 MiB at once. Best fit finds no cached block ≥ G (the cut F,
    the whole F, the 20 MiB ones), so it makes three G segments and keeps every F one: 1620 + 1800 = 3420 MiB,
    more than the longer step alone reserves (3G + 20 MiB + workspace = 1852 MiB) and more than the short steps
    alone (1620 MiB). The estimate of such a run is the most any shape it meets reserves on its own (reserve/runs.py
    ``held_reserved``: 1620 here); the longer step's segments on top of the kept ones are the order-dependent
    creep that ``vramledger simulate`` replays and the closed form leaves out."""
    F, G = 400 * MiB, 600 * MiB
    short = (
        (1, F), (2, F), (3, F), (4, 20 * MiB), (1, 0), (2, 0), (3, 0), (4, 0),
        (6, 32 * MiB), (7, F), (8, F), (9, F), (7, 0), (8, 0), (9, 0),
    )  # fmt: skip
    long = ((10, G), (11, G), (12, G), (13, 20 * MiB), (10, 0), (11, 0), (12, 0), (13, 0))
    run, _ = replay_excess(short + long)
    alone, _ = replay_excess(((6, 32 * MiB),) + long)
    print(f"expected run 3420 MiB, the long step alone 1852 MiB; got {run // MiB}, {alone // MiB}")
    assert (run, alone) == (3420 * MiB, 1852 * MiB)


def test_stranded_bytes_is_the_logits_block_without_checkpointing() -> None:
    """bf16 AMP, standard loss, SDPA, no checkpointing: what is stranded at the loss's peak is the c·V·T logits
    block alone (backward's layer transients come after the loss and split the freed logits blocks)."""
    cfg = {
        "model_type": "llama",
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 8000,
        "tie_word_embeddings": False,
    }
    m = model_spec_from_config(cfg, name="hand", source="test")
    train = TrainSpec(method=Method.LORA, micro_batch=2, seq_len=512)
    expected = 2 * 8000 * 2 * 512
    got = stranded_bytes(m, train, step_parts(m, train))
    print(f"expected {expected}, got {got}")
    assert got == expected


def test_eager_attention_strands_its_scores_too() -> None:
    """Eager attention's pre-softmax scores (c·nh·L² per sequence) are made in forward before the loss and are
    too small for its requests: they add to what is stranded (stranded grows by exactly that transient)."""
    cfg = {
        "model_type": "llama",
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 8000,
        "tie_word_embeddings": False,
    }
    m = model_spec_from_config(cfg, name="hand", source="test")
    sdpa = TrainSpec(method=Method.LORA, micro_batch=2, seq_len=512)
    eager = TrainSpec(method=Method.LORA, micro_batch=2, seq_len=512, attn=Attention.EAGER)
    diff = stranded_bytes(m, eager, step_parts(m, eager)) - stranded_bytes(m, sdpa, step_parts(m, sdpa))
    assert diff == 2 * 8 * 512 * 512 * 2  # c · nh · L² · B


def test_the_grid_covers_what_it_claims() -> None:
    """At least 80 traced configs: full, freeze, LoRA and DoRA; checkpointing on and off (freeze too); sdpa and eager;
    256 to 16k tokens; 0.5B to 8B catalog shapes; mixed and pure precision; four optimizers."""
    recs = _records()
    g = _run_grid()
    rows = {g.config_id(r): r for r in g.GRID}
    assert len(recs) >= 80 and all(r["id"] in rows for r in recs)
    used = [rows[r["id"]] for r in recs]
    assert {r.method for r in used} >= {"full", "freeze", "lora", "dora"}
    assert {r.ckpt for r in used if r.method == "freeze"} == {True, False}
    assert {r.ckpt for r in used} == {True, False} and {r.attn for r in used} >= {"sdpa", "eager"}
    assert min(r.seq for r in used) == 256 and max(r.seq for r in used) == 16384
    assert {"qwen2.5-0.5b", "llama-3-8b", "qwen3-8b"} <= {r.name for r in used}
    assert {r.precision for r in used} >= {"bf16-mixed", "bf16-true", "fp16-mixed", "fp32"}
    assert {r.optimizer for r in used} >= {"adamw_torch", "adamw_torch_fused", "sgd", "adafactor"}


def test_llama_3_2_3b_full_fine_tuning_within_3_percent() -> None:
    """The case that showed the old closed form far off: Llama-3.2-3B, full, bf16-true, 4 × 768, sdpa, no
    checkpointing. The replay of the step at 4 × 768 reserves ~1.8 GB over allocated (the old estimate put the
    11.4 GiB of AdamW states there: it counted the states' blocks as cached when they are allocated). That step is
    what a run whose every batch is 4 × 768 meets (``packing``: the trace builds the packed 4-D mask on fake
    tensors, trace/shims.py, and the estimate's allocated matches it, 33.00 GiB). A run with dynamic padding meets
    shorter batches too: at 4 × 720 the replay alone reserves 39.27 GiB (runs.jsonl; 40.09 with a padded row's mask,
    runs_padded.jsonl), and that run's estimate
    is within 3% of it (held at 4 × 736, the last shape where the MLP block's segment is under an MLP matrix's 48 MiB
    tensors: analytic/reserve/held_activations.py)."""
    cid = "llama-3.2-3b/full/b4/L768/nockpt/sdpa/bf16-true"
    rec = next(r for r in _records() if r["id"] == cid)
    replay = rec["trace"]["replay_peak_reserved"]
    excess = replay - rec["trace"]["replay_peak_allocated"]
    model, train = _specs(cid)
    packed = _analytic_reserved(model, dataclasses.replace(train, packing=True))
    run = _envelopes()[cid]
    padded = _analytic_reserved(model, train)
    print(
        f"replay reserved {replay / 1e9:.2f} GB (+{excess / 1e9:.2f} GB over allocated), analytic (packed) "
        f"{packed / 1e9:.2f} GB ({packed / replay - 1:+.1%}); a padded run's envelope {run / 1e9:.2f} GB, analytic "
        f"{padded / 1e9:.2f} GB ({padded / run - 1:+.1%})"
    )
    assert 1.5e9 < excess < 2.0e9
    assert abs(packed / replay - 1) <= TOLERANCE
    assert abs(padded / run - 1) <= TOLERANCE


# The grid's packed rows whose MLP block c·I·T is under 10 MiB (kMinLargeAlloc), bf16-mixed (c = 2), full fine-tuning
# of Llama-shaped layers with foreach AdamW and SDPA, no checkpointing: Qwen3-0.6B 2·3072·1024 = 6 MiB, Qwen3-1.7B
# 2·6144·256 = 3 MiB, the toy 2·1376·256 = 0.67 MiB. Every other such row's c·I·T is 10 MiB or more.
SINGLE_REPLAYED = (
    "qwen3-0.6b/full/b1/L1024/nockpt/sdpa",
    "qwen3-1.7b/full/b1/L256/nockpt/sdpa",
    "tiny/full/b1/L256/nockpt/sdpa",
)


@pytest.mark.parametrize("cid", SINGLE_REPLAYED)
def test_one_gpu_replays_the_two_steps_without_a_bucket(cid: str) -> None:
    """On one GPU the packed estimate of these rows is the two steps replayed (analytic/distributed/ddp_reserve.py),
    stated as one GPU's (no DDP bucket). Against the traced replay: within 3%, or, for the toy, under it by no more
    than what the trace's step 2 makes after its backward, where the replay stops (replay_causes.jsonl
    ``made_in_step_2``: its optimizer's 16 MiB foreach temporary and two 2 MiB small-pool segments)."""
    from vramledger.analytic.distributed.ddp_reserve import SINGLE_SOURCE, SOURCE

    model, train = _specs(cid)
    led = estimate(model, dataclasses.replace(train, packing=True))
    sources = {i.source for i in led.items if i.category is Category.ALLOCATOR_RESERVE}
    rec = next(r for r in _records() if r["id"] == cid)
    replay, got = (
        rec["trace"]["replay_peak_reserved"],
        _analytic_reserved(model, dataclasses.replace(train, packing=True)),
    )
    print(f"{cid}: replay {replay / MiB:.0f} MiB, analytic {got / MiB:.0f} MiB ({got / replay - 1:+.1%})")
    assert SINGLE_SOURCE in sources and SOURCE not in sources
    if cid in PACKED_MISSES:
        made = sum(f["bytes"] for f in _causes()[cid]["made_in_step_2"])
        assert replay - made <= got < replay
    else:
        assert abs(got / replay - 1) <= TOLERANCE


@pytest.mark.parametrize("rec", _records(), ids=lambda r: r["id"])
def test_within_3_percent_of_the_committed_trace_replay(rec: dict[str, Any]) -> None:
    _check_against_the_replay(rec, packed=False)


@pytest.mark.parametrize("rec", _records(), ids=lambda r: r["id"])
def test_packed_within_3_percent_of_the_single_shape_replay(rec: dict[str, Any]) -> None:
    """A packed run meets the traced shape at every step: its estimate against that shape's replay."""
    _check_against_the_replay(rec, packed=True)


def _check_against_the_replay(rec: dict[str, Any], *, packed: bool) -> None:
    model, train = _specs(rec["id"])
    train = dataclasses.replace(train, packing=packed)
    misses = PACKED_MISSES if packed else KNOWN_MISSES
    expected, which = _reference(rec, train)
    got = _analytic_reserved(model, train)
    gap = got / expected - 1
    print(f"{rec['id']}: {which} reserved {expected / 2**30:.3f} GiB, analytic {got / 2**30:.3f} GiB ({gap:+.1%})")
    if rec["id"] in misses:
        assert abs(gap) > TOLERANCE, "no longer a miss: take it out of " + (
            "PACKED_MISSES" if packed else "KNOWN_MISSES"
        )
        pytest.xfail(f"{gap:+.1%} ({misses[rec['id']]}); {_measured(rec['id'])}")
    assert abs(gap) <= TOLERANCE


# Setups where the switching mechanisms apply (reserve/runs.py ``switches_on``): adapters (the workspace), full without
# checkpointing (the activations), tied embeddings (Llama-3.2-1B, Qwen2.5-0.5B) with full fine-tuning.
switching_specs = st.builds(
    TrainSpec,
    method=st.sampled_from([Method.FULL, Method.LORA]),
    precision=st.sampled_from([Precision.BF16_MIXED, Precision.BF16, Precision.FP32]),
    micro_batch=st.integers(1, 12),
    seq_len=st.integers(1, 3000),
    grad_ckpt=st.booleans(),
    attn=st.sampled_from([Attention.EAGER, Attention.SDPA]),
)


@settings(max_examples=60, deadline=None)
@example(
    train=TrainSpec(method=Method.FULL, precision=Precision.BF16, micro_batch=4, seq_len=720, grad_ckpt=False),
    model="llama-3.2-3b",
    db=0,
    dl=48,
)  # the activations held at 4 × 720 switch off by 4 × 768 (runs.jsonl: 39.27 → 34.67 GiB for the single shape)
@example(
    train=TrainSpec(method=Method.FULL, precision=Precision.BF16, micro_batch=4, seq_len=736, grad_ckpt=False),
    model="llama-3.2-3b",
    db=0,
    dl=1,
)  # ... at the MLP block's segment: 4 × 736 → 737 (held_activations.py)
@example(
    train=TrainSpec(method=Method.LORA, micro_batch=1, seq_len=960, grad_ckpt=False), model="llama-3.2-1b", db=0, dl=64
)  # the workspace's lost logits block: 6.40 → 6.08 GiB for the single shape
@example(
    train=TrainSpec(method=Method.FULL, precision=Precision.BF16, micro_batch=3, seq_len=1149, grad_ckpt=True),
    model="qwen2.5-0.5b",
    db=0,
    dl=1,
)  # full: the backward workspace's fp32 block, made again whole, stops at 3 × 1150 (10.01 → 9.91 GiB single shape)
@example(
    train=TrainSpec(method=Method.FULL, precision=Precision.FP32, micro_batch=2, seq_len=387, grad_ckpt=False),
    model="qwen2.5-0.5b",
    db=0,
    dl=1,
)  # the fp32 probabilities' 16.0 MiB blocks get 18 MiB segments at 388, which the 16.6 MiB MLP tensors fit
@example(
    train=TrainSpec(method=Method.LORA, precision=Precision.FP32, micro_batch=1, seq_len=511, grad_ckpt=True),
    model="gemma-3-1b",
    db=0,
    dl=1,
)  # SDPA's math kernel only below the 512-token sliding window (79 MiB less for the single shape at 512)
@example(
    train=TrainSpec(method=Method.LORA, precision=Precision.BF16_MIXED, micro_batch=1, seq_len=52, grad_ckpt=True),
    model="qwen2.5-0.5b",
    db=0,
    dl=1,
)  # forward's cross-entropy the peak: a rest beside the third fp32 block, not live there, fell as the block grew
@given(
    train=switching_specs,
    model=st.sampled_from(["llama-3.2-1b", "qwen2.5-0.5b", "llama-3.2-3b"]),
    db=st.integers(0, 4),
    dl=st.integers(0, 1024),
)
def test_reserved_never_falls_as_batch_or_length_grows(train: TrainSpec, model: str, db: int, dl: int) -> None:
    """The single shape's reserve falls where a switching mechanism stops (the replay shows it); a run with
    dynamic padding keeps the segments of the shorter shapes it meets, so its estimate's reserved never falls as the
    micro-batch or the length grows (a packed run's follows its one shape, as the replay does)."""
    m = resolve_model(model)
    more = dataclasses.replace(train, micro_batch=train.micro_batch + db, seq_len=train.seq_len + dl)
    assert _analytic_reserved(m, more) >= _analytic_reserved(m, train)


@settings(max_examples=60, deadline=None)
@example(
    train=TrainSpec(method=Method.FULL, precision=Precision.BF16, micro_batch=4, seq_len=1533, grad_ckpt=False),
    model="mistral-7b-v0.3",
)  # the two steps' replay at 4 × 1533 makes 5.4% more than the padded run's closed forms hold (spill.py)
@given(train=switching_specs, model=st.sampled_from(["llama-3.2-1b", "qwen2.5-0.5b", "llama-3.2-3b"]))
def test_a_packed_run_never_reserves_more_than_a_padded_one(train: TrainSpec, model: str) -> None:
    """A run with dynamic padding meets the packed run's shape B × L too (its longest batches), with the padded
    batch's mask and repeated K/V on top, and keeps the segments of its shorter batches: its estimate is at least
    the packed run's, whose mechanisms are those on at B × L alone."""
    m = resolve_model(model)
    packed = dataclasses.replace(train, packing=True)
    assert _analytic_reserved(m, packed) <= _analytic_reserved(m, train)


def test_reserved_is_flat_across_training_phases() -> None:
    """From step 2 on the cache built by step 1 is still held (no empty_cache): the trace replay reports the same
    reserved at the forward, backward and optimizer peaks (bench/reserve/replay_grid.jsonl, e.g. Llama-3.2-1B
    LoRA: 10.13 GiB in every phase), so the analytic ledger does too."""
    cid = "llama-3.2-1b/lora/b2/L2048/ckpt/sdpa"
    rec = next(r for r in _records() if r["id"] == cid)
    traced = {rec["trace"]["phases"][p.value]["reserved"] for p in TRAIN}
    print("trace reserved by phase:", traced)
    assert len(traced) == 1
    led = estimate(*_specs(cid))
    assert len({led.reserved(p) for p in TRAIN}) == 1
    assert all(led.bytes_of(Category.ALLOCATOR_RESERVE, p) >= 0 for p in TRAIN)
