"""Full fine-tuning in fp32 (c = 4): the logits chain, the gradients it holds before the states, the tied block.

Truths used: hand-built allocation sequences replayed through ``allocator/model.py`` (the port of
CUDACachingAllocator.cpp), and the replays of real traces committed in bench/reserve/ (replay_states.jsonl: where
step 1's gradients and states land and what step 2 makes again; runs.jsonl: the same configs at other lengths).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.analytic.test_reserve import _specs
from vramledger.analytic import estimate
from vramledger.analytic.reserve import logits_blocks, replay_excess
from vramledger.analytic.reserve.full import blocks_with_states, gradients_in_chain, relaid_counted
from vramledger.analytic.reserve.load_residue import optimizer_tails
from vramledger.analytic.reserve.runs import switches_on
from vramledger.analytic.reserve.shape import states_beside_chain, step1_loss_reserve, workspace_in_chain
from vramledger.analytic.step import step_parts
from vramledger.catalog import resolve_model
from vramledger.ledger import Phase
from vramledger.specs import Method, Optimizer, Precision, TrainSpec

MiB = 2**20
ROOT = Path(__file__).resolve().parents[2]
STATES = ROOT / "bench" / "reserve" / "replay_states.jsonl"
RUNS = ROOT / "bench" / "reserve" / "runs.jsonl"
K_ROUND_LARGE = 2 * MiB  # CUDACachingAllocator.cpp kRoundLarge: a segment of ≥ 10 MiB is its request rounded to it


def _states() -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in map(json.loads, STATES.read_text().splitlines())}


FP32 = [cid for cid in _states() if cid.split("/")[6:7] == ["fp32"]]
CKPT_PAST_HEAD = [
    "qwen2.5-0.5b/full/b8/L512/ckpt/sdpa/fp32/adamw_torch_fused",
    "qwen2.5-0.5b/full/b4/L512/ckpt/sdpa/fp32",
]


def test_the_fp32_configs_are_recorded() -> None:
    assert len(FP32) >= 5 and set(CKPT_PAST_HEAD) <= set(FP32)


@pytest.mark.parametrize("cid", FP32)
def test_the_fp32_chain_is_three_4VT_blocks_as_the_replay_makes_them(cid: str) -> None:
    """With c = 4 ``logits.float()`` is the logits themselves: step 1 makes three segments of 4·V·T (rounded to
    2 MiB) for the loss (lm_head's ``mm``, ``_log_softmax``, ``_log_softmax_backward_data``), not two, and no
    c·V·T one."""
    rec = _states()[cid]
    F = rec["fp32_block"]
    made = [b["made_by"] for b in rec["states_in_logits_blocks"] if F <= b["bytes"] < F + K_ROUND_LARGE]
    model, train = _specs(cid)
    chain = logits_blocks(model, train)
    print(f"{cid}: replay's 4·V·T segments {made}; counted {chain}")
    assert sorted(made) == ["_log_softmax", "_log_softmax_backward_data", "mm"]
    assert chain == (F, F, F)


def test_gradients_in_a_logits_block_push_the_states_into_one_more() -> None:
    """``gradients_in_chain`` with ``relaid_counted``, from the allocator rules alone.

    Weights W = 200 MiB; step 1 frees three fp32 logits blocks F = 300 MiB and one recomputed layer's 100 MiB
    transient block. Backward then makes gradients of 100 and 150 MiB: best fit (``get_free_block``: the smallest
    free block at least as large) puts the first in the 100 MiB block and cuts the second from an F, whose 150 MiB
    rest goes back to the pool (``should_split``). AdamW's five 60 MiB states come next: two fill the rest (30 MiB
    left), three are cut from a second F. ``zero_grad`` frees the gradients; step 2 needs three F at once: one is
    whole, two are made anew. Reserved = W + 100 + 3F + 2F = 1800 MiB for 1400 MiB allocated (W + states + 3F).
    Counting the 150 MiB of gradients the outside block cannot hold before the states reaches two blocks
    (``blocks_with_states``(300 + 150)); the states alone (300 MiB) reach one.
    """
    F = 300 * MiB
    step1 = ((1, 200 * MiB), (2, F), (3, F), (4, F), (5, 100 * MiB), (2, 0), (3, 0), (4, 0), (5, 0))
    grads = ((6, 100 * MiB), (7, 150 * MiB))
    states = tuple((10 + i, 60 * MiB) for i in range(5))
    step2 = ((6, 0), (7, 0), (20, F), (21, F), (22, F), (20, 0), (21, 0), (22, 0))
    reserved, allocated = replay_excess(step1 + grads + states + step2)
    G_in = 250 * MiB - 100 * MiB  # the gradients less the room outside the chain
    counted = blocks_with_states(300 * MiB + G_in, 0, (F, F, F))
    alone = blocks_with_states(300 * MiB, 0, (F, F, F))
    print(f"expected 1800 / 1400 MiB, two blocks made again; got {reserved // MiB} / {allocated // MiB}, "
          f"counted {counted} (states alone {alone})")  # fmt: skip
    assert (reserved, allocated) == (1800 * MiB, 1400 * MiB)
    assert (reserved - (200 + 100 + 900) * MiB) // F == counted == 2 and alone == 1


@pytest.mark.parametrize("cid", CKPT_PAST_HEAD)
def test_the_count_with_the_gradients_is_what_step_2_makes_again(cid: str) -> None:
    """Under checkpointing with c = 4 (Qwen2.5-0.5B, 4·V·T above the V·H gradient): the replay holds most gradients
    in the fp32 logits blocks when the states are made, and step 2 makes all three blocks again. The count with
    the gradients the room outside the chain cannot hold (``gradients_in_chain``) reaches three blocks; without
    them it reaches two on the 8 × 512 config (the −16% the estimate had)."""
    rec = _states()[cid]
    model, train = _specs(cid)
    p = step_parts(model, train)
    led = estimate(model, train)
    loss_peak = max(led.allocated(Phase.FORWARD), led.allocated(Phase.BACKWARD))
    grads = gradients_in_chain(model, train, p, step1_loss_reserve(model, train, p, loss_peak))
    beside, ws = states_beside_chain(model, train, p), workspace_in_chain(model, train, p)
    F = rec["fp32_block"]
    counted = relaid_counted(model, train, p, beside, ws, grads) // F
    print(f"{cid}: gradients in the chain: replay {rec['gradients_in_logits_blocks'] / 2**30:.2f} GiB, counted "
          f"{grads / 2**30:.2f} GiB; fp32 blocks made again: replay {rec['made_in_step_2_fp32_blocks']}, counted "
          f"{counted} (without the gradients {relaid_counted(model, train, p, beside, ws) // F})")  # fmt: skip
    assert rec["gradients_in_logits_blocks"] > 0 and grads > 0
    assert counted == rec["made_in_step_2_fp32_blocks"] == 3


def test_no_gradients_are_counted_in_the_chain_without_checkpointing_or_below_fp32() -> None:
    """Without checkpointing the saved activations backward frees hold the gradients, and with c < 4 R1 leaves out
    forward segments that hold them (full.py ``gradients_in_chain``): nothing is counted there."""
    model, train = _specs("qwen2.5-0.5b/full/b2/L1024/nockpt/sdpa/fp32")
    bf16, mixed = _specs("qwen2.5-0.5b/full/b8/L512/ckpt/sdpa")
    assert gradients_in_chain(model, train, step_parts(model, train), 0) == 0
    assert gradients_in_chain(bf16, mixed, step_parts(bf16, mixed), 0) == 0
    fp32, ckpt = _specs("qwen2.5-0.5b/full/b8/L512/ckpt/sdpa/fp32/adamw_torch_fused")
    assert gradients_in_chain(fp32, ckpt, step_parts(fp32, ckpt), 0) > 0  # no room: every gradient counted


@pytest.mark.parametrize(
    "cid", ["llama-3.2-1b/full/b2/L1024/ckpt/sdpa/fp32", "llama-3.2-1b/full/b4/L512/ckpt/sdpa/fp32/adamw_torch_fused"]
)
def test_a_shorter_fp32_shape_makes_the_tied_block_under_checkpointing(cid: str) -> None:
    """Llama-3.2-1B (tied) in fp32 under checkpointing, 2048 tokens (4·V·T = V·H·b): the most a shorter length
    reserves on its own is one V·H fp32 block over the length itself (runs.jsonl: 2 × 992 and 4 × 496, where
    4·V·T < V·H·b), the block ``tied_gradient_block`` counts, and ``switches_on`` applies it where 4·T < H·b
    (b = 4: under 2048 tokens)."""
    run = {r["id"]: r for r in map(json.loads, RUNS.read_text().splitlines())}[cid]["reference"]
    model, train = _specs(cid)
    VHb = model.vocab_size * model.hidden_size * 4
    more = run["envelope_fine"] - run["single"]
    print(f"{cid}: the shorter shapes reserve {more / 2**30:.2f} GiB more; one V·H block {VHb / 2**30:.2f} GiB")
    assert VHb <= more < 2 * VHb
    tied = switches_on(model, train, step_parts(model, train)).tied
    assert tied is not None and tied(2, 992) and tied(4, 496) and not tied(2, 1024)


def test_the_weights_tails_free_at_step_1s_optimizer_peak_by_hand() -> None:
    """``optimizer_tails`` for Qwen2.5-0.5B in fp32, by hand from CUDACachingAllocator.cpp's rules
    (``get_allocation_size``: a request of at least 10 MiB gets a segment of its size rounded up to 2 MiB, one of
    1 to 10 MiB is cut from a 20 MiB segment; ``should_split``: a rest under 1 MiB stays in its block).

    Each layer's three MLP weights (896 × 4864 × 4 B = 16.625 MiB) get 18 MiB segments: 72 tails of 1.375 MiB. The q
    and o projections (896 × 896 × 4 B = 3.0625 MiB; k and v, 0.44 MiB, and the biases go to the small pool) share
    20 MiB segments six at a time: 48 of them fill 8, each leaving 1.625 MiB. The embedding's 519.31 MiB in a
    520 MiB segment leaves 0.69 MiB, under the 1 MiB a split needs. The smallest per-parameter tensor of the
    optimizer in the large pool is a q or o projection's (3.0625 MiB), larger than every tail: 72 × 1.375 +
    8 × 1.625 = 112 MiB stay free (the replay of the 4 × 512 step: 0.112 GiB in 91 blocks made by the load)."""
    model, train = _specs("qwen2.5-0.5b/full/b4/L512/ckpt/sdpa/fp32")
    got = optimizer_tails(model, train, step_parts(model, train))
    print(f"expected {72 * 1.375 + 8 * 1.625} MiB, got {got / MiB} MiB")
    assert got == 112 * MiB


def _reserved(model: str, train: TrainSpec) -> int:
    led = estimate(resolve_model(model), train)
    return max(led.reserved(ph) for ph in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER))


@settings(max_examples=60, deadline=None)
@given(
    model=st.sampled_from(["qwen2.5-0.5b", "llama-3.2-1b"]),
    optimizer=st.sampled_from([Optimizer.ADAMW, Optimizer.ADAMW_FUSED]),
    b=st.integers(1, 12),
    ell=st.integers(1, 2500),
    db=st.integers(0, 4),
    dl=st.integers(0, 1024),
)
def test_fp32_checkpointed_reserve_never_falls_as_the_shape_grows(
    model: str, optimizer: Optimizer, b: int, ell: int, db: int, dl: int
) -> None:
    """The count with the gradients falls as the shape grows (the room outside the chain and the blocks grow), so a
    run with dynamic padding holds it over the shorter shapes (reserve/shape.py ``chain_gradients_at``, full.py
    ``relaid_regions``) and the estimate never falls."""
    train = TrainSpec(
        method=Method.FULL, precision=Precision.FP32, grad_ckpt=True, optimizer=optimizer,
        micro_batch=b, seq_len=ell,
    )  # fmt: skip
    more = TrainSpec(
        method=Method.FULL, precision=Precision.FP32, grad_ckpt=True, optimizer=optimizer,
        micro_batch=b + db, seq_len=ell + dl,
    )  # fmt: skip
    assert _reserved(model, more) >= _reserved(model, train)
