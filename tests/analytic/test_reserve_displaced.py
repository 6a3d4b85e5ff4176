"""Step 1's optimizer states displacing step 2's saved activations into the logits chain (full fine-tuning without
checkpointing, analytic/reserve/spill.py ``displaced_remade`` and ``two_steps_reserve``).

Truths used:
- a hand-built allocation sequence whose reserved memory follows from CUDACachingAllocator.cpp's rules alone
  (``get_free_block``: the smallest free block at least as large; ``alloc_found_block`` splits it; blocks of different
  segments never merge), replayed through ``allocator/model.py``, the port;
- bench/reserve/replay_states.jsonl and replay_grid.jsonl: real transformers steps traced on fake tensors and replayed
  through the same port (what step 2 made again, the peak reserved).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from tests.analytic.test_reserve import TRAIN, _records, _specs
from vramledger.analytic.activations import sdpa_math
from vramledger.analytic.reserve import replay_excess
from vramledger.analytic.reserve.full import blocks_with_states
from vramledger.analytic.reserve.spill import displaced_remade, two_steps_reserve
from vramledger.analytic.step import step_parts
from vramledger.specs import Method, Optimizer, Precision, TrainSpec

MiB = 2**20
ROOT = Path(__file__).resolve().parents[2]
STATES = ROOT / "bench" / "reserve" / "replay_states.jsonl"


def test_states_in_the_smaller_segments_push_step_2s_largest_activations_into_an_fp32_block() -> None:
    """The mechanism from the allocator rules alone.

    Step 1's forward saves, per layer, a 16 MiB fp32 norm input and a 22 MiB MLP block (each ≥ 10 MiB: a segment of
    its own), four layers; its loss leaves an X = 50 MiB c·V·T block and three F = 200 MiB fp32 blocks; backward frees
    all of them. AdamW then creates four 11 MiB states: best fit cuts each from a 16 MiB segment (the smallest that
    holds one; the 5 MiB rest holds no second). S = 44 MiB is under X: counted as if every state sat in the chain,
    the states reach no fp32 block (``blocks_with_states`` = 0).

    Step 2's forward asks again for 16, 22, 16, 22, ... MiB. The first norm input finds no 16 MiB block whole and takes
    a 22 MiB segment (the next larger), whose MLP block then takes the next 22 MiB segment; by the third layer none
    is left, and its two blocks are cut from X (16 + 22 of its 50 MiB), the fourth layer's from F (38 MiB). The
    loss's c·V·T logits are cut from F's rest and freed before the gradients; the three fp32 requests at its peak find
    two whole blocks and F, cut: a fourth 200 MiB segment. Reserved 802 + 200 = 1002 MiB, where the same steps
    without the states reserve 802 MiB: 76 MiB of activations displaced by 44 MiB of states cost a 200 MiB block."""
    X, F = 50 * MiB, 200 * MiB
    layers = [(10 + 2 * i, 16 * MiB, 11 + 2 * i, 22 * MiB) for i in range(4)]

    def forward(base: int) -> tuple[tuple[int, int], ...]:
        return tuple(x for a, s, b, t in layers for x in ((base + a, s), (base + b, t)))

    def loss(base: int) -> tuple[tuple[int, int], ...]:  # logits, copy, log-softmax; both freed; two gradients
        return ((base + 1, X), (base + 2, F), (base + 3, F), (base + 1, 0), (base + 2, 0), (base + 4, F), (base + 5, F))

    step1 = forward(0) + loss(0) + tuple((i, 0) for i in (3, 4, 5)) + tuple((i, 0) for i, _ in forward(0))

    def run(states: int) -> tuple[int, int]:
        opt = tuple((100 + k, 11 * MiB) for k in range(states))
        return replay_excess(step1 + opt + forward(200) + loss(200))

    (displaced, allocated), (alone, _) = run(4), run(0)
    counted = blocks_with_states(4 * 11 * MiB, X, (F, F, F))
    print(f"expected 1002 and 802 MiB reserved, 0 blocks counted; got {displaced // MiB}, {alone // MiB}, {counted}")
    assert (displaced, alone, counted) == (1002 * MiB, 802 * MiB, 0)
    assert allocated == (44 + 4 * 38 + 3 * 200) * MiB  # states, step 2's saved blocks, the loss peak's three F


def test_a_layer_freed_node_by_node_leaves_the_mlp_rest_to_a_state_and_step_2_remakes_the_mlp_block() -> None:
    """Why the backward's order matters (spill.py ``_backward``), from the allocator rules alone.

    Forward: a 76 MiB MLP block M (a segment of its own), and a 40 MiB fp32 norm temporary freed, whose segment A then
    holds two 20 MiB norm outputs, n_in (q's input) and n_post (gate's). Backward frees M (a later layer's), then makes
    the layer's 47.5 MiB MLP gradient G (best fit: only M holds it; a 28.5 MiB rest), o's and q's 20 MiB gradients;
    AdamW then makes one 20 MiB q state, ``zero_grad`` frees the gradients, step 2 asks for 76 MiB again.

    Node by node (autograd releases a node's saved tensors once it has run): n_post is freed before o's gradient, which
    takes that 20 MiB half of A (smaller than M's rest), n_in before q's, which takes the other half; the state then
    takes M's rest, and after ``zero_grad`` M holds a state: step 2 makes a 76 MiB segment, 192 MiB in all. Freeing the
    layer after its gradients: o's gradient takes M's rest, q's a segment of its own (20 MiB: nothing else is free),
    the state A (freed whole, 40 MiB, the smallest then); M is whole after ``zero_grad`` and serves step 2: 136 MiB."""
    M, A, G, Q = 76 * MiB, 40 * MiB, 95 * MiB // 2, 20 * MiB
    forward = ((1, M), (2, A), (2, 0), (3, Q), (4, Q))  # M; A's temporary, freed; n_in, n_post cut from A
    node_by_node = ((1, 0), (10, G), (4, 0), (11, Q), (3, 0), (12, Q))
    whole_layer = ((1, 0), (10, G), (11, Q), (12, Q), (3, 0), (4, 0))
    after = ((20, Q), (10, 0), (11, 0), (12, 0), (30, M))  # the q state; zero_grad; step 2's MLP block

    def reserved(backward: tuple[tuple[int, int], ...]) -> int:
        return replay_excess(forward + backward + after)[0]

    got = reserved(node_by_node), reserved(whole_layer)
    print(f"expected 192 and 136 MiB reserved; got {got[0] // MiB}, {got[1] // MiB}")
    assert got == (192 * MiB, 136 * MiB)


def _modelled() -> list[dict[str, Any]]:
    states = {r["id"]: r for r in map(json.loads, STATES.read_text().splitlines())}
    out = []
    for rec in _records():
        if rec["id"] not in states:
            continue
        m, t = _specs(rec["id"])
        t = dataclasses.replace(t, packing=True)
        # the fp32 layers of SDPA's math kernel are held by test_reserve_math_layer.py (within 3%: their 3.5 and 7 MiB
        # residual requests share 20 MiB segments)
        if displaced_remade(m, t, step_parts(m, t)) is not None and not sdpa_math(m, t):
            out.append(rec | {"states": states[rec["id"]]})
    return out


# Configs of the grid whose two steps replayed reserve more than 1% from the traced steps' replay, with the cause.
SEQUENCE_MISSES = {
    "tiny/full/b2/L4096/nockpt/sdpa": (
        "−1.8% (1742 against 1774 MiB): the 2-layer toy's V·H tensors are under 10 MiB (its vocabulary is 8,000), so "
        "lm_head's 7.8 MiB autocast copy gets a 20 MiB segment of its own in the trace where the sequence cuts it "
        "from a freed block; the other 12 MiB in how its blocks under 10 MiB share segments (20 MiB ones, and the "
        "small pool's 2 MiB ones); step 2 makes the same one fp32 block again"
    ),
}


@pytest.mark.parametrize("rec", _modelled(), ids=lambda r: r["id"])
def test_the_two_steps_replayed_against_the_traced_steps(rec: dict[str, Any]) -> None:
    """Where the sequence is written out (Llama-shaped layers), the two steps replayed reserve within 1% of the
    traced steps' replay at step 2's peak, and step 2 makes again what the trace's step 2 makes to within one fp32
    logits block (all but Qwen2.5-1.5B bf16-mixed 4 × 1024 exactly: there 4.37 blocks against 4.34, the MLP segments
    the states sit in; it made 5.16 and 1.7 GiB less in step 1 with its residual stream in c bytes and each layer
    freed after its seven gradients: amp_layer.py, spill.py ``_backward``). Under 10 MiB residual requests too (the
    mid toy at 2 × 1024 and 4 × 1024: the trace's two and three fp32 blocks made again)."""
    m, t = _specs(rec["id"])
    t = dataclasses.replace(t, packing=True)
    p = step_parts(m, t)
    F = rec["states"]["fp32_block"]
    made = (displaced_remade(m, t, p) or 0) / F
    reserved, replay = two_steps_reserve(m, t, p) or 0, rec["trace"]["replay_peak_reserved"]
    traced = rec["states"]["made_in_step_2_fp32_blocks"]
    gap = reserved / replay - 1
    print(f"{rec['id']}: reserved {reserved / 2**30:.2f} GiB against {replay / 2**30:.2f} ({gap:+.1%}); step 2 makes "
          f"{made:.2f} fp32 blocks against {traced:.2f}")  # fmt: skip
    assert abs(made - traced) < 1
    if rec["id"] in SEQUENCE_MISSES:
        assert abs(gap) > 0.01, "no longer a miss: take it out of SEQUENCE_MISSES"
        pytest.xfail(SEQUENCE_MISSES[rec["id"]])
    assert abs(gap) <= 0.01


def test_a_trained_layers_input_lives_to_the_layers_end() -> None:
    """What the sequence takes from transformers' ``LlamaModel.forward`` (spill.py ``_forward``, forward_cache.py
    ``_Layer.held_by_caller``), in a real trace: with trained bf16 weights nothing saves the residual stream (each
    RMSNorm saves its fp32 cast), so each block lives while Python holds it. A layer's input is freed only after the
    layer's second residual sum (``hidden_states = decoder_layer(hidden_states, ...)`` rebinds it once the layer
    returns), and the embedding's output only after the final norm's (``inputs_embeds`` is held to the model's
    return). Freed at the attention's residual sum instead, as the LoRA sequence has it, the mid toy's two steps
    replayed made one fp32 logits block again in step 2 where its trace makes two (docs/reserve.md, "Under 10 MiB")."""
    pytest.importorskip("transformers")
    from tests.trace._trace_tiny import TINY
    from vramledger.catalog.hfconfig import model_spec_from_config
    from vramledger.specs import Method, Precision, TrainSpec
    from vramledger.trace import trace_events

    cfg = TINY["llama"]
    model = model_spec_from_config(cfg, name="tiny-llama", source="tests/trace/_trace_tiny.py")
    spec = TrainSpec(method=Method.FULL, precision=Precision.BF16, micro_batch=2, seq_len=48, packing=True)
    events = [e for e in trace_events(model, spec, config=cfg) if e.step == 1 and e.phase.value == "forward"]
    allocated = {e.storage: (k, e) for k, e in enumerate(events) if e.kind == "alloc"}
    freed = {e.storage: k for k, e in enumerate(events) if e.kind == "free"}
    sums = {  # each decoder layer's two residual sums (``add`` on the module of the layer itself)
        n: [k for k, e in allocated.values() if e.op == "add" and e.module == f"model.layers.{n}"] for n in (0, 1)
    }
    embedded = next(s for s, (_, e) in allocated.items() if e.module == "model.embed_tokens")
    norm = max(k for k, e in allocated.values() if e.module == "model.norm")
    layer1_input = next(s for s, (k, _) in allocated.items() if k == sums[0][1])
    print(f"residual sums {sums}; layer 1's input freed at {freed[layer1_input]}; the embedding's output freed at "
          f"{freed[embedded]}, the final norm's last request at {norm}")  # fmt: skip
    assert all(len(v) == 2 for v in sums.values())
    assert freed[layer1_input] > sums[1][1]
    assert freed[embedded] > norm


TWO_STEPS = ROOT / "bench" / "reserve" / "two_steps.jsonl"
# Shapes of two_steps.jsonl the packed estimate still misses by more than 3%, with what the trace's replay shows.
TWO_STEPS_MISSES = {
    "qwen2.5-0.5b/full/b1/L512/nockpt/sdpa/bf16-mixed/adamw_torch/packed": (
        "not replayed: at 512 tokens the MLP's fp32 per-parameter tensors (16.6 MiB) do not fit its c·I·T blocks "
        "(4.75 MiB; held_activations.py mlp_tensors_unfit), and the closed forms are under by as much as before the "
        "two steps were replayed under 10 MiB (bf16-true 1 × 256, the same regime: −0.1%)"
    ),
    # gemma-3-1b where the MLP-fit condition leaves the shape to the closed forms (gemma_layer.py's replay not used;
    # with the condition lifted it is +0.7%, −0.5% and −0.5% of these traces, but −5.0% at bf16-mixed 1 × 1024, and
    # −0.2% to −5.9% on the six Llama/Qwen shapes of this file the condition also holds back)
    "gemma-3-1b/full/b1/L1024/nockpt/sdpa/bf16-true/adamw_torch/packed": (
        "not replayed: the 13.5 MiB c·I·T blocks (14 MiB segments) are smaller than an MLP matrix's 15.2 MiB "
        "per-parameter tensor, and term 3 (held_activations.py optimizer_peak_bound) is the maximum: step 1's "
        "optimizer peak 9.38 + activations_cached 2.34 + three 1 GiB fp32 blocks made again = 14.71 GiB. The trace's "
        "step 1 leaves 1.42 GiB of its forward's segments free there (1.33 in the MLP's 14 MiB ones), and makes the "
        "same three blocks in step 2 (13.98): 66 of the 78 MLP gradients were cut from the 20 MiB segments the 4.5 MiB "
        "fp32 norm blocks shared, whole once backward freed them, where activations_cached lets only q's, k's, v's "
        "and o's tensors into the forward's segments (_room counts a block's own bytes)"
    ),
    "gemma-3-1b/full/b4/L512/nockpt/sdpa/bf16-mixed/adamw_torch/packed": (
        "not replayed: the fp32 MLP tensors (30.4 MiB) do not fit the 27 MiB c·I·T blocks; term 3 is the maximum, "
        "as 2 × 1024 bf16-mixed's (the same T, the same figure)"
    ),
    "gemma-3-1b/full/b2/L1024/nockpt/sdpa/bf16-mixed/adamw_torch/packed": (
        "not replayed: the fp32 MLP tensors (30.4 MiB) do not fit the 27 MiB c·I·T blocks; term 3 = step 1's "
        "optimizer peak 18.69 + activations_cached 6.08 + six 1 GiB fp32 blocks made again = 30.77 GiB. The trace "
        "makes the same six in step 2, but its step 1 leaves 7.0 GiB of the forward's segments free at the optimizer "
        "peak (2.0 in 20 MiB segments made by 9 MiB `mul` blocks, 1.46 + 0.73 + 0.73 in the MLP's 28 MiB ones), 0.95 "
        "more than activations_cached; the two steps replayed with the condition lifted are −0.5% here"
    ),
}


def two_steps_train(rec: dict[str, Any]) -> TrainSpec:
    """The packed full fine-tuning setup of a bench/reserve/two_steps.jsonl record."""
    return TrainSpec(
        method=Method.FULL,
        precision=Precision(rec["precision"]),
        optimizer=Optimizer(rec["optimizer"]),
        micro_batch=rec["micro_batch"],
        seq_len=rec["seq_len"],
        grad_ckpt=False,
        packing=True,
    )


def _two_steps() -> list[dict[str, Any]]:
    return [json.loads(line) for line in TWO_STEPS.read_text().splitlines()] if TWO_STEPS.exists() else []


@pytest.mark.parametrize("rec", _two_steps(), ids=lambda r: r["id"])
def test_packed_runs_within_3_percent_of_their_traced_replay(rec: dict[str, Any]) -> None:
    """Packed full fine-tuning shapes beyond the grid (bench/reserve/run_two_steps.py: traced two steps replayed through
    the allocator model): the packed estimate, which takes the two steps replayed where they are written out, within
    3% of the trace's replay (the misses listed with what the trace shows; before the replay was used, 13 of 21
    foreach shapes and 3 of 5 fused ones were within)."""
    from vramledger.analytic import estimate
    from vramledger.catalog import resolve_model

    m, t = resolve_model(rec["model"]), two_steps_train(rec)
    led = estimate(m, t)
    got, replay = max(led.reserved(p) for p in TRAIN), rec["replay_peak_reserved"]
    gap = got / replay - 1
    print(f"{rec['id']}: replay {replay / 2**30:.2f} GiB, estimate {got / 2**30:.2f} GiB ({gap:+.1%})")
    if rec["id"] in TWO_STEPS_MISSES:
        assert abs(gap) > 0.03, "no longer a miss: take it out of TWO_STEPS_MISSES"
        pytest.xfail(f"{gap:+.1%}: {TWO_STEPS_MISSES[rec['id']]}")
    assert abs(gap) <= 0.03
